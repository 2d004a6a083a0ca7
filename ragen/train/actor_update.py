"""The StarPO update stage: one batch of trajectories in, one policy (and critic) update out.

:meth:`ActorUpdate.update` reads top to bottom: StarPO-S filter → scoring pass (log π_old, values,
log π_ref) → advantages over whole trajectories (:mod:`ragen.algos`) → ``ppo_epochs`` passes of
mini-batch optimizer steps, each accumulated over token-budget micro-batches
(:mod:`ragen.train.micro_batches`). The losses are :mod:`ragen.algos.losses`' pure functions; this
module only feeds them and steps the optimizer.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from ragen.agent import Trajectory
from ragen.algos import AdvantageInputs, aggregate_loss, entropy_loss, get_adv_estimator, get_policy_loss, masked_mean
from ragen.algos.losses import kl_penalty, value_loss
from ragen.config import RunConfig
from ragen.models import autocast
from ragen.runtime import return_freed_memory
from ragen.train import micro_batches
from ragen.train.batch import TrainBatch, collate, collate_turns
from ragen.train.checkpoint_choice import CheckpointingChoice
from ragen.train.distributed import all_ranks, all_reduce_grads, broadcast_object, rank_world, reduce_metrics, shard
from ragen.train.fsdp import clip_grad_norm_
from ragen.train.logprobs import ValueHead, policy_forward, shared_prompt_layout
from ragen.train.optimizer import adamw, step_if_finite
from ragen.train.per_tag import per_tag_advantages, per_tag_filter
from ragen.train.update_targets import (EV_PREFIX, LOSS_METRICS, ExplainedVarianceSums, UpdateTargets,
                                        group_contiguous)


class ActorUpdate:
    """The policy (and optional critic head) with its optimizer, and the update that trains them.

    ``ref_model`` is the frozen initial policy for a KL term (None under LoRA, whose base with the adapters
    disabled is the reference, or without a KL term). ``fsdp``: the model is sharded over the ranks, so every
    decoder pass is a collective that all ranks run together.
    """

    def __init__(self, config: RunConfig, model, ref_model, value_head: ValueHead | None, pad_id: int,
                 device: torch.device, fsdp: bool, checkpointing: CheckpointingChoice):
        self.config = config
        self.model, self.ref_model, self.value_head = model, ref_model, value_head
        self.pad_id, self.device, self.fsdp, self.checkpointing = pad_id, device, fsdp, checkpointing
        self.adv_estimator = get_adv_estimator(config.algorithm.adv_estimator)
        self.policy_loss = get_policy_loss(config.algorithm.policy_loss)
        optim = config.optim
        self.optimizer = adamw(self.trainable_parameters(), lr=optim.lr, betas=tuple(optim.betas),
                               weight_decay=optim.weight_decay, fused=optim.fused)
        warmup = optim.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        )
        #: The last update's trained episodes and their ``(B, T)`` advantages (None: that update trained nothing).
        self.last_advantages: tuple[list[Trajectory], torch.Tensor] | None = None

    def update(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """Filter → score → advantages → ``ppo_epochs`` passes of clipped-PG mini-batch steps."""
        alg = self.config.algorithm
        self.last_advantages = None  # this step's, once computed: a skipped update logs every episode as left out
        usable = [t for t in trajectories if not t.error and t.response_length > 0]
        if not usable:
            return {"actor/skipped_update": 1.0}
        usable, metrics = self.uncertainty_filter(usable)
        if not usable:  # filter_mode=top_p_ragen keeps no group when none has reward spread
            return {**metrics, "actor/skipped_update": 1.0}
        batch = collate(usable, self.pad_id, step_gamma=alg.gigpo_gamma)  # one row per episode: advantages live here
        # What the policy trains on: the episodes themselves, or (context_mode=window) one row per turn.
        if self.config.agent.context_mode == "window":
            samples, turn_index = collate_turns(usable, self.pad_id)
            to_samples = lambda x: turn_index.to_turns(x, samples.response_mask.shape)  # noqa: E731
            to_episodes = lambda x: turn_index.to_episodes(x, batch.response_mask.shape)  # noqa: E731
        else:
            samples, to_samples, to_episodes = batch, (lambda x: x), (lambda x: x)
        mini = alg.mini_batch_size or len(samples)
        # π_old is needed only when the policy moves between updates on this batch; values,
        # reference log-probs likewise come from one scoring pass before any update.
        moves = alg.ppo_epochs > 1 or mini < len(samples)
        # log π_old: for a policy that moves during the update, or for the in-reward KL; a KL loss alone compares the
        # training forward's own log-probs with the reference, so it needs only log π_ref here
        scored = self.score(samples, policy=moves or alg.use_kl_in_reward, values=self.value_head is not None,
                            ref=self.uses_kl)
        per_episode = {k: to_episodes(v) for k, v in scored.items()}
        token_rewards = batch.turn_rewards if alg.use_turn_rewards else batch.token_rewards
        if alg.use_kl_in_reward:
            kl = kl_penalty(per_episode["logprobs"], per_episode["ref_logprobs"], alg.kl_in_reward_type) * batch.response_mask
            token_rewards = token_rewards - alg.kl_coef * kl
            metrics["actor/kl_in_reward"] = float(masked_mean(kl, batch.response_mask))
        adv = per_tag_advantages(  # never across tags: see ragen/train/per_tag.py
            self.adv_estimator,
            AdvantageInputs(
                token_rewards=token_rewards, response_mask=batch.response_mask, group_ids=batch.group_ids,
                values=per_episode.get("values"), turn_ends=batch.turn_ends, gamma=alg.gamma, lam=alg.lam,
                high_level_gamma=alg.high_level_gamma, norm_adv_by_std=alg.norm_adv_by_std,
                anchor_ids=batch.anchor_ids, step_returns=batch.step_returns, gigpo_step_weight=alg.gigpo_step_weight,
            ),
            [t.tag or t.env_name for t in usable],
        )
        self.last_advantages = (usable, adv.advantages)
        targets = UpdateTargets(
            advantages=to_samples(adv.advantages), returns=to_samples(adv.returns),
            old_logprobs=scored.get("logprobs") if moves else None,
            old_values=scored.get("values"), ref_logprobs=scored.get("ref_logprobs"),
        )
        self.checkpointing.before_update(int(samples.attention_mask.sum(1).max()))
        self.model.train()
        zero_gradient = self.gradient_is_zero(targets.advantages)  # the same on every rank: advantages are global
        history: list[dict[str, float]] = []
        for _ in range(alg.ppo_epochs):
            order = broadcast_object(torch.randperm(len(samples)))  # rank 0's draw: the same mini-batches on every rank
            for start in range(0, len(samples), mini):
                index = group_contiguous(order[start : start + mini], samples.group_ids)
                history.append(self.optimizer_step(samples.select(index), targets.select(index), zero_gradient=zero_gradient))
        # per optimizer step, averaged; the explained variance from the steps' pooled sums (exact over the update)
        ev_sums = {k: sum(h.pop(k) for h in history) for k in list(history[0]) if k.startswith(EV_PREFIX)}
        metrics.update({k: float(np.mean([h[k] for h in history])) for k in history[0]})
        if self.value_head is not None:
            metrics["critic/explained_variance"] = ExplainedVarianceSums.from_metrics(ev_sums)
        metrics["actor/backward_skipped"] = float(zero_gradient)
        metrics.update(adv.metrics)
        return metrics

    def uncertainty_filter(self, trajectories: list[Trajectory]) -> tuple[list[Trajectory], dict[str, float]]:
        """StarPO-S: train only on the groups whose rewards vary most (``algorithm.filter_ratio``), within each tag."""
        alg = self.config.algorithm
        if alg.filter_ratio >= 1:
            return trajectories, {}
        scores = torch.tensor([t.reward for t in trajectories], dtype=torch.float64)  # ranked in fp64 (filtering.py)
        groups = torch.tensor([t.group_id for t in trajectories])
        tags = [t.tag or t.env_name for t in trajectories]
        keep, metrics = per_tag_filter(scores, groups, tags, keep_ratio=alg.filter_ratio, mode=alg.filter_mode)
        return [t for t, k in zip(trajectories, keep.tolist()) if k], metrics

    def gradient_is_zero(self, advantages: torch.Tensor) -> bool:
        """True when the update's loss has an exactly zero gradient, whatever the policy's log-probs.

        The clipped PG loss is linear in the advantage at every token (``-A·r`` or ``-A·clip(r)``),
        so ``A = 0`` everywhere -- e.g. every group's rewards equal under GRPO, as after an SFT
        that already solves the task -- makes it 0 with gradient 0, unless an entropy bonus, a
        KL loss or a critic adds a term of its own. Such a step still calls AdamW (on zero
        gradients: its moments decay and weight decay applies, exactly as after a backward pass
        that returned zeros) but skips the backward pass.
        """
        alg = self.config.algorithm
        if alg.policy_loss != "clipped" or alg.entropy_coeff != 0 or alg.use_kl_loss or self.value_head is not None:
            return False  # a registered loss of the user's own need not vanish with A
        return not bool(advantages.any())

    def optimizer_step(self, batch: TrainBatch, targets: "UpdateTargets", zero_gradient: bool = False) -> dict[str, float]:
        """One optimizer step on ``batch`` with gradient accumulation over micro-batches.

        Each micro-batch's aggregated loss is weighted by its share of the mini-batch's
        tokens (token-mean) or sequences (seq-mean-*), so accumulation equals one big pass.
        Under torchrun each rank runs only its slice of ``batch`` with the same global
        denominators, and gradients/metrics are summed over ranks (``ragen/train/distributed.py``).
        ``zero_gradient`` (see :meth:`gradient_is_zero`): forward passes without autograd for the
        metrics, no backward, and AdamW steps on gradients set to exact zeros.
        """
        alg = self.config.algorithm
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = batch.response_mask.sum().clamp(min=1)  # global: every rank holds the whole mini-batch
        # this rank's rows (a random slice: the mini-batch is shuffled), whole groups longest-first
        # within it, cut into micro-batches by row count and token budget (ragen/train/micro_batches.py)
        local_rows, passes = self.local_micro_batches(batch, rank_world()[0])
        local, local_targets = batch.select(local_rows), targets.select(local_rows)
        sums: dict[str, float] = {}
        ev_sums = ExplainedVarianceSums()
        # FSDP: every rank runs as many passes as the busiest one (each pass is a collective);
        # a rank out of rows repeats the batch's first row with weight 0.
        count = max(len(self.local_micro_batches(batch, r)[1]) for r in range(rank_world()[1])) if self.fsdp else len(passes)
        for i in range(count):
            padding = i >= len(passes)
            source, source_targets = (batch, targets) if padding else (local, local_targets)
            rows = slice(0, 1) if padding else slice(passes[i].start, passes[i].stop)
            micro = source.select(rows).trim().to(self.device)  # batches live on the CPU until they meet the model
            T = micro.response_mask.shape[1]
            tgt = source_targets.select(rows, T).to(self.device)
            shared = self.prompt_lengths(micro)
            with autocast(self.config.trainer.precision, self.device.type), torch.set_grad_enabled(not zero_gradient):
                out = policy_forward(
                    self.model, micro.input_ids, micro.attention_mask, micro.response_mask,
                    temperature=self.config.rollout.temperature, with_entropy=True,
                    entropy_grad=alg.entropy_coeff != 0,  # else the entropy is a metric: no backward through it
                    value_head=self.value_head,
                    # on a checkpointed model decoder_hidden runs full rows instead (ragen/train/logprobs.py)
                    prompt_lengths=shared, prompt_layout=self.agreed_layout(micro, shared), fast=alg.fast_update,
                )
            old = out.logprobs.detach() if tgt.old_logprobs is None else tgt.old_logprobs
            pg_loss, step_metrics = self.policy_loss(
                out.logprobs, old, tgt.advantages, micro.response_mask, clip_ratio_low=alg.clip_ratio_low,
                clip_ratio_high=alg.clip_ratio_high, clip_ratio_c=alg.clip_ratio_c, loss_agg_mode=alg.loss_agg_mode,
            )
            entropy = entropy_loss(out.entropy, micro.response_mask, alg.loss_agg_mode)
            loss = pg_loss - alg.entropy_coeff * entropy if alg.entropy_coeff else pg_loss
            step_metrics["actor/entropy"] = entropy.item()
            if alg.use_kl_loss:
                kl = aggregate_loss(kl_penalty(out.logprobs, tgt.ref_logprobs, alg.kl_type), micro.response_mask, alg.loss_agg_mode)
                loss = loss + alg.kl_coef * kl
                step_metrics["actor/kl_loss"] = kl.item()
            if out.values is not None:
                v_loss, v_metrics = value_loss(out.values, tgt.old_values, tgt.returns, micro.response_mask,
                                               alg.clip_range_value, alg.loss_agg_mode)
                loss = loss + alg.value_coef * v_loss
                step_metrics.update(v_metrics)
            step_metrics["actor/loss"] = loss.item()
            token_share = micro.response_mask.sum() / total_tokens
            share = token_share if alg.loss_agg_mode == "token-mean" else len(micro) / len(batch)
            if padding:
                share = 0.0 * share
            if not zero_gradient:
                (loss * share).backward()
                return_freed_memory()  # this pass's activations: the next pass's, of another length, would not fit their holes
            if padding:  # a padding pass adds no gradient and no metrics (its own may be NaN, e.g. one-token variances)
                continue
            if out.values is not None:
                ev_sums.add(tgt.returns, out.values.detach(), micro.response_mask)
            for k, v in step_metrics.items():  # losses by the loss's own share, token statistics by token share
                weight = share if k in LOSS_METRICS or k.endswith("_loss") else token_share
                sums[k] = sums.get(k, 0.0) + float(v) * float(weight)
        if zero_gradient:  # what the backward pass would have produced, on every rank
            for p in self.trainable_parameters():
                p.grad = torch.zeros_like(p)
        else:
            all_reduce_grads(self.trainable_parameters())  # SUM over ranks; no-op in one process
        # the explained-variance sums (EV_PREFIX keys) go back with the metrics: update() pools them over its steps
        sums = reduce_metrics({**sums, **ev_sums.as_metrics()}, "sum")
        grad_norm = clip_grad_norm_(self.trainable_parameters(), self.config.optim.grad_clip)  # sharded grads too
        lr = self.scheduler.get_last_lr()[0]  # the rate this step uses: read before the schedule moves on
        skipped = not step_if_finite(self.optimizer, self.scheduler, grad_norm)  # a NaN / inf gradient changes nothing
        return {**sums, "actor/grad_norm": float(grad_norm), "actor/lr": lr, "actor/nonfinite_grad_skipped": float(skipped)}

    @torch.no_grad()
    def score(self, batch: TrainBatch, *, policy: bool, values: bool, ref: bool) -> dict[str, torch.Tensor]:
        """Before any update: log π_old, critic values and log π_ref at every response target. ``(B, T)`` each."""
        out: dict[str, torch.Tensor] = {}
        if not (policy or values or ref):
            return out
        self.model.eval()
        wanted = (["logprobs"] if policy else []) + (["values"] if values else [])
        for name in wanted + (["ref_logprobs"] if ref else []):
            out[name] = torch.zeros_like(batch.response_mask)
        alg = self.config.algorithm
        temperature = self.config.rollout.temperature
        # groups adjacent, longest first: micro-batches of similar lengths (see group_contiguous)
        order = group_contiguous(torch.arange(len(batch)), batch.group_ids, batch.attention_mask.sum(1))  # (B,)
        lengths = batch.attention_mask.sum(1)[order].tolist()
        for part in micro_batches.plan(lengths, alg.micro_batch_size, alg.max_tokens_per_micro_batch):
            rows = order[part.start : part.stop]
            micro = batch.select(rows).trim().to(self.device)
            T = micro.response_mask.shape[1]
            args = (micro.input_ids, micro.attention_mask, micro.response_mask)
            shared = self.prompt_lengths(micro)
            with autocast(self.config.trainer.precision, self.device.type):
                if wanted:
                    res = policy_forward(self.model, *args, temperature=temperature, prompt_lengths=shared,
                                         value_head=self.value_head if values else None, fast=alg.fast_update)
                    for name in wanted:
                        out[name][rows, :T] = getattr(res, name).to(out[name].device)
                if ref:
                    with self.reference_policy() as ref_model:
                        out["ref_logprobs"][rows, :T] = policy_forward(
                            ref_model, *args, temperature=temperature, prompt_lengths=shared,
                            fast=alg.fast_update).logprobs.to(out["ref_logprobs"].device)
        return out

    def local_micro_batches(self, batch: TrainBatch, rank: int) -> tuple[torch.Tensor, list[range]]:
        """Rank ``rank``'s rows of an update mini-batch (whole groups, longest first) and its micro-batches over them.
        Every rank can compute every rank's: all hold the whole mini-batch and shard it the same way."""
        mine = shard(len(batch), rank, rank_world()[1])
        rows = group_contiguous(torch.arange(mine.start, mine.stop), batch.group_ids, batch.attention_mask.sum(1))
        alg = self.config.algorithm
        lengths = batch.attention_mask.sum(1)[rows].tolist()
        return rows, micro_batches.plan(lengths, alg.micro_batch_size, alg.max_tokens_per_micro_batch)


    def agreed_layout(self, micro: TrainBatch, prompt_lengths: torch.Tensor | None) -> str:
        """The shared-prompt layout of an update micro-batch: ``"auto"``, except under FSDP, where the ranks'
        micro-batches differ and every decoder pass is a collective, so all ranks take the packed layout
        (one pass) only if every rank's own choice is packed, else the split one (two passes). Without shared
        prompts (the plain path, window rows) there is one layout and nothing to agree on."""
        if not self.fsdp or prompt_lengths is None:
            return "auto"
        mine = shared_prompt_layout(self.model, micro.input_ids, micro.attention_mask, prompt_lengths)
        return "packed" if all_ranks(mine == "packed") else "split"

    def prompt_lengths(self, batch: TrainBatch) -> torch.Tensor | None:
        """Tokens before each row's first model-written token, when shared prompts run once (else None): a speed-up
        of the fast update path, so the plain one (``algorithm.fast_update=false``) runs full rows."""
        if (not self.config.algorithm.fast_update or not self.config.trainer.share_prompt_prefix
                or self.config.agent.context_mode == "window"):
            return None  # window rows share a prompt only at turn 1: sharing would cost extra passes, save nothing
        return batch.response_mask.argmax(dim=1) + 1  # target t predicts token t + 1

    @property
    def uses_kl(self) -> bool:
        return self.config.algorithm.use_kl_loss or self.config.algorithm.use_kl_in_reward

    @contextlib.contextmanager
    def reference_policy(self):
        """The initial policy: the LoRA base with adapters disabled (no extra memory), else a frozen copy."""
        if self.ref_model is None:
            with self.model.disable_adapter():
                yield self.model
        else:
            yield self.ref_model

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.value_head is not None:
            params += list(self.value_head.parameters())
        return params

    # ================================ plumbing ========================================
