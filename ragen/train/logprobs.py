"""Per-token log-probs, entropy and critic values, computed only where a loss needs them.

The LM head runs on the hidden states of response positions only, in chunks, so logits
are never materialised for the whole ``B × T × V`` block (for SmolLM2 V = 49 152: a 64 ×
512 batch would be 6 GB in fp32). Works for any HF causal LM whose logits are
``lm_head(decoder(x))`` (``get_decoder`` / ``get_output_embeddings``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PolicyOutput:
    logprobs: torch.Tensor  # (B, T) log π(x_{t+1} | x_{≤t}), zero off the response mask
    entropy: torch.Tensor | None  # (B, T) entropy of π(· | x_{≤t}), zero off the mask
    values: torch.Tensor | None  # (B, T) critic value of the state x_{≤t}, zero off the mask


def _base_model(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def policy_forward(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    value_head: torch.nn.Module | None = None,
    chunk_size: int = 1024,
) -> PolicyOutput:
    """One decoder pass → log-probs (and entropy, values) at response targets.

    Args:
        input_ids, attention_mask: ``(B, L)``.
        response_mask: ``(B, T)`` with ``T = L - 1``; targets where results are needed.
        temperature: logits are divided by it, matching the sampling distribution.
        value_head: a module mapping hidden states ``(N, H)`` to values ``(N,)`` (shared-backbone critic).
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

    def scatter(parts: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat(parts) if parts else h.new_zeros(0, dtype=torch.float32)
        return torch.zeros(response_mask.shape, dtype=torch.float32, device=h.device).masked_scatter(where, flat)

    return PolicyOutput(
        logprobs=scatter(logp_parts),
        entropy=scatter(ent_parts) if with_entropy else None,
        values=scatter([value_head(h).float()]) if value_head is not None else None,
    )


def token_logprobs(model, input_ids, attention_mask, response_mask, *, temperature=1.0, with_entropy=False, chunk_size=1024):
    """``(logprobs, entropy)`` at response targets; see :func:`policy_forward`."""
    out = policy_forward(model, input_ids, attention_mask, response_mask, temperature=temperature,
                         with_entropy=with_entropy, chunk_size=chunk_size)
    return out.logprobs, out.entropy


class ValueHead(torch.nn.Module):
    """Scalar value of each position's hidden state: ``V(s_t) = w·h_t + b`` (zero-initialised)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, H) -> (N,)
        return self.linear(hidden.float()).squeeze(-1)
