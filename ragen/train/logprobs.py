"""Per-token log-probs and entropy of the policy, computed only where a loss needs them.

The LM head runs on the hidden states of response positions only, in chunks, so logits
are never materialised for the whole ``B × T × V`` block (for SmolLM2 V = 49 152: a 64 ×
512 batch would be 6 GB in fp32). Works for any HF causal LM whose logits are
``lm_head(decoder(x))`` (``get_decoder`` / ``get_output_embeddings``).
"""

from __future__ import annotations

import torch


def _base_model(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(x_{t+1} | x_{≤t}) at response targets.

    Args:
        input_ids, attention_mask: ``(B, L)``.
        response_mask: ``(B, T)`` with ``T = L - 1``; targets where the result is needed.
        temperature: logits are divided by it, matching the sampling distribution.

    Returns:
        ``logprobs (B, T)`` and, if asked, ``entropy (B, T)``; both zero off the mask.
    """
    base = _base_model(model)
    hidden = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, L, H)
    where = response_mask.bool()  # (B, T)
    h = hidden[:, :-1][where]  # (N, H) hidden states that predict a response token
    targets = input_ids[:, 1:][where]  # (N,)
    head = base.get_output_embeddings()
    logp_parts, ent_parts = [], []
    for start in range(0, h.shape[0], chunk_size):
        logits = head(h[start : start + chunk_size]).float() / temperature  # (n, V) fp32 for a stable softmax
        logp_all = torch.log_softmax(logits, dim=-1)
        logp_parts.append(logp_all.gather(-1, targets[start : start + chunk_size, None]).squeeze(-1))
        if with_entropy:
            ent_parts.append(-(logp_all.exp() * logp_all).sum(-1))
    logprobs = torch.zeros(response_mask.shape, dtype=torch.float32, device=h.device)
    logprobs = logprobs.masked_scatter(where, torch.cat(logp_parts) if logp_parts else logprobs.new_zeros(0))
    entropy = None
    if with_entropy:
        entropy = torch.zeros_like(logprobs).masked_scatter(where, torch.cat(ent_parts) if ent_parts else logprobs.new_zeros(0))
    return logprobs, entropy
