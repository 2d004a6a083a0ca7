"""The training loop's console and process plumbing: seeding, the validation line, the progress bar, rollout
problems and Ctrl-C."""

from __future__ import annotations

import random
import signal
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from ragen.agent import Trajectory


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def fmt(metrics: dict[str, float]) -> str:
    keys = ("val/success", "val/reward_mean", "val/format_valid")
    line = "  ".join(f"{k.split('/')[-1]}={metrics[k]:.3f}" for k in keys if k in metrics)
    if "val/success_ci_low" in metrics:  # the 95 % Wilson interval of the success rate, after it
        line = line.replace(f"success={metrics['val/success']:.3f}", f"success={metrics['val/success']:.3f} "
                            f"(95% CI {metrics['val/success_ci_low']:.3f}-{metrics['val/success_ci_high']:.3f})", 1)
    errors = int(metrics.get("val/env_errors", 0))
    if errors:  # those episodes are left out of the numbers above
        line += f"{'  ' if line else ''}env_errors={errors} of {errors + int(metrics.get('val/episodes', 0))} episodes"
    return line


def progress(total: int, enabled: bool, initial: int = 0):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="train", disable=not enabled, dynamic_ncols=True)


class GracefulInterrupt:
    """First Ctrl-C: finish the current step, checkpoint, exit cleanly. Second Ctrl-C: stop at once."""

    def __init__(self):
        self.requested = False
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            self._previous = None

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\n[ragen] Ctrl-C: finishing this step, then saving a checkpoint (Ctrl-C again to abort)", flush=True)

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

def report_rollout_problems(step: int, trajectories: "list[Trajectory]", say) -> None:
    """One line each for episodes that ended in an env error or at the model's context: the run goes on (those
    episodes train on nothing), the user is told why."""
    failed = [t for t in trajectories if t.error]
    if failed:
        say(f"[ragen] step {step}: {len(failed)} of {len(trajectories)} episodes ended with an env error "
            f"(first: {failed[0].error.splitlines()[0]})")
    full = [t for t in trajectories if t.context_full]
    if full:
        say(f"[ragen] step {step}: {len(full)} of {len(trajectories)} episodes ended early at the model's "
            f"context (first: {full[0].context_full})")
