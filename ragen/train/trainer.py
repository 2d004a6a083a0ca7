"""The StarPO loop: rollout stage → advantages → clipped policy update, step after step.

Read :meth:`StarPOTrainer.train` top to bottom for the algorithm; everything it calls is a
small named function. The math lives in :mod:`ragen.algos` (pure tensor functions).
"""

from __future__ import annotations

import json
import math
import time
import copy
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from ragen.agent import AgentConfig, Rollout, Trajectory
from ragen.algos import get_adv_estimator, get_policy_loss
from ragen.config import RunConfig, to_yaml
from ragen.envs.registry import habit_metric_names
from ragen.eval.collapse import CollapseMonitor, collapse_signals
from ragen.eval.metrics import format_tag_table, tag_metrics
from ragen.files import strict_dumps, write_text_atomic
from ragen.engines import SamplingParams, build_engine
from ragen.models import HFBackend, apply_lora, load_model
from ragen.models.device import resolve_device
from ragen.models.dropout import config_as_loaded, disable_config_dropout, disable_dropout
from ragen.models.freeze import train_top_layers
from ragen.runtime import keep_freed_memory, return_freed_memory
from ragen.train.actor_update import ActorUpdate
from ragen.train.checkpoint_choice import CheckpointingChoice
from ragen.train.distributed import barrier, broadcast_object, init_distributed
from ragen.train.fsdp import shard_layers, sync_replica
from ragen.train.checkpoint import (checkpoint_dirs, no_checkpoint, read_metrics, restore_latest, save_checkpoint,
                                    truncate_metrics)
from ragen.agent.env_sets import VAL_SEED_BASE, Slots, train_sets, val_sets
from ragen.train.console import GracefulInterrupt, fmt, progress, report_rollout_problems, seed_everything
from ragen.train.loggers import build_loggers, require_logger_packages
from ragen.train.memory_guard import RL_KEYS, MemoryGuard
from ragen.train.logprobs import ValueHead
from ragen.train.preflight import run_dir_problem
from ragen.train.rollout_log import write_rollout_log

#: Estimators that need a critic: a value head on the policy's backbone is trained with them.
CRITIC_ESTIMATORS = ("gae", "bi_level_gae")



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
        get_adv_estimator(config.algorithm.adv_estimator), get_policy_loss(config.algorithm.policy_loss)  # known names
        if config.rollout.backend == "ray":  # a missing Ray fails before the model loads, too
            from ragen.train.ray_rollout import RayRolloutPool

            RayRolloutPool.check(config)

        # -- model, optional LoRA, critic head (on trainer.device: cuda:LOCAL_RANK or cpu) --
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
        self.collapse_monitor = CollapseMonitor(habit_metrics=habit_metric_names())
        self.memory_guard = MemoryGuard(RL_KEYS, self.say)  # warns once if the first steps near the machine's memory

        # -- rollout --------------------------------------------------------------------
        if self.is_main:  # only rank 0 rolls out (rollout.engine: auto, hf, cpu or vllm; ragen/engines/)
            self.backend = build_engine(self.rollout_model, self.tokenizer, config, say=self.say)
        else:  # ranks other than 0 never generate: under FSDP they hold no replica, and need only pad_id
            self.backend = HFBackend.from_config(self.model, self.tokenizer, config)
        # -- update: the policy's optimizer and the StarPO update stage (ragen/train/actor_update.py) ---------------
        self.actor = ActorUpdate(config, self.model, self.ref_model, self.value_head, self.backend.pad_id, self.device,
                                 self.fsdp, self.checkpointing)
        self.optimizer, self.scheduler = self.actor.optimizer, self.actor.scheduler  # what checkpoints save
        agent = AgentConfig(**asdict(config.agent))
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
        """The StarPO loop, one training step per iteration: rollout → update (filter, score, advantages, epochs) →
        validate when due → log → watch for collapse → save."""
        cfg, start = self.config, time.perf_counter()
        summary = self.opening_summary()
        bar = progress(cfg.trainer.total_steps, enabled=cfg.trainer.progress_bar and self.is_main, initial=self.start_step)
        say = bar.write if self.is_main else (lambda line: None)  # under torchrun one console line, not one per rank
        for step in range(self.start_step + 1, cfg.trainer.total_steps + 1):
            t0 = time.perf_counter()
            # -- StarPO rollout stage: every group plays from its own seed (rank 0), the same batch on every rank ----
            trajectories = broadcast_object(self.rollout(step) if self.is_main else None)
            t1 = time.perf_counter()
            report_rollout_problems(step, trajectories, say)
            # -- StarPO update stage: advantages over whole trajectories, clipped PG ------------------------------
            metrics = self.update(trajectories)
            t2 = time.perf_counter()
            metrics.update(tag_metrics(trajectories, "train"))
            metrics.update(collapse_signals(trajectories))
            metrics.update({"step": step, "time/rollout_s": t1 - t0, "time/update_s": t2 - t1, "time/step_s": t2 - t0})
            if self.validation_due(step):
                val = self.validate(step)
                metrics.update(val)
                if step == cfg.trainer.total_steps:
                    summary["val_after"] = val  # reported once the run is written up
                else:
                    self.report_validation(f"at step {step}", val, write=say)
            self.log(metrics)
            stop = self.watch(step, metrics, say)
            interrupt.requested, stop = broadcast_object((interrupt.requested, stop))  # ranks leave the loop together
            if cfg.trainer.log_rollouts_freq and step % cfg.trainer.log_rollouts_freq == 0:
                self.save_rollouts(step, trajectories)
            if (cfg.trainer.save_freq and step % cfg.trainer.save_freq == 0) or interrupt.requested or stop:
                self.save_checkpoint(step)
            bar.update(1)
            bar.set_postfix(reward=f"{metrics.get('train/reward_mean', float('nan')):.3f}",
                            success=f"{metrics.get('train/success', float('nan')):.2f}")
            if interrupt.requested:
                bar.close()
                interrupt.restore()
                return self.interrupted_summary(summary, step, start)
            if stop:
                say(f"[ragen] stopping at step {step}: collapse confirmed (trainer.stop_on_collapse)")
                summary.update(stopped_on_collapse_at_step=step, val_after=self.last_validation(step, metrics))
                break
        interrupt.restore()
        bar.close()
        return self.closing_summary(summary, start)

    # ================================ the loop's parts ================================

    def opening_summary(self) -> dict:
        """The run summary as the loop starts: the validation before training (run now), or for a resumed run what
        its log already holds; a resumed run with no step left keeps its last validation as its end."""
        cfg = self.config
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
        return summary

    def validation_due(self, step: int) -> bool:
        """Every ``trainer.val_freq`` steps, and always after the last one."""
        t = self.config.trainer
        return step == t.total_steps or bool(t.val_freq and step % t.val_freq == 0)

    def watch(self, step: int, metrics: dict, say) -> bool:
        """After a step: skipped optimizer steps, memory and collapse warnings; True if the run should stop on a
        confirmed collapse (``trainer.stop_on_collapse``)."""
        if metrics.get("actor/nonfinite_grad_skipped"):
            say(f"[ragen] step {step}: the gradient norm was {metrics['actor/grad_norm']:g}; "
                f"{metrics['actor/nonfinite_grad_skipped']:.0%} of its optimizer steps were skipped, weights kept")
        self.memory_guard.after_step(step)
        for warning in self.collapse_monitor.check(metrics):
            say(f"[ragen] collapse warning at step {step}: {warning}")
        return self.config.trainer.stop_on_collapse and self.collapse_monitor.collapsed

    def last_validation(self, step: int, metrics: dict) -> dict:
        """The validation of the step a run ends on: the step's own, else one run now (logged on the same line)."""
        after = {k: v for k, v in metrics.items() if k.startswith("val/")}
        if not after:
            after = self.validate(step)
            self.log({"step": step, **after})
        return after

    def interrupted_summary(self, summary: dict, step: int, start: float) -> dict:
        """Ctrl-C: the checkpoint of ``step`` is saved; say how to continue, write what the run did so far (final/ and
        the last validation come with a finishing resume)."""
        summary["interrupted_at_step"] = step
        if self.is_main:
            print(f"\n[ragen] interrupted: checkpoint of step {step} saved; continue with "
                  f"`ragen train --resume {self.run_dir}` (or finish at this step, writing final/ and the "
                  f"summary: `ragen train --resume {self.run_dir} trainer.total_steps={step}`)", flush=True)
            summary["wall_time_s"] = time.perf_counter() - start
            write_text_atomic(self.run_dir / "summary.json", strict_dumps(summary, indent=2))
        return summary

    def closing_summary(self, summary: dict, start: float) -> dict:
        """The end of a run: close the loggers and workers; rank 0 saves final/, draws the curves, reports the last
        validation and writes ``summary.json``."""
        cfg = self.config
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
        # the last update's gradients: nothing reads them again, and a rollout is where a run's memory peaks
        self.optimizer.zero_grad(set_to_none=True)
        return_freed_memory()
        if self.rollout_pool is not None:  # each worker plays its group-aligned share; this step's weights go along
            return self.rollout_pool.run(step, seeds, group_ids, self.train_rollout.sampling, self.rollout_model)
        slots = self.train_slots
        return self.train_rollout.run(slots.envs, seeds, group_ids, slots.env_names, settings=slots.settings, tags=slots.tags)

    def update(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """The StarPO update stage on one step's episodes (:class:`ragen.train.actor_update.ActorUpdate`), then the
        rollout engine's weights brought up to date."""
        metrics = self.actor.update(trajectories)
        return_freed_memory()  # the step's activations and logits are freed: give their pages back
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

    def say(self, line: str) -> None:
        """One console line from rank 0, above the progress bar if one is showing."""
        if self.is_main:
            from tqdm.auto import tqdm

            tqdm.write(line)


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

    def save_rollouts(self, step: int, trajectories: list[Trajectory]) -> Path | None:
        """Up to ``trainer.log_rollouts_n`` of the step's episodes to ``rollouts/step_N.jsonl`` (rank 0 only)."""
        if not self.is_main:
            return None
        return write_rollout_log(self.run_dir / "rollouts" / f"step_{step:06d}.jsonl", step, trajectories,
                                 self.actor.last_advantages, self.tokenizer, self.config.trainer.log_rollouts_n)

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

