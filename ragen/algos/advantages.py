"""Advantage estimators (pure torch), each registered by name in :mod:`ragen.algos.registry`.

Every estimator has the same signature ``fn(inp: AdvantageInputs) -> AdvantageOutputs``, so the
trainer never special-cases one. Dims: B = batch (sequences), T = tokens.

Conventions shared by all estimators:
    * ``token_rewards`` (B, T) holds the reward on tokens: the trajectory reward on the last
      model-written token, or per-turn rewards on each turn's last model-written token.
    * Outcome ("score") estimators use the per-sequence score ``Σ_t token_rewards[b, t]`` (over
      all T positions; the trainer places rewards on model-written tokens).
    * ``advantages`` is 0 outside ``response_mask``.
    * ``norm_adv_by_std`` always means "divide by the std of the normalisation population" (the
      group for grpo/gigpo, the batch for brpo, the batch's masked tokens for reinforce_pp*, gae
      and bi_level_gae); with it off only the mean is subtracted. All stds are unbiased.
    * Token-level estimators (reinforce_pp, gae, bi_level_gae) chain only over masked tokens:
      env/observation tokens between turns are skipped, so their values and rewards never
      matter (rewards must therefore sit on model-written tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ragen.algos.core import group_stats, masked_mean, masked_whiten, widened
from ragen.algos.registry import register_adv_estimator


@dataclass
class AdvantageInputs:
    """Inputs of every advantage estimator (fields an estimator does not use are ignored)."""

    token_rewards: Tensor  # (B, T) float
    response_mask: Tensor  # (B, T) bool/float; 1 on model-written (loss) tokens
    group_ids: Tensor  # (B,) long; rollouts from the same seed/prompt share an id
    values: Tensor | None = None  # (B, T) critic values (gae / bi_level_gae)
    turn_ends: Tensor | None = None  # (B, T) bool; True at the last model-written token of each turn
    gamma: float = 1.0
    lam: float = 1.0
    high_level_gamma: float = 0.95
    norm_adv_by_std: bool = True  # GRPO's std normalisation (Dr.GRPO turns it off)
    eps: float = 1e-6
    # GiGPO (Feng et al. 2025) step-level inputs
    # Both are read at each turn's last model-written token (the trainer may fill the whole turn).
    anchor_ids: Tensor | None = None  # (B, T) long; anchor-state id on each turn's tokens, -1 elsewhere
    step_returns: Tensor | None = None  # (B, T) float; discounted return from each turn, on its tokens
    gigpo_step_weight: float = 1.0  # omega in A = A_episode + omega * A_step


@dataclass
class AdvantageOutputs:
    advantages: Tensor  # (B, T), zero outside response_mask
    returns: Tensor  # (B, T)
    metrics: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def sequence_scores(token_rewards: Tensor) -> Tensor:
    """Per-sequence score: (B, T) → (B,), the sum of the token rewards over the sequence.

    Summed in fp64 (:func:`~ragen.algos.core.widened`), so equal returns paid in other turns give equal scores
    (in fp32 the sum depends on the order), and returned in the rewards' float dtype."""
    rewards = token_rewards if token_rewards.is_floating_point() else token_rewards.float()
    return widened(rewards).sum(dim=-1).to(rewards.dtype)


def broadcast_to_tokens(seq_adv: Tensor, response_mask: Tensor) -> Tensor:
    """(B,) sequence advantage → (B, T): the scalar on every masked token, 0 elsewhere."""
    mask = response_mask.bool()
    return torch.where(mask, seq_adv[:, None].expand(mask.shape), 0.0)


def group_normalized_scores(
    scores: Tensor, keys: Tensor, norm_by_std: bool, eps: float
) -> Tensor:
    """Group-relative advantage of each element: ``(s − mean_g) / (std_g + eps)`` (or ``s − mean_g``).

    Args:
        scores: (N,) float.
        keys: (N,) or (N, K) long group keys.
    Returns:
        (N,); 0 for elements whose group has size 1 (no baseline is available).
        std is unbiased (Bessel-corrected, ``torch.std``'s default), as in verl's GRPO.
    """
    mean, std, count = group_stats(scores, keys)
    centred = scores - mean
    adv = centred / (std + eps) if norm_by_std else centred
    return torch.where(count > 1, adv, torch.zeros_like(adv))


def _metrics(scores: Tensor | None, advantages: Tensor, returns: Tensor, mask: Tensor) -> dict[str, float]:
    mask = mask.bool()
    adv_tokens = advantages[mask]
    out = {
        "adv/advantages_mean": float(masked_mean(advantages, mask)),
        "adv/advantages_max": float(adv_tokens.max()) if adv_tokens.numel() else 0.0,
        "adv/advantages_min": float(adv_tokens.min()) if adv_tokens.numel() else 0.0,
        "adv/returns_mean": float(masked_mean(returns, mask)),
    }
    if scores is not None and scores.numel():
        out["adv/score_mean"] = float(scores.mean())
        out["adv/score_std"] = float(scores.std()) if scores.numel() > 1 else 0.0
    return out


def _outcome_outputs(seq_adv: Tensor, scores: Tensor, inp: AdvantageInputs) -> AdvantageOutputs:
    """Outputs of an outcome estimator: broadcast (B,) advantage to tokens; returns = advantages."""
    advantages = broadcast_to_tokens(seq_adv, inp.response_mask)  # (B, T)
    metrics = _metrics(scores, advantages, advantages, inp.response_mask)
    return AdvantageOutputs(advantages, advantages.clone(), metrics)


def _as(like: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
    """``tensors`` in ``like``'s dtype (the results of an fp64 chain, back in the critic's dtype)."""
    return tuple(t.to(like.dtype) for t in tensors)


def _token_outputs(advantages: Tensor, returns: Tensor, inp: AdvantageInputs) -> AdvantageOutputs:
    """Outputs of a token-level estimator, with the shared metrics."""
    scores = sequence_scores(inp.token_rewards)  # (B,)
    return AdvantageOutputs(advantages, returns, _metrics(scores, advantages, returns, inp.response_mask))


# ---------------------------------------------------------------------------------------------
# outcome (critic-free) estimators
# ---------------------------------------------------------------------------------------------


@register_adv_estimator("grpo")
def grpo(inp: AdvantageInputs) -> AdvantageOutputs:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath §4.1.2, the Â_{i,t} of eq. 3).

    For sequence i in group g (same ``group_ids``) with score r_i = Σ_t token_rewards[i, t]:
        Â_i = (r_i − mean_g(r)) / (std_g(r) + eps)   if ``norm_adv_by_std``
        Â_i =  r_i − mean_g(r)                       otherwise (Dr.GRPO, Liu et al. 2025)
    std_g is the unbiased (correction=1) std, as ``torch.std`` and verl. A group of size 1 gets
    Â = 0. Â_i is broadcast to every masked token of sequence i.

    Shapes: token_rewards/response_mask (B, T), group_ids (B,) → advantages/returns (B, T);
    returns = advantages.
    """
    scores = sequence_scores(inp.token_rewards)  # (B,)
    seq_adv = group_normalized_scores(scores, inp.group_ids, inp.norm_adv_by_std, inp.eps)  # (B,)
    return _outcome_outputs(seq_adv, scores, inp)


@register_adv_estimator("dr_grpo")
def dr_grpo(inp: AdvantageInputs) -> AdvantageOutputs:
    """Dr.GRPO advantage (Liu et al. 2025, "Understanding R1-Zero-like Training: A Critical
    Perspective", §3, "Dr. GRPO: Group Relative Policy Optimization Done Right").

    Â_i = r_i − mean_g(r): GRPO without the std normalisation (``norm_adv_by_std`` is ignored).
    Dr.GRPO's second fix, removing GRPO's per-sequence length normalisation 1/|o_i|, is not an
    advantage property but the loss aggregation's, chosen on its own (``algorithm.loss_agg_mode``, not
    switched by this estimator): the default ``token-mean`` divides by the batch's token count and
    ``seq-mean-token-sum`` by the sequence count, both constant within a step as the paper asks;
    only ``seq-mean-token-mean`` brings 1/|o_i| back. A group of size 1 gets 0. Shapes as :func:`grpo`.
    """
    scores = sequence_scores(inp.token_rewards)  # (B,)
    seq_adv = group_normalized_scores(scores, inp.group_ids, norm_by_std=False, eps=inp.eps)  # (B,)
    return _outcome_outputs(seq_adv, scores, inp)


@register_adv_estimator("brpo")
def brpo(inp: AdvantageInputs) -> AdvantageOutputs:
    """Batch-relative outcome advantage: GRPO's normalisation with the *batch* as the group.

    Â_i = (r_i − mean_batch(r)) / (std_batch(r) + eps)   (or r_i − mean_batch(r) without
    ``norm_adv_by_std``), i.e. a REINFORCE baseline estimated over the whole batch instead of per
    prompt (cf. REINFORCE++'s global normalisation, Hu 2025). ``group_ids`` is ignored; a batch of
    one sequence gets 0. Shapes as :func:`grpo`.
    """
    scores = sequence_scores(inp.token_rewards)  # (B,)
    batch_key = torch.zeros_like(inp.group_ids)  # (B,) everyone in one group
    seq_adv = group_normalized_scores(scores, batch_key, inp.norm_adv_by_std, inp.eps)  # (B,)
    return _outcome_outputs(seq_adv, scores, inp)


@register_adv_estimator("arpo")
def arpo(inp: AdvantageInputs) -> AdvantageOutputs:
    """Absolute-reward outcome advantage: Â_i = r_i, the raw score with no baseline (vanilla
    REINFORCE, Williams 1992). Shapes as :func:`grpo`; ``group_ids`` is ignored."""
    scores = sequence_scores(inp.token_rewards)  # (B,)
    return _outcome_outputs(scores, scores, inp)


@register_adv_estimator("rloo")
def rloo(inp: AdvantageInputs) -> AdvantageOutputs:
    """REINFORCE leave-one-out (Kool et al. 2019 "Buy 4 REINFORCE Samples, Get a Baseline for
    Free!"; Ahmadian et al. 2024 "Back to Basics", RLOO estimator).

    Â_i = r_i − 1/(n−1) Σ_{j≠i, j∈g} r_j = n/(n−1) · (r_i − mean_g(r)) for a group of size n;
    a group of size 1 gets 0. No std normalisation. Shapes as :func:`grpo`.
    """
    scores = sequence_scores(inp.token_rewards)  # (B,)
    mean, _, count = group_stats(scores, inp.group_ids)  # (B,) each
    loo = (scores - mean) * count / (count - 1).clamp(min=1)  # (B,)
    seq_adv = torch.where(count > 1, loo, torch.zeros_like(loo))
    return _outcome_outputs(seq_adv, scores, inp)


# ---------------------------------------------------------------------------------------------
# token-level estimators
# ---------------------------------------------------------------------------------------------


def masked_gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lam: float,
    fixed: Tensor | None = None,
    fixed_adv: Tensor | None = None,
) -> Tensor:
    """GAE (Schulman et al. 2016, eq. 16) along the masked positions of each row, skipping the rest.

    For consecutive masked positions t < t' of a row (t' the next masked position, none at the end):
        δ_t = r_t + γ·V_{t'} − V_t          (V_{t'} = 0 after the last masked position)
        A_t = δ_t + γλ·A_{t'}
    Where ``fixed`` (B, T) bool is set, A_t is replaced by ``fixed_adv`` (B, T) and the chain
    restarts from it (used to bootstrap tokens from a turn-level advantage).

    Args:
        rewards, values: (B, T); entries outside ``mask`` are never read into the result.
        mask: (B, T) bool/float.
    Returns:
        advantages (B, T), 0 outside ``mask``. Vectorised over B; a reverse loop over T.
    """
    mask = mask.bool()
    B, T = rewards.shape
    next_value = rewards.new_zeros(B)  # (B,) V of the next masked position
    next_adv = rewards.new_zeros(B)  # (B,) A of the next masked position
    advantages = torch.zeros_like(rewards)  # (B, T)
    for t in reversed(range(T)):
        m = mask[:, t]  # (B,)
        adv_t = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_adv
        if fixed is not None:
            adv_t = torch.where(fixed[:, t], fixed_adv[:, t], adv_t)
        advantages[:, t] = torch.where(m, adv_t, 0.0)
        next_value = torch.where(m, values[:, t], next_value)
        next_adv = torch.where(m, adv_t, next_adv)
    return advantages


def _batch_normalize(x: Tensor, mask: Tensor, by_std: bool, eps: float) -> Tensor:
    """Whitening over all masked tokens (or centring only); 0 outside ``mask``. (B, T) → (B, T), in fp64
    (:func:`~ragen.algos.core.widened`), returned in ``x``'s dtype."""
    if by_std:
        return masked_whiten(x, mask, eps=eps)
    wide = widened(x)
    return torch.where(mask.bool(), wide - masked_mean(wide, mask), 0.0).to(x.dtype)


def _require(inp: AdvantageInputs, estimator: str, *fields: str) -> None:
    missing = [f for f in fields if getattr(inp, f) is None]
    if missing:
        raise ValueError(f"advantage estimator {estimator!r} needs AdvantageInputs.{', '.join(missing)}")


@register_adv_estimator("reinforce_pp")
def reinforce_pp(inp: AdvantageInputs) -> AdvantageOutputs:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs").

    Token-level discounted return over the masked tokens of each sequence,
        G_t = r_t + γ·G_{t'}     (t' the next model-written token; env tokens are skipped),
    then global normalisation over all masked tokens of the batch: A = (G − mean) / (std + eps)
    (only centred without ``norm_adv_by_std``). Shapes (B, T) → (B, T); returns = G.
    """
    mask = inp.response_mask.bool()
    rewards = widened(inp.token_rewards)  # equal returns stay equal through the chain (see the GAE note below)
    returns = masked_gae(rewards, torch.zeros_like(rewards), mask, inp.gamma, lam=1.0)  # (B, T) G_t
    advantages = _batch_normalize(returns, mask, inp.norm_adv_by_std, inp.eps)
    return _token_outputs(*_as(inp.token_rewards, advantages, returns), inp)


@register_adv_estimator("reinforce_pp_baseline")
def reinforce_pp_baseline(inp: AdvantageInputs) -> AdvantageOutputs:
    """REINFORCE++-baseline (Hu 2025, §"REINFORCE++ w/ baseline"; verl's
    ``reinforce_plus_plus_baseline``).

    Per-sequence score minus its group mean (a group of size 1 gets 0), broadcast to the masked
    tokens, then normalised over all masked tokens of the batch (token-weighted):
    A = (Ã − mean) / (std + eps), centred only without ``norm_adv_by_std``. returns = advantages.
    """
    mask = inp.response_mask.bool()
    scores = sequence_scores(inp.token_rewards)  # (B,)
    centred = group_normalized_scores(scores, inp.group_ids, norm_by_std=False, eps=inp.eps)  # (B,)
    advantages = _batch_normalize(broadcast_to_tokens(centred, mask), mask, inp.norm_adv_by_std, inp.eps)
    return AdvantageOutputs(advantages, advantages.clone(), _metrics(scores, advantages, advantages, mask))


@register_adv_estimator("gae")
def gae(inp: AdvantageInputs) -> AdvantageOutputs:
    """Token-level GAE (Schulman et al. 2016, eq. 16) for PPO with a critic.

    The chain runs over model-written tokens only (:func:`masked_gae`): δ's skip env/observation
    tokens, so ``values`` at unmasked positions never change the result. returns = A + V (the
    critic's target, taken before normalisation); advantages are then whitened over all masked
    tokens of the batch when ``norm_adv_by_std`` (verl's default for GAE), else centred.

    Needs ``values`` (B, T). Shapes (B, T) → (B, T).
    """
    _require(inp, "gae", "values")
    mask = inp.response_mask.bool()
    # The chain runs in fp64 (on the CPU, cheap at (B, T)): in fp32 the reverse sum over T tokens accumulates
    # ~T·1e-7·|V| of rounding, so equal returns (every reward 0, say) vary with the critic's values.
    rewards, values = widened(inp.token_rewards), widened(inp.values)
    raw = masked_gae(rewards, values, mask, inp.gamma, inp.lam)  # (B, T)
    returns = torch.where(mask, raw + values, 0.0)  # (B, T)
    advantages = _batch_normalize(raw, mask, inp.norm_adv_by_std, inp.eps)
    return _token_outputs(*_as(inp.values, advantages, returns), inp)


def effective_turn_ends(turn_ends: Tensor | None, response_mask: Tensor) -> Tensor:
    """Turn ends restricted to model-written tokens, plus the last model-written token of every
    sequence (so a truncated final turn is still closed). (B, T) bool."""
    mask = response_mask.bool()
    tokens_from_here = mask.flip(-1).cumsum(-1).flip(-1)  # (B, T) masked tokens at positions ≥ t
    last_token = mask & (tokens_from_here == 1)  # (B, T)
    ends = last_token if turn_ends is None else (turn_ends.bool() & mask) | last_token
    return ends


@register_adv_estimator("bi_level_gae")
def bi_level_gae(inp: AdvantageInputs) -> AdvantageOutputs:
    """Bi-level GAE: turn-level credit across turns, token-level GAE inside each turn
    (VAGEN, Wang et al. 2025, "Turn-level / bi-level GAE"; RAGEN's ``compute_bi_level_gae_advantage_return``).

    Variant implemented (the RAGEN/VAGEN one). Let e_1 < … < e_K be the turn ends of a sequence
    (``turn_ends`` on model-written tokens, plus its last model-written token), R_k the reward on
    token e_k and V_k = values[e_k] (the value at each turn's *last* token):
        1. turn level, γ_H = ``high_level_gamma``, same λ = ``lam``:
               δ^H_k = R_k + γ_H·V_{k+1} − V_k   (V_{K+1} = 0),   A^H_k = δ^H_k + γ_H·λ·A^H_{k+1}
        2. token level inside turn k: A_{e_k} = A^H_k (i.e. the turn-end token's target is the
           turn-level return A^H_k + V_k); for earlier model-written tokens t of the turn
               δ_t = r_t + γ·V_{t'} − V_t,   A_t = δ_t + γ·λ·A_{t'}   (t' = next masked token)
    Rewards on non-turn-end tokens enter step 2 only, so nothing is counted twice. Turn boundaries
    come from ``turn_ends`` only (never from reward ≠ 0). returns = A + V before normalisation;
    advantages are whitened over masked tokens when ``norm_adv_by_std`` (as RAGEN), else centred.
    With a single turn this equals :func:`gae`.

    Needs ``values`` and ``turn_ends`` (B, T). Shapes (B, T) → (B, T).
    """
    _require(inp, "bi_level_gae", "values", "turn_ends")
    mask = inp.response_mask.bool()
    ends = effective_turn_ends(inp.turn_ends, mask)  # (B, T)
    rewards, values = widened(inp.token_rewards), widened(inp.values)
    turn_adv = masked_gae(rewards, values, ends, inp.high_level_gamma, inp.lam)  # (B, T) A^H at ends
    raw = masked_gae(rewards, values, mask, inp.gamma, inp.lam, fixed=ends, fixed_adv=turn_adv)
    returns = torch.where(mask, raw + values, 0.0)
    advantages = _batch_normalize(raw, mask, inp.norm_adv_by_std, inp.eps)
    return _token_outputs(*_as(inp.values, advantages, returns), inp)


# ---------------------------------------------------------------------------------------------
# GiGPO
# ---------------------------------------------------------------------------------------------


def _turn_index(ends: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Flat turn numbering of a batch.

    Args:
        ends: (B, T) bool turn ends.
    Returns:
        ``(rows, cols, token_turn)``: (N,) row and column of each of the N turn ends in row-major
        order, and (B, T) the flat index (into 0..N-1) of the turn each token belongs to, i.e. of
        the first turn end at or after it in the same row (−1 if there is none).
    """
    rows, cols = ends.nonzero(as_tuple=True)  # (N,), (N,)
    per_row = ends.sum(-1)  # (B,)
    row_offset = per_row.cumsum(0) - per_row  # (B,) flat index of each row's first turn
    turn_in_row = ends.cumsum(-1) - ends.long()  # (B, T) turns that ended strictly before t
    token_turn = row_offset[:, None] + turn_in_row  # (B, T)
    return rows, cols, torch.where(turn_in_row < per_row[:, None], token_turn, -1)


def gigpo_step_advantage(inp: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GiGPO step-level advantage A^S (Feng et al. 2025, §"step-level relative advantage").

    Turns are closed by :func:`effective_turn_ends`; each turn's anchor state and discounted return
    are read at its last token (``anchor_ids``, ``step_returns``). Turns with anchor id < 0 get 0.
    Anchored turns are grouped by (``group_ids``, anchor id) and normalised like GRPO scores.

    Returns:
        ``(step_adv, group_size)``: (B, T) A^S on every model-written token of its turn, and (N_a,)
        the anchor-group size of each anchored turn (for metrics).
    """
    mask = inp.response_mask.bool()
    rows, cols, token_turn = _turn_index(effective_turn_ends(inp.turn_ends, mask))
    anchors = inp.anchor_ids[rows, cols]  # (N,)
    anchored = (anchors >= 0).nonzero(as_tuple=True)[0]  # (N_a,) indices of anchored turns
    keys = torch.stack([inp.group_ids[rows[anchored]], anchors[anchored]], dim=-1)  # (N_a, 2)
    turn_returns = inp.step_returns[rows[anchored], cols[anchored]].to(inp.token_rewards.dtype)  # (N_a,)
    step_turn = inp.token_rewards.new_zeros(len(rows) + 1)  # (N + 1,), last slot: "no turn"
    step_turn[anchored] = group_normalized_scores(turn_returns, keys, inp.norm_adv_by_std, inp.eps)
    token_turn = torch.where(mask & (token_turn >= 0), token_turn, len(rows))  # (B, T)
    return step_turn[token_turn], group_stats(turn_returns, keys)[2]


@register_adv_estimator("gigpo")
def gigpo(inp: AdvantageInputs) -> AdvantageOutputs:
    """GiGPO (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training").

    A = A^E + ω·A^S with ω = ``gigpo_step_weight``:
        * episode level A^E: GRPO's group-relative score of the trajectory over ``group_ids``
          (÷ std when ``norm_adv_by_std``, else F_norm = 1), on every masked token;
        * step level A^S (:func:`gigpo_step_advantage`): each turn's discounted return
          (``step_returns``) normalised within its *anchor-state group* — the turns of the same
          ``group_ids`` group whose ``anchor_ids`` are equal — put on the turn's masked tokens.
          A state visited once (anchor group of size 1) gets A^S = 0.
    Anchor groups are counted per turn, not per token. Needs ``turn_ends``, ``anchor_ids``,
    ``step_returns`` (B, T). returns = advantages.
    """
    _require(inp, "gigpo", "turn_ends", "anchor_ids", "step_returns")
    mask = inp.response_mask.bool()
    scores = sequence_scores(inp.token_rewards)  # (B,)
    episode_seq = group_normalized_scores(scores, inp.group_ids, inp.norm_adv_by_std, inp.eps)  # (B,)
    step, anchor_group_size = gigpo_step_advantage(inp)  # (B, T), (N_a,)
    advantages = broadcast_to_tokens(episode_seq, mask) + inp.gigpo_step_weight * step  # (B, T)
    metrics = _metrics(scores, advantages, advantages, mask)
    if anchor_group_size.numel():
        metrics["adv/gigpo_step_nontrivial_frac"] = float((anchor_group_size > 1).float().mean())
    return AdvantageOutputs(advantages, advantages.clone(), metrics)
