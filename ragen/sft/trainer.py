"""Supervised fine-tuning on chat demonstrations: next-token cross-entropy on the assistant's tokens only.

The loss of one optimizer step is the token mean over every assistant token of its
conversations (the mask of :mod:`ragen.sft.masking`, the rollout's own):

    L(θ) = − Σ_{b,t} m_{b,t} log π_θ(x_{b,t+1} | x_{b,≤t}) / Σ_{b,t} m_{b,t}

accumulated over micro-batches with each weighted by its share of the step's tokens, so
accumulation equals one big pass. The LM head runs only where ``m = 1``
(:func:`ragen.train.logprobs.policy_forward`). A run directory looks like an RL run's:
``config.yaml``, ``metrics.jsonl`` (``train/*`` per step, ``eval/loss`` at step 0, every
``eval_freq`` steps and at the end), ``summary.json``, ``checkpoints/`` (the atomic format of
:mod:`ragen.train.checkpoint`, resumable) and ``final/`` (weights or LoRA adapter naming
its base, plus the tokenizer), loadable with ``model=RUN_DIR``.
"""

from __future__ import annotations

import json
import math
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ragen.models import apply_lora, autocast, load_model
from ragen.models.device import resolve_device
from ragen.sft.config import SFTConfig, to_yaml
from ragen.sft.data import SFTBatch, collate, load_dataset, step_examples
from ragen.sft.preflight import check_run_dir, data_change_problem
from ragen.files import file_sha256, strict_dumps, write_dir_atomic, write_text_atomic
from ragen.train import micro_batches
from ragen.train.checkpoint import restore_latest, save_checkpoint, truncate_metrics
from ragen.runtime import return_freed_memory
from ragen.train.checkpoint_choice import CheckpointingChoice
from ragen.train.memory_guard import SFT_KEYS, MemoryGuard
from ragen.train.logprobs import policy_forward
from ragen.train.optimizer import adamw, step_if_finite
from ragen.train.console import GracefulInterrupt, progress, seed_everything


def lr_lambda(warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float):
    """LR multiplier of optimizer step ``s`` (0-based): linear warm-up, then constant or cosine to ``min_lr_ratio``."""

    def factor(s: int) -> float:
        if warmup_steps > 0 and s < warmup_steps:
            return (s + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        span = max(1, total_steps - warmup_steps - 1)  # the last step (s = total_steps - 1) runs at min_lr_ratio
        progress_ = min(1.0, (s - warmup_steps) / span)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress_))

    return factor


class SFTTrainer:
    def __init__(self, config: SFTConfig, resume: bool = False, force: bool = False):
        self.config = config
        self.force = force  # --resume --force: accept a data file whose contents changed since the checkpoint
        t = config.trainer
        self.run_dir = self._check_run_dir(resume)  # before the model loads: a refused dir fails fast
        if t.num_threads > 0:
            torch.set_num_threads(t.num_threads)
        seed_everything(config.seed)
        self.seed_rng = np.random.default_rng(config.seed)  # checkpointed with the other RNGs
        self.device = resolve_device(t.device)
        self.model, self.tokenizer = load_model(config.model, seed=config.seed)
        self.model.to(self.device)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        d = config.data
        self.data = load_dataset(d.path, self.tokenizer, eval_fraction=d.eval_fraction, eval_max=d.eval_max,
                                 max_length=d.max_length, seed=config.seed, train_on_eos=d.train_on_eos)
        if not self.data.train:
            raise ValueError(f"{d.path}: nothing left to train on after the eval split")
        self.data_sha256 = file_sha256(d.path)  # checkpointed: --resume notices a data file rewritten in place
        if config.lora.rank > 0:
            self.model = apply_lora(self.model, config.lora.rank, config.lora.alpha, config.lora.dropout, config.lora.target_modules)
            self.model.to(self.device)
        self.memory_guard = MemoryGuard(SFT_KEYS, tqdm.write)
        self.checkpointing = CheckpointingChoice(self.model, t.gradient_checkpointing, t.max_tokens_per_micro_batch,
                                                 tqdm.write, prefix="[ragen sft]")
        per_step = min(t.batch_size, len(self.data.train))
        self.total_steps = t.max_steps or math.ceil(t.epochs * len(self.data.train) / per_step)
        self.optimizer = adamw(self.trainable_parameters(), lr=config.optim.lr,
                               betas=tuple(config.optim.betas), weight_decay=config.optim.weight_decay,
                               fused=config.optim.fused)
        o = config.optim
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(o.warmup_steps, self.total_steps, o.schedule, o.min_lr_ratio))
        self.start_step = 0
        self.metrics_path = self.run_dir / "metrics.jsonl"
        if resume:
            self._resume()  # raises (and writes nothing) if the run has no usable checkpoint
        else:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        # Written only now: a refused resume leaves the run's own config.yaml as it was.
        write_text_atomic(self.run_dir / "config.yaml", to_yaml(config))

    # ================================ the algorithm ===================================

    def train(self) -> dict:
        cfg = self.config.trainer
        start = time.perf_counter()
        summary: dict = {"run_dir": str(self.run_dir), "train_conversations": len(self.data.train),
                         "eval_conversations": len(self.data.eval), "dropped_too_long": self.data.dropped_too_long,
                         "dropped_untrained": self.data.dropped_untrained, "total_steps": self.total_steps}
        if self.start_step == 0:
            before = self.evaluate()
            summary["eval_before"] = before
            self.log({"step": 0, **before})
            dropped = [f"{n} {why}" for n, why in ((self.data.dropped_too_long,
                                                    f"longer than data.max_length={self.config.data.max_length} tokens"),
                                                   (self.data.dropped_untrained, "with no assistant token to train on")) if n]
            print(f"[ragen sft] {len(self.data.train)} train / {len(self.data.eval)} eval conversations"
                  f"{' (dropped: ' + ', '.join(dropped) + ')' if dropped else ''}, "
                  f"{self.total_steps} steps; eval loss before: {before.get('eval/loss', float('nan')):.4f}", flush=True)
        interrupt = GracefulInterrupt()
        bar = progress(self.total_steps, enabled=cfg.progress_bar, initial=self.start_step)
        step, last_eval = self.start_step, None
        for step in range(self.start_step + 1, self.total_steps + 1):
            t0 = time.perf_counter()
            metrics = self.optimizer_step(step_examples(self.data.train, cfg.batch_size, self.config.seed, step))
            metrics.update({"step": step, "time/step_s": time.perf_counter() - t0,
                            "train/epoch": step * min(cfg.batch_size, len(self.data.train)) / len(self.data.train)})
            self.memory_guard.after_step(step)
            out_of_time = cfg.max_time_s > 0 and time.perf_counter() - start >= cfg.max_time_s
            last = step == self.total_steps or out_of_time or interrupt.requested
            last_eval = None
            if last or (cfg.eval_freq and step % cfg.eval_freq == 0):
                metrics.update(last_eval := self.evaluate())
            self.log(metrics)
            if metrics["train/nonfinite_grad_skipped"]:
                bar.write(f"[ragen sft] step {step}: the gradient norm was {metrics['train/grad_norm']:g}; "
                          "the step was skipped, weights kept")
            # a time cap stops like an interrupt: with a checkpoint, so `--resume` continues from this step
            if (cfg.save_freq and step % cfg.save_freq == 0) or interrupt.requested or out_of_time:
                self.save_checkpoint(step)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['train/loss']:.4f}")
            if interrupt.requested:
                bar.close()
                interrupt.restore()
                print(f"\n[ragen sft] interrupted: checkpoint of step {step} saved; continue with "
                      f"`ragen sft train --resume {self.run_dir}`", flush=True)
                summary["interrupted_at_step"] = step
                summary["wall_time_s"] = time.perf_counter() - start
                write_text_atomic(self.run_dir / "summary.json", strict_dumps(summary, indent=2))
                return summary
            if out_of_time:
                bar.write(f"[ragen sft] trainer.max_time_s={cfg.max_time_s:g} reached at step {step}: stopping "
                          f"(checkpoint saved; continue with `ragen sft train --resume {self.run_dir}`)")
                summary["stopped_at_step"] = step
                break
        interrupt.restore()
        bar.close()
        ran = step > self.start_step
        after = last_eval if ran and last_eval is not None else self.evaluate()  # the last step's eval, not a second pass
        summary.update({"eval_after": after, "steps_done": step})
        if cfg.save_final:
            self.save(self.run_dir / "final")
        summary["wall_time_s"] = time.perf_counter() - start
        write_text_atomic(self.run_dir / "summary.json", strict_dumps(summary, indent=2))
        print(f"[ragen sft] eval loss after: {after.get('eval/loss', float('nan')):.4f}  run dir: {self.run_dir}  "
              f"({summary['wall_time_s']:.0f} s)", flush=True)
        return summary

    def optimizer_step(self, examples) -> dict[str, float]:
        """One AdamW step on ``examples`` with gradient accumulation over length-sorted micro-batches."""
        cfg = self.config
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        examples = sorted(examples, key=len)  # less padding per micro-batch
        total_tokens = max(1, sum(e.num_trained for e in examples))
        loss_sum = 0.0
        self.checkpointing.before_update(len(examples[-1]))
        for part in self.micro_batches(examples):
            batch = collate(examples[part.start : part.stop], self.pad_id)
            nll_sum = self.nll_sum(batch)  # scalar: summed NLL of the micro-batch's assistant tokens
            (nll_sum / total_tokens).backward()
            loss_sum += float(nll_sum.detach())
            del nll_sum
            return_freed_memory()  # this pass's activations: the next pass's, of another length, would not fit their holes
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), cfg.optim.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        skipped = not step_if_finite(self.optimizer, self.scheduler, grad_norm)  # a NaN / inf gradient changes nothing
        return_freed_memory()  # the step's activations and logits are freed: give their pages back
        return {"train/loss": loss_sum / total_tokens, "train/tokens": float(total_tokens), "train/conversations": float(len(examples)),
                "train/grad_norm": float(grad_norm), "train/lr": lr, "train/nonfinite_grad_skipped": float(skipped)}

    def nll_sum(self, batch: SFTBatch) -> torch.Tensor:
        """Σ over assistant targets of −log π(target), a scalar (bf16 autocast, fp32 log-softmax)."""
        ids, mask, loss_mask = (x.to(self.device) for x in (batch.input_ids, batch.attention_mask, batch.loss_mask))
        with autocast(self.config.trainer.precision, self.device.type):
            out = policy_forward(self.model, ids, mask, loss_mask)
        return -(out.logprobs * loss_mask).sum()  # (B, T) -> ()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Token-mean NLL of the held-out conversations' assistant tokens (``eval/loss``) and its exp."""
        if not self.data.eval:
            return {}
        self.model.eval()
        total, tokens = 0.0, 0
        examples = sorted(self.data.eval, key=len)
        for part in self.micro_batches(examples):
            batch = collate(examples[part.start : part.stop], self.pad_id)
            total += float(self.nll_sum(batch))
            tokens += int(batch.loss_mask.sum())
        loss = total / max(1, tokens)
        return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}

    def micro_batches(self, examples) -> list[range]:
        """Length-sorted ``examples`` cut by ``trainer.micro_batch_size`` rows and ``max_tokens_per_micro_batch``."""
        t = self.config.trainer
        return micro_batches.plan([len(e) for e in examples], t.micro_batch_size, t.max_tokens_per_micro_batch)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    # ================================ plumbing ========================================

    def log(self, metrics: dict) -> None:
        with self.metrics_path.open("a") as f:
            f.write(strict_dumps(metrics) + "\n")  # NaN/inf as null

    def save(self, path: Path) -> None:
        """Final weights (or LoRA adapter naming its base model spec) + tokenizer, as safetensors.

        Atomic: written to a temp dir next to ``path`` that replaces it when complete.
        """
        write_dir_atomic(path, self._save_to)

    def _save_to(self, path: Path) -> None:
        self.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        adapter_config = path / "adapter_config.json"
        if adapter_config.is_file():  # the base is our model spec (e.g. smollm2-135m), loadable by load_model
            data = json.loads(adapter_config.read_text())
            data["base_model_name_or_path"] = self.config.model
            adapter_config.write_text(json.dumps(data, indent=2))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def save_checkpoint(self, step: int) -> Path:
        return save_checkpoint(self.run_dir, step, self.checkpoint_tensors(), self.optimizer, self.scheduler,
                               self.seed_rng, extra={"kind": "sft", "data_sha256": self.data_sha256},
                               keep=self.config.trainer.keep_checkpoints)

    def _resume(self) -> None:
        path, self.start_step = restore_latest(self.run_dir, self.checkpoint_tensors(), self.optimizer,
                                               self.scheduler, self.seed_rng)
        state = json.loads((path / "state.json").read_text())  # restore_latest read it whole just now
        problem = not self.force and data_change_problem(path, state, self.config.data.path, self.data_sha256)
        if problem:
            raise ValueError(problem)
        truncate_metrics(self.metrics_path, self.start_step)
        print(f"[ragen sft] resumed from {path} (step {self.start_step})", flush=True)

    def _check_run_dir(self, resume: bool) -> Path:
        """The run dir, checked by :func:`ragen.sft.preflight.check_run_dir` (created later, once the model and data loaded)."""
        out = self.config.trainer.output_dir
        if not out:
            out = f"runs/sft-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
            self.config.trainer.output_dir = out
        path = Path(out)
        check_run_dir(path, resume)
        return path


__all__ = ["SFTTrainer", "lr_lambda"]
