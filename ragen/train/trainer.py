"""The StarPO loop: rollout stage → advantages → clipped policy update, step after step.

Read :meth:`StarPOTrainer.train` top to bottom for the algorithm; everything it calls is a
small named function. The math lives in :mod:`ragen.algos` (pure tensor functions).
"""

from __future__ import annotations

import json
import math
import time
import contextlib
import copy
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from ragen.agent import AgentSettings, Rollout, Trajectory
from ragen.algos import AdvantageInputs, aggregate_loss, entropy_loss, get_adv_estimator, get_policy_loss, masked_mean
from ragen.algos.losses import kl_penalty, value_loss
from ragen.config import RunConfig, to_yaml
from ragen.envs.registry import habit_metric_names
from ragen.eval.collapse import CollapseMonitor, collapse_signals
from ragen.eval.metrics import format_tag_table, tag_metrics
from ragen.files import atomic_open, strict_dumps, write_text_atomic
from ragen.engines import SamplingParams, build_engine
from ragen.models import HFBackend, apply_lora, autocast, load_model
from ragen.models.device import resolve_device
from ragen.models.dropout import config_as_loaded, disable_config_dropout, disable_dropout
from ragen.models.freeze import train_top_layers
from ragen.runtime import keep_freed_memory
from ragen.train import micro_batches
from ragen.train.checkpoint_choice import CheckpointingChoice
from ragen.train.batch import TrainBatch, collate, collate_turns
from ragen.train.distributed import (all_ranks, all_reduce_grads, barrier, broadcast_object, init_distributed,
                                     rank_world, reduce_metrics, shard)
from ragen.train.fsdp import clip_grad_norm_, shard_layers, sync_replica
from ragen.train.checkpoint import (checkpoint_dirs, no_checkpoint, read_metrics, restore_latest, save_checkpoint,
                                    truncate_metrics)
from ragen.train.env_sets import Slots, train_sets, val_sets
from ragen.train.console import GracefulInterrupt, fmt, progress, seed_everything
from ragen.train.loggers import build_loggers, require_logger_packages
from ragen.train.memory_guard import RL_KEYS, MemoryGuard
from ragen.train.logprobs import ValueHead, policy_forward, shared_prompt_layout
from ragen.train.optimizer import adamw, step_if_finite
from ragen.train.per_tag import per_tag_advantages, per_tag_filter
from ragen.train.update_targets import (EV_PREFIX, LOSS_METRICS, ExplainedVarianceSums, UpdateTargets,
                                        group_contiguous)
from ragen.train.preflight import run_dir_problem

#: Estimators that need a critic: a value head on the policy's backbone is trained with them.
CRITIC_ESTIMATORS = ("gae", "bi_level_gae")

#: Validation seeds start here; training seeds are drawn below it, so the two never overlap.
VAL_SEED_BASE = 2**31


class StarPOTrainer:
    def __init__(self, config: RunConfig, resume: bool = False):
        self.config = config
        keep_freed_memory()  # RAGEN_MALLOC=keep, also when built from Python (ragen/runtime.py)
        if config.rollout.engine == "vllm":  # no vLLM, no GPU, or LoRA: a clear error before anything is loaded
            from ragen.models.vllm_backend import check_vllm_run

            check_vllm_run(config)
        # torchrun: every rank holds the whole model; rank 0 alone rolls out, validates and writes files
        self.rank, self.world = init_distributed()
        self.is_main = self.rank == 0
        self.run_dir = self._make_run_dir(resume)
        if resume and not checkpoint_dirs(self.run_dir):  # nothing to restore: said before the model loads
            raise no_checkpoint(self.run_dir)
        self.start_step = 0
        require_logger_packages(config.trainer.logger)  # a missing wandb fails before the model loads
        if config.trainer.num_threads > 0:
            torch.set_num_threads(config.trainer.num_threads)
        seed_everything(config.seed)
        self.seed_rng = np.random.default_rng(config.seed)

        # -- envs, by tag: fail fast on a bad env config, before the model loads -----------
        self.train_sets, self.val_sets = train_sets(config), val_sets(config)
        self.train_slots = Slots.build(self.train_sets, config.rollout.group_size)  # group_size envs per group
        self.val_slots = Slots.build(self.val_sets, 1)  # one env per validation episode
        self.adv_estimator = get_adv_estimator(config.algorithm.adv_estimator)
        self.policy_loss = get_policy_loss(config.algorithm.policy_loss)
        if config.rollout.backend == "ray":  # a missing Ray fails before the model loads, too
            from ragen.train.ray_rollout import RayRolloutPool

            RayRolloutPool.check(config)

        # -- model, optional LoRA, optimizer (on trainer.device: cuda:LOCAL_RANK or cpu) --
        self.device = resolve_device(config.trainer.device)
        self.model, self.tokenizer = load_model(config.model, seed=config.seed)
        self.model.to(self.device)
        alg = config.algorithm
        #: Config fields holding dropout the model reads at each forward, zeroed for RL: put back while saving.
        self.config_dropout: dict[str, float] = {}
        if alg.disable_dropout:  # before LoRA's own
            dropped = disable_dropout(self.model)
            self.config_dropout = disable_config_dropout(self.model)
            dropped += [f"{name}={value:g}" for name, value in self.config_dropout.items()]
            if dropped and self.is_main:
                print(f"[ragen] dropout off for RL (algorithm.disable_dropout): {len(dropped)} place(s), e.g. {dropped[0]}",
                      flush=True)
        uses_kl = alg.use_kl_loss or alg.use_kl_in_reward
        # Under LoRA the reference policy is the base with adapters disabled; otherwise a frozen copy.
        self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False) if uses_kl and config.lora.rank == 0 else None
        if config.lora.rank > 0:
            self.model = apply_lora(self.model, config.lora.rank, config.lora.alpha, config.lora.dropout, config.lora.target_modules)
            self.model.to(self.device)  # adapters join their base layers' device
        train_top_layers(self.model, config.optim.trainable_layers)
        # acts in training mode only, i.e. in update(); auto decides there, per update (checkpoint_choice.py)
        self.checkpointing = CheckpointingChoice(self.model, config.trainer.gradient_checkpointing,
                                                 config.algorithm.max_tokens_per_micro_batch, self.say)
        self.value_head = ValueHead(self.model.config.hidden_size).to(self.device) if alg.adv_estimator in CRITIC_ESTIMATORS else None
        # What rank 0 generates with: the trained model itself, or under FSDP an unsharded replica
        # kept in step by sync_rollout_weights() (a sharded model needs every rank in each forward).
        self.rollout_model = self.model
        self.fsdp = config.trainer.fsdp and self.world > 1
        if self.fsdp:
            self.rollout_model = copy.deepcopy(self.model) if self.is_main else None
            shard_layers(self.model, self.device)
            if self.ref_model is not None:
                shard_layers(self.ref_model, self.device)
        self.last_advantages: tuple[list[Trajectory], torch.Tensor] | None = None
        self.collapse_monitor = CollapseMonitor(habit_metrics=habit_metric_names())
        self.memory_guard = MemoryGuard(RL_KEYS, self.say)  # warns once if the first steps near the machine's memory
        self.optimizer = adamw(
            self.trainable_parameters(), lr=config.optim.lr, betas=tuple(config.optim.betas),
            weight_decay=config.optim.weight_decay, fused=config.optim.fused,
        )
        warmup = config.optim.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        )

        # -- rollout --------------------------------------------------------------------
        if self.is_main:  # only rank 0 rolls out (rollout.engine: hf or vllm; ragen/engines/)
            self.backend = build_engine(self.rollout_model, self.tokenizer, config, say=self.say)
        else:  # ranks other than 0 never generate: under FSDP they hold no replica, and need only pad_id
            self.backend = HFBackend.from_config(self.model, self.tokenizer, config)
        agent = AgentSettings(**asdict(config.agent))
        stop = ("</answer>",)
        r = config.rollout
        self.train_rollout = Rollout(
            self.backend, self.tokenizer, agent,
            SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, stop=stop),
            max_in_flight=r.max_episodes_in_flight,
        )
        t = config.trainer
        self.val_rollout = Rollout(
            self.backend, self.tokenizer, agent,
            SamplingParams(max_new_tokens=r.max_new_tokens, temperature=t.val_temperature, top_p=r.top_p, top_k=r.top_k,
                           do_sample=t.val_do_sample, stop=stop),
            max_in_flight=r.max_episodes_in_flight,
        )
        # rollout.backend=ray: training and validation episodes play on Ray actors (ragen/train/ray_rollout.py)
        self.rollout_pool = None
        if r.backend == "ray" and self.is_main:
            from ragen.train.ray_rollout import RayRolloutPool

            self.rollout_pool = RayRolloutPool(config)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        if resume:
            try:
                self._resume()
                self.sync_rollout_weights()
            except BaseException:  # a refused resume must not leave the Ray workers (and Ray) running
                self.close_rollout_pool()
                raise
        if self.is_main:  # after a resume succeeded: a failed one leaves the run's config.yaml as it was
            write_text_atomic(self.run_dir / "config.yaml", to_yaml(config))
        self.loggers = build_loggers(config, self.run_dir, self.metrics_path, self.start_step if resume else None) if self.is_main else []
        barrier()  # no rank writes the run dir before every rank has checked it

    # ================================ the algorithm ===================================

    def train(self) -> dict:
        """Run the remaining steps; whatever ends them (the last step, Ctrl-C, a collapse, an exception), Ctrl-C's
        handler is restored and the loggers and Ray workers are closed."""
        interrupt = GracefulInterrupt()
        try:
            return self._train(interrupt)
        finally:
            interrupt.restore()
            self.close_loggers()
            self.close_rollout_pool()

    def _train(self, interrupt: "GracefulInterrupt") -> dict:
        cfg = self.config
        start = time.perf_counter()
        summary: dict = {"run_dir": str(self.run_dir)}
        if cfg.trainer.val_before_train and self.start_step == 0:
            val = self.validate()
            summary["val_before"] = val
            self.log({"step": 0, **val})
            self.report_validation("before training", val)
        elif self.start_step > 0:  # resumed: the summary still describes the whole run
            summary["resumed_from_step"] = self.start_step
            before = self.logged_validation(step=0)
            if before:
                summary["val_before"] = before
            if self.start_step >= cfg.trainer.total_steps:  # nothing left to run: keep the run's last validation
                after = self.logged_validation(step=self.start_step)
                if not after:  # e.g. finishing a run Ctrl-C stopped between validations: validate it now, as its end
                    after = self.validate(self.start_step)
                    self.log({"step": self.start_step, **after})
                summary["val_after"] = after
                if self.is_main:
                    print(f"[ragen] the run is at step {self.start_step} of trainer.total_steps={cfg.trainer.total_steps}: "
                          "no step left to run (raise trainer.total_steps to continue it)", flush=True)

        bar = progress(cfg.trainer.total_steps, enabled=cfg.trainer.progress_bar and self.is_main, initial=self.start_step)
        say = bar.write if self.is_main else (lambda line: None)  # under torchrun one console line, not one per rank
        for step in range(self.start_step + 1, cfg.trainer.total_steps + 1):
            t0 = time.perf_counter()
            # -- StarPO rollout stage: every group plays from its own seed ---------------
            trajectories = broadcast_object(self.rollout(step) if self.is_main else None)  # identical batch on every rank
            t1 = time.perf_counter()
            failed = [t for t in trajectories if t.error]
            if failed:  # the run goes on (those episodes train on nothing); the user is told why
                say(f"[ragen] step {step}: {len(failed)} of {len(trajectories)} episodes ended with an env error "
                    f"(first: {failed[0].error.splitlines()[0]})")
            full = [t for t in trajectories if t.context_full]
            if full:
                say(f"[ragen] step {step}: {len(full)} of {len(trajectories)} episodes ended early at the model's "
                    f"context (first: {full[0].context_full})")
            # -- StarPO update stage: advantages over whole trajectories, clipped PG ------
            metrics = self.update(trajectories)
            t2 = time.perf_counter()
            metrics.update(tag_metrics(trajectories, "train"))
            metrics.update(collapse_signals(trajectories))
            metrics.update({"step": step, "time/rollout_s": t1 - t0, "time/update_s": t2 - t1, "time/step_s": t2 - t0})
            if cfg.trainer.val_freq and step % cfg.trainer.val_freq == 0 and step != cfg.trainer.total_steps:
                val = self.validate(step)
                metrics.update(val)
                self.report_validation(f"at step {step}", val, write=say)
            if step == cfg.trainer.total_steps:
                val = self.validate(step)
                summary["val_after"] = val
                metrics.update(val)
            self.log(metrics)
            if metrics.get("actor/nonfinite_grad_skipped"):
                say(f"[ragen] step {step}: the gradient norm was {metrics['actor/grad_norm']:g}; "
                    f"{metrics['actor/nonfinite_grad_skipped']:.0%} of its optimizer steps were skipped, weights kept")
            self.memory_guard.after_step(step)
            for warning in self.collapse_monitor.check(metrics):
                say(f"[ragen] collapse warning at step {step}: {warning}")
            stop = cfg.trainer.stop_on_collapse and self.collapse_monitor.collapsed
            interrupt.requested, stop = broadcast_object((interrupt.requested, stop))  # ranks leave the loop together
            if cfg.trainer.log_rollouts_freq and step % cfg.trainer.log_rollouts_freq == 0:
                self.save_rollouts(step, trajectories)
            if (cfg.trainer.save_freq and step % cfg.trainer.save_freq == 0) or interrupt.requested or stop:
                self.save_checkpoint(step)
            bar.update(1)
            bar.set_postfix(reward=f"{metrics.get('train/reward_mean', float('nan')):.3f}", success=f"{metrics.get('train/success', float('nan')):.2f}")
            if interrupt.requested:
                bar.close()
                interrupt.restore()
                if self.is_main:
                    print(f"\n[ragen] interrupted: checkpoint of step {step} saved; continue with "
                          f"`ragen train --resume {self.run_dir}` (or finish at this step, writing final/ and the "
                          f"summary: `ragen train --resume {self.run_dir} trainer.total_steps={step}`)", flush=True)
                summary["interrupted_at_step"] = step
                if self.is_main:  # what the run did so far; final/ and the last validation come with a finishing resume
                    summary["wall_time_s"] = time.perf_counter() - start
                    write_text_atomic(self.run_dir / "summary.json", strict_dumps(summary, indent=2))
                return summary
            if stop:
                say(f"[ragen] stopping at step {step}: collapse confirmed (trainer.stop_on_collapse)")
                summary["stopped_on_collapse_at_step"] = step
                # the run ends here: its last validation is this step's, run now if the step had none (same line)
                after = {k: v for k, v in metrics.items() if k.startswith("val/")}
                if not after:
                    after = self.validate(step)
                    self.log({"step": step, **after})
                summary["val_after"] = after
                break
        interrupt.restore()
        bar.close()
        if cfg.trainer.total_steps == 0 and not cfg.trainer.val_before_train:  # on the pool, as every validation
            summary["val_after"] = self.validate(self.start_step)
        self.close_loggers()
        self.close_rollout_pool()
        if not self.is_main:  # nothing to write: rank 0 saves, plots and summarises
            return {**summary, "wall_time_s": time.perf_counter() - start}
        if cfg.trainer.save_final:
            self.save(self.run_dir / "final")
        if cfg.trainer.plot:
            summary["plot"] = self.plot()
        summary["wall_time_s"] = time.perf_counter() - start
        if "val_after" in summary:
            self.report_validation("after training", summary["val_after"])
        write_text_atomic(self.run_dir / "summary.json", strict_dumps(summary, indent=2))
        print(f"[ragen] run dir: {self.run_dir}  ({summary['wall_time_s']:.0f} s)", flush=True)
        return summary

    def rollout(self, step: int) -> list[Trajectory]:
        """Every group of every training tag plays from its own seed, all in one batch; group ids are unique across tags."""
        size = self.config.rollout.group_size
        n_groups = sum(s.count for s in self.train_sets)
        group_seeds = self.seed_rng.integers(0, VAL_SEED_BASE, size=n_groups)
        seeds = [int(s) for s in np.repeat(group_seeds, size)]
        group_ids = [g for g in range(n_groups) for _ in range(size)]
        if self.rollout_pool is not None:  # each worker plays its group-aligned share; this step's weights go along
            return self.rollout_pool.run(step, seeds, group_ids, self.train_rollout.sampling, self.rollout_model)
        slots = self.train_slots
        return self.train_rollout.run(slots.envs, seeds, group_ids, slots.env_names, settings=slots.settings, tags=slots.tags)

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
        batch = collate(usable, self.backend.pad_id, step_gamma=alg.gigpo_gamma)  # one row per episode: advantages live here
        # What the policy trains on: the episodes themselves, or (context_mode=window) one row per turn.
        if self.config.agent.context_mode == "window":
            samples, turn_index = collate_turns(usable, self.backend.pad_id)
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
        t_sync = time.perf_counter()
        if self.sync_rollout_weights():
            metrics["time/weight_sync_s"] = time.perf_counter() - t_sync
        return metrics

    def sync_rollout_weights(self) -> bool:
        """Bring what rank 0 generates with up to date with the trained weights; True if anything was copied.

        Under FSDP every rank gathers the trained (``requires_grad``) tensors, a collective, and rank 0
        copies them into its replica; frozen weights never change. rollout.engine=vllm: the trained
        tensors are then pushed into the engine. Otherwise the HF backend shares the model itself.
        """
        sync = getattr(self.backend, "sync_weights", None) if self.is_main else None
        trained = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if self.fsdp:
            trained = sync_replica(trained, self.rollout_model)
        elif sync is None:
            return False
        if sync is not None:
            sync((n, p.detach()) for n, p in trained)
        return True

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
                    prompt_lengths=shared, prompt_layout=self.agreed_layout(micro, shared),
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
                                         value_head=self.value_head if values else None)
                    for name in wanted:
                        out[name][rows, :T] = getattr(res, name).to(out[name].device)
                if ref:
                    with self.reference_policy() as ref_model:
                        out["ref_logprobs"][rows, :T] = policy_forward(
                            ref_model, *args, temperature=temperature, prompt_lengths=shared).logprobs.to(out["ref_logprobs"].device)
        return out

    def local_micro_batches(self, batch: TrainBatch, rank: int) -> tuple[torch.Tensor, list[range]]:
        """Rank ``rank``'s rows of an update mini-batch (whole groups, longest first) and its micro-batches over them.
        Every rank can compute every rank's: all hold the whole mini-batch and shard it the same way."""
        mine = shard(len(batch), rank, rank_world()[1])
        rows = group_contiguous(torch.arange(mine.start, mine.stop), batch.group_ids, batch.attention_mask.sum(1))
        alg = self.config.algorithm
        lengths = batch.attention_mask.sum(1)[rows].tolist()
        return rows, micro_batches.plan(lengths, alg.micro_batch_size, alg.max_tokens_per_micro_batch)

    def say(self, line: str) -> None:
        """One console line from rank 0, above the progress bar if one is showing."""
        if self.is_main:
            from tqdm.auto import tqdm

            tqdm.write(line)

    def agreed_layout(self, micro: TrainBatch, prompt_lengths: torch.Tensor | None) -> str:
        """The shared-prompt layout of an update micro-batch: ``"auto"``, except under FSDP, where the ranks'
        micro-batches differ and every decoder pass is a collective, so all ranks take the packed layout
        (one pass) only if every rank's own choice is packed, else the split one (two passes)."""
        if not self.fsdp:
            return "auto"
        mine = shared_prompt_layout(self.model, micro.input_ids, micro.attention_mask, prompt_lengths)
        return "packed" if all_ranks(mine == "packed") else "split"

    def prompt_lengths(self, batch: TrainBatch) -> torch.Tensor | None:
        """Tokens before each row's first model-written token, when shared prompts run once (else None)."""
        if not self.config.trainer.share_prompt_prefix or self.config.agent.context_mode == "window":
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

    def validate(self, step: int = 0) -> dict[str, float]:
        """Every validation tag on its fixed held-out seeds ``VAL_SEED_BASE + i``, one batch; ``val/…`` and ``val/<tag>/…``.

        With ``rollout.backend=ray`` the Ray workers play it (each its share of the episodes,
        current weights, a sampling stream seeded from ``step``); otherwise this process does.
        """
        if not self.is_main:  # under torchrun rank 0 validates; the others have nothing to log
            return {}
        return tag_metrics(self.validation_trajectories(step), "val")

    def validation_trajectories(self, step: int = 0) -> list[Trajectory]:
        seeds = [VAL_SEED_BASE + i for s in self.val_sets for i in range(s.count)]
        group_ids = list(range(len(seeds)))
        if self.rollout_pool is not None:
            return self.rollout_pool.run(step, seeds, group_ids, self.val_rollout.sampling, self.rollout_model, stream="val")
        slots = self.val_slots
        # sampled validation draws from a fork of torch's RNG: the training rollouts' stream (and so every later
        # step, and a checkpoint's saved state) is the same whether or not a step validates
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            return self.val_rollout.run(slots.envs, seeds, group_ids, slots.env_names, settings=slots.settings,
                                        tags=slots.tags)

    def logged_validation(self, step: int) -> dict[str, float]:
        """The ``val/*`` metrics ``metrics.jsonl`` holds for ``step`` (empty if none were logged)."""
        for record in read_metrics(self.metrics_path):
            if record.get("step") == step:  # the log writes NaN as null
                return {k: math.nan if v is None else v for k, v in record.items() if k.startswith("val/")}
        return {}

    def report_validation(self, when: str, metrics: dict[str, float], write=None) -> None:
        """One console line; with several tags (validation or training) a per-tag table below it."""
        if not self.is_main:
            return
        write = write or (lambda line: print(line, flush=True))
        write(f"[ragen] validation {when}: {fmt(metrics)}")
        if len(self.val_sets) > 1 or len(self.train_sets) > 1:
            write(format_tag_table(metrics, "val"))

    def plot(self) -> str:
        """Draw the run's curves to ``curves.png`` (skipped with a note if matplotlib is missing or nothing was logged)."""
        if not (self.run_dir / "metrics.jsonl").is_file():  # total_steps=0 without val_before_train: no logged step
            return "not drawn: the run logged no metrics"
        try:
            from ragen.viz.plots import plot_runs

            return str(plot_runs([self.run_dir])[0])
        except ImportError as exc:
            return f"not drawn: {exc}"
        except ValueError as exc:  # e.g. every episode's env failed, so no plotted metric has a value
            return f"not drawn: {exc}"
        except OSError as exc:  # e.g. a full disk: the run itself is done, its summary must still be written
            return f"not drawn: {type(exc).__name__}: {exc}"

    def save_rollouts(self, step: int, trajectories: list[Trajectory]) -> Path:
        """Write up to ``log_rollouts_n`` trajectories with per-token text, mask and advantage (JSONL); rank 0 only."""
        if not self.is_main:
            return None
        rows = {}
        if self.last_advantages is not None:
            trained, advantages = self.last_advantages
            rows = {id(t): advantages[i] for i, t in enumerate(trained)}
        path = self.run_dir / "rollouts" / f"step_{step:06d}.jsonl"
        path.parent.mkdir(exist_ok=True)
        with atomic_open(path) as f:  # a viewer reading the run meanwhile never sees half a step
            for traj in logged_sample(trajectories, self.config.trainer.log_rollouts_n):
                adv = rows.get(id(traj))
                n = len(traj.input_ids)
                record = {
                    "step": step,
                    **traj.to_json(),
                    "in_update": adv is not None,  # False: filtered out, or an env error (its tokens trained nothing)
                    "tokens": [self.tokenizer.decode([i]) for i in traj.input_ids],
                    "loss_mask": traj.loss_mask,
                    # advantage of token p sits at target p - 1
                    "advantages": [0.0] + (adv[: n - 1].tolist() if adv is not None else [0.0] * (n - 1)),
                    "turn_spans": [list(span) for span in traj.turn_spans],
                }
                if traj.window_prompts:  # context_mode=window: what each turn really saw (the viewer shows them)
                    record["window_prompts"] = [[self.tokenizer.decode([i]) for i in p] for p in traj.window_prompts]
                f.write(strict_dumps(record) + "\n")
        return path

    def log(self, metrics: dict) -> None:
        """One step's metrics to every ``trainer.logger`` (metrics.jsonl always)."""
        for logger in self.loggers:
            logger.log(metrics, step=int(metrics["step"]))

    def close_loggers(self) -> None:
        """Close every logger once (a second call, e.g. train()'s clean-up after the run closed them, does nothing)."""
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            logger.close()

    def close_rollout_pool(self) -> None:
        """rollout.backend=ray: stop the workers (and Ray, if the pool started it)."""
        if self.rollout_pool is not None:
            self.rollout_pool.close()
            self.rollout_pool = None

    def save(self, path: Path) -> None:
        """Final weights (or LoRA adapter naming its base model spec) + tokenizer, as safetensors (rank 0: under FSDP from its synced replica)."""
        with config_as_loaded(self.rollout_model, self.config_dropout):  # the model's own dropout settings
            self.rollout_model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        adapter_config = path / "adapter_config.json"
        if adapter_config.is_file():
            data = json.loads(adapter_config.read_text())
            data["base_model_name_or_path"] = self.config.model
            adapter_config.write_text(json.dumps(data, indent=2))

    # -- checkpoints ------------------------------------------------------------------------

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every trainable tensor by name: the full model, or only LoRA adapters; plus the value head."""
        named = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        if self.value_head is not None:
            named.update({f"value_head.{n}": p for n, p in self.value_head.named_parameters()})
        return named

    def save_checkpoint(self, step: int) -> Path | None:
        """Rank 0 writes. Without FSDP the ranks hold identical weights and optimizer state; with it
        every rank joins the gathering of the sharded tensors (a collective) and rank 0 writes them whole."""
        if not (self.is_main or self.fsdp):
            return None
        return save_checkpoint(self.run_dir, step, self.checkpoint_tensors(), self.optimizer, self.scheduler,
                               self.seed_rng, extra={}, keep=self.config.trainer.keep_checkpoints, write=self.is_main)

    def _resume(self) -> None:
        path, self.start_step = restore_latest(self.run_dir, self.checkpoint_tensors(), self.optimizer,
                                               self.scheduler, self.seed_rng)
        problem = None
        if self.is_main:
            try:
                truncate_metrics(self.metrics_path, self.start_step)
            except ValueError as exc:  # a damaged log: every rank stops (the others would wait at the next barrier)
                problem = str(exc)
        problem = broadcast_object(problem)
        if problem:
            raise ValueError(problem)
        if self.is_main:  # rank 0 decides a collapse stop: its monitor picks up where the run was
            self.collapse_monitor.replay(record for record in read_metrics(self.metrics_path) if record["step"] >= 1)
            for stale in (self.run_dir / "rollouts").glob("step_*.jsonl"):  # logged by the killed process after the
                if stale.stem[5:].isdigit() and int(stale.stem[5:]) > self.start_step:  # checkpoint: not this run's
                    stale.unlink()
            print(f"[ragen] resumed from {path} (step {self.start_step})", flush=True)

    def _make_run_dir(self, resume: bool) -> Path:
        out = self.config.trainer.output_dir
        if not out:
            name = "+".join(s.name for s in train_sets(self.config))[:60]
            out = broadcast_object(f"runs/{name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}")  # rank 0's clock
            self.config.trainer.output_dir = out
        path = Path(out)
        if resume:
            return path
        # rank 0 looks before any rank writes; every rank raises the same error
        problem = broadcast_object(run_dir_problem(path) if self.is_main else None)
        if problem:
            raise FileExistsError(problem)
        if self.is_main:
            path.mkdir(parents=True, exist_ok=True)
        return path


def logged_sample(trajectories: list[Trajectory], n: int) -> list[Trajectory]:
    """The first ``n`` trajectories to log, whole groups taken from each env tag in turn (a mixed-tag batch lists
    one tag's groups first: a plain slice would log that tag alone)."""
    groups: dict[str, dict[int, list[Trajectory]]] = {}
    for traj in trajectories:
        groups.setdefault(traj.tag or traj.env_name, {}).setdefault(traj.group_id, []).append(traj)
    queues = [list(by_id.values()) for by_id in groups.values()]
    ordered: list[Trajectory] = []
    for turn in range(max((len(q) for q in queues), default=0)):
        for queue in queues:
            if turn < len(queue):
                ordered += queue[turn]
    return ordered[:n]
