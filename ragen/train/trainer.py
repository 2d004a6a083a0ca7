"""The StarPO loop: rollout stage → advantages → clipped policy update, step after step.

Read :meth:`StarPOTrainer.train` top to bottom for the algorithm; everything it calls is a
small named function. The math lives in :mod:`ragen.algos` (pure tensor functions).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

import ragen.envs
from ragen.agent import AgentSettings, Rollout, Trajectory
from ragen.algos import AdvantageInputs, aggregate_loss, entropy_loss, get_adv_estimator, get_policy_loss
from ragen.config import RunConfig, to_yaml
from ragen.eval.metrics import episode_metrics
from ragen.models import HFBackend, SamplingParams, apply_lora, autocast, load_model
from ragen.train.batch import TrainBatch, collate
from ragen.train.logprobs import token_logprobs

#: Estimators whose extra inputs (values, anchor states) the trainer does not compute yet.
NEEDS_CRITIC_OR_ANCHORS = ("gae", "bi_level_gae", "gigpo")

#: Validation seeds start here; training seeds are drawn below it, so the two never overlap.
VAL_SEED_BASE = 2**31


class StarPOTrainer:
    def __init__(self, config: RunConfig):
        self.config = config
        self.run_dir = self._make_run_dir()
        if config.trainer.num_threads > 0:
            torch.set_num_threads(config.trainer.num_threads)
        seed_everything(config.seed)
        self.seed_rng = np.random.default_rng(config.seed)

        # -- envs: fail fast on a bad env config, before the model loads --------------
        n_train = config.rollout.env_groups * config.rollout.group_size
        self.train_envs = [ragen.envs.make(config.env.name, **config.env.config) for _ in range(n_train)]
        self.val_envs = [ragen.envs.make(config.env.name, **config.env.config) for _ in range(config.trainer.val_episodes)]
        if config.algorithm.adv_estimator in NEEDS_CRITIC_OR_ANCHORS:
            raise ValueError(
                f"config key 'algorithm.adv_estimator': {config.algorithm.adv_estimator!r} needs a critic or anchor "
                "states, which the trainer does not provide yet; use one of grpo, dr_grpo, brpo, arpo, rloo, reinforce_pp"
            )
        self.adv_estimator = get_adv_estimator(config.algorithm.adv_estimator)
        self.policy_loss = get_policy_loss(config.algorithm.policy_loss)

        # -- model, optional LoRA, optimizer --------------------------------------------
        self.model, self.tokenizer = load_model(config.model, seed=config.seed)
        if config.lora.rank > 0:
            self.model = apply_lora(self.model, config.lora.rank, config.lora.alpha, config.lora.dropout, config.lora.target_modules)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=config.optim.lr, betas=tuple(config.optim.betas), weight_decay=config.optim.weight_decay
        )
        warmup = config.optim.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        )

        # -- rollout --------------------------------------------------------------------
        self.backend = HFBackend(self.model, self.tokenizer, precision=config.trainer.precision, batch_size=config.rollout.batch_size)
        agent = AgentSettings(**asdict(config.agent))
        stop = ("</answer>",)
        r = config.rollout
        self.train_rollout = Rollout(
            self.backend, self.tokenizer, agent,
            SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, stop=stop),
        )
        t = config.trainer
        self.val_rollout = Rollout(
            self.backend, self.tokenizer, agent,
            SamplingParams(max_new_tokens=r.max_new_tokens, temperature=t.val_temperature, top_p=r.top_p, top_k=r.top_k,
                           do_sample=t.val_do_sample, stop=stop),
        )
        self.metrics_path = self.run_dir / "metrics.jsonl"
        (self.run_dir / "config.yaml").write_text(to_yaml(config))

    # ================================ the algorithm ===================================

    def train(self) -> dict:
        cfg = self.config
        start = time.perf_counter()
        summary: dict = {"run_dir": str(self.run_dir)}
        if cfg.trainer.val_before_train:
            val = self.validate()
            summary["val_before"] = val
            self.log({"step": 0, **val})
            print(f"[ragen] validation before training: {fmt(val)}", flush=True)

        bar = progress(cfg.trainer.total_steps, enabled=cfg.trainer.progress_bar)
        for step in range(1, cfg.trainer.total_steps + 1):
            t0 = time.perf_counter()
            # -- StarPO rollout stage: every group plays from its own seed ---------------
            trajectories = self.rollout(step)
            t1 = time.perf_counter()
            # -- StarPO update stage: advantages over whole trajectories, clipped PG ------
            metrics = self.update(trajectories)
            t2 = time.perf_counter()
            metrics.update(episode_metrics(trajectories, "train"))
            metrics.update({"step": step, "time/rollout_s": t1 - t0, "time/update_s": t2 - t1, "time/step_s": t2 - t0})
            if cfg.trainer.val_freq and step % cfg.trainer.val_freq == 0 and step != cfg.trainer.total_steps:
                metrics.update(self.validate())
            if step == cfg.trainer.total_steps:
                val = self.validate()
                summary["val_after"] = val
                metrics.update(val)
            self.log(metrics)
            bar.update(1)
            bar.set_postfix(reward=f"{metrics.get('train/reward_mean', float('nan')):.3f}", success=f"{metrics.get('train/success', float('nan')):.2f}")
        bar.close()
        if cfg.trainer.total_steps == 0 and not cfg.trainer.val_before_train:
            summary["val_after"] = self.validate()
        if cfg.trainer.save_final:
            self.save(self.run_dir / "final")
        summary["wall_time_s"] = time.perf_counter() - start
        if "val_after" in summary:
            print(f"[ragen] validation after training: {fmt(summary['val_after'])}", flush=True)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"[ragen] run dir: {self.run_dir}  ({summary['wall_time_s']:.0f} s)", flush=True)
        return summary

    def rollout(self, step: int) -> list[Trajectory]:
        r = self.config.rollout
        group_seeds = self.seed_rng.integers(0, VAL_SEED_BASE, size=r.env_groups)
        seeds = [int(s) for s in np.repeat(group_seeds, r.group_size)]
        group_ids = [g for g in range(r.env_groups) for _ in range(r.group_size)]
        return self.train_rollout.run(self.train_envs, seeds, group_ids, self.config.env.name)

    def update(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """Advantages, then ``ppo_epochs`` passes of clipped policy-gradient steps over mini-batches."""
        cfg, alg = self.config, self.config.algorithm
        usable = [t for t in trajectories if not t.error and t.response_length > 0]
        if not usable:
            return {"actor/skipped_update": 1.0}
        batch = collate(usable, self.backend.pad_id)
        adv = self.adv_estimator(
            AdvantageInputs(
                token_rewards=batch.token_rewards, response_mask=batch.response_mask, group_ids=batch.group_ids,
                gamma=alg.gamma, lam=alg.lam, norm_adv_by_std=alg.norm_adv_by_std,
            )
        )
        mini = alg.mini_batch_size or len(batch)
        multiple_updates = alg.ppo_epochs > 1 or mini < len(batch)
        # Ratios need π_old only when the policy moves between updates on this batch.
        old_logprobs = self.old_logprobs(batch) if multiple_updates else None
        self.model.train()
        history: list[dict[str, float]] = []
        for _ in range(alg.ppo_epochs):
            order = torch.randperm(len(batch))
            for start in range(0, len(batch), mini):
                index = order[start : start + mini]
                history.append(self.optimizer_step(batch.select(index), adv.advantages[index],
                                                   None if old_logprobs is None else old_logprobs[index]))
        metrics = {k: float(np.mean([h[k] for h in history])) for k in history[0]}
        metrics.update(adv.metrics)
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def optimizer_step(self, batch: TrainBatch, advantages: torch.Tensor, old_logprobs: torch.Tensor | None) -> dict[str, float]:
        """One optimizer step on ``batch`` with gradient accumulation over micro-batches.

        Each micro-batch's aggregated loss is weighted by its share of the mini-batch's
        tokens (token-mean) or sequences (seq-mean-*), so accumulation equals one big pass.
        """
        alg = self.config.algorithm
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = batch.response_mask.sum().clamp(min=1)
        sums: dict[str, float] = {}
        for start in range(0, len(batch), alg.micro_batch_size):
            micro = trim(batch.select(slice(start, start + alg.micro_batch_size)))
            T = micro.response_mask.shape[1]
            adv = advantages[start : start + alg.micro_batch_size, :T]
            with autocast(self.config.trainer.precision):
                logp, entropy = token_logprobs(
                    self.model, micro.input_ids, micro.attention_mask, micro.response_mask,
                    temperature=self.config.rollout.temperature, with_entropy=True,
                )
            old = logp.detach() if old_logprobs is None else old_logprobs[start : start + alg.micro_batch_size, :T]
            pg_loss, pg_metrics = self.policy_loss(
                logp, old, adv, micro.response_mask, clip_ratio_low=alg.clip_ratio_low, clip_ratio_high=alg.clip_ratio_high,
                clip_ratio_c=alg.clip_ratio_c, loss_agg_mode=alg.loss_agg_mode,
            )
            ent = entropy_loss(entropy, micro.response_mask, alg.loss_agg_mode)
            loss = pg_loss - alg.entropy_coeff * ent
            share = (micro.response_mask.sum() / total_tokens) if alg.loss_agg_mode == "token-mean" else len(micro) / len(batch)
            (loss * share).backward()
            for k, v in {**pg_metrics, "actor/entropy": ent.item(), "actor/loss": loss.item()}.items():
                sums[k] = sums.get(k, 0.0) + float(v) * float(share)
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.config.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return {**sums, "actor/grad_norm": float(grad_norm)}

    @torch.no_grad()
    def old_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """log π_old at every response target, before any update on this batch. ``(B, T)``."""
        self.model.eval()
        out = torch.zeros_like(batch.response_mask)
        step = self.config.algorithm.micro_batch_size
        for start in range(0, len(batch), step):
            micro = trim(batch.select(slice(start, start + step)))
            with autocast(self.config.trainer.precision):
                logp, _ = token_logprobs(self.model, micro.input_ids, micro.attention_mask, micro.response_mask,
                                         temperature=self.config.rollout.temperature)
            out[start : start + step, : logp.shape[1]] = logp
        return out

    # ================================ plumbing ========================================

    def validate(self) -> dict[str, float]:
        n = self.config.trainer.val_episodes
        seeds = [VAL_SEED_BASE + i for i in range(n)]
        trajectories = self.val_rollout.run(self.val_envs, seeds, list(range(n)), self.config.env.name)
        return episode_metrics(trajectories, "val")

    def log(self, metrics: dict) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")

    def save(self, path: Path) -> None:
        self.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)

    def _make_run_dir(self) -> Path:
        out = self.config.trainer.output_dir
        if not out:
            out = f"runs/{self.config.env.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
            self.config.trainer.output_dir = out
        path = Path(out)
        if (path / "metrics.jsonl").exists():
            raise FileExistsError(f"run dir {path} already holds a run (metrics.jsonl); choose another trainer.output_dir")
        path.mkdir(parents=True, exist_ok=True)
        return path


def trim(batch: TrainBatch) -> TrainBatch:
    """Drop the padding columns this micro-batch does not need."""
    L = int(batch.attention_mask.sum(1).max())
    return TrainBatch(
        input_ids=batch.input_ids[:, :L], attention_mask=batch.attention_mask[:, :L],
        response_mask=batch.response_mask[:, : L - 1], token_rewards=batch.token_rewards[:, : L - 1],
        turn_rewards=batch.turn_rewards[:, : L - 1], turn_ends=batch.turn_ends[:, : L - 1],
        group_ids=batch.group_ids, scores=batch.scores,
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def fmt(metrics: dict[str, float]) -> str:
    keys = ("val/success", "val/reward_mean", "val/format_valid")
    return "  ".join(f"{k.split('/')[-1]}={metrics[k]:.3f}" for k in keys if k in metrics)


def progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="train", disable=not enabled, dynamic_ncols=True)
