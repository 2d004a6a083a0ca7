"""Checkpoints that survive a kill at any instant, and exact resume.

A checkpoint is a directory ``checkpoints/step_NNNNNN/`` holding

* ``model.safetensors`` -- every trainable tensor (full weights, or only the LoRA adapters) plus the
  value head, never pickle;
* ``optimizer.safetensors`` + ``state.json`` -- AdamW moments, param-group settings, the LR
  schedule, the step, and every RNG (python, numpy, torch's CPU and, where CUDA is in use,
  per-GPU generators, the trainer's seed generator);
* ``COMPLETE`` -- written last.

It is assembled in a temporary sibling directory, its files synced to disk, and renamed into place, so a
crash leaves either the whole new checkpoint or none of it (a temporary directory a kill left behind is
removed by the next save); :func:`latest_checkpoint` skips any directory without ``COMPLETE`` or that
fails to load, falling back to the previous one with a warning.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ragen.files import write_text_atomic
from ragen.train.fsdp import full_tensor, like
from ragen.train.optimizer import IMPLEMENTATION_KEYS

COMPLETE = "COMPLETE"

#: A checkpoint directory's whole name; the step has 6 digits or more (``checkpoint_dir``'s padding).
_STEP_DIR = re.compile(r"step_(\d+)")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of checkpoint directory ``path`` (``step_000042`` → 42); None for any other name."""
    match = _STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


def _by_step(run_dir: Path) -> list[tuple[int, Path]]:
    """``run_dir``'s checkpoint directories with their steps, oldest first.

    By number, not name: the padding is 6 digits, so from step 1 000 000 on names sort wrongly
    (``step_1000000`` < ``step_999999``). Other names (a user's ``step_best`` copy) are not ours.
    """
    found = ((checkpoint_step(p), p) for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir())
    return sorted((step, p) for step, p in found if step is not None)


def rng_state(seed_rng: np.random.Generator) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    np_state = np.random.get_state()
    json_part = {
        "python": _to_json(random.getstate()),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "seed_rng": seed_rng.bit_generator.state,
    }
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # GPU sampling draws from these
        tensors.update({f"torch_cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return json_part, tensors


def restore_rng(state: dict[str, Any], tensors: dict[str, torch.Tensor], seed_rng: np.random.Generator) -> None:
    random.setstate(_from_json(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    seed_rng.bit_generator.state = state["seed_rng"]
    torch.set_rng_state(tensors["torch"])
    cuda_states = [tensors[f"torch_cuda_{i}"] for i in range(len(tensors)) if f"torch_cuda_{i}" in tensors]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states[: torch.cuda.device_count()])


def save_checkpoint(run_dir: Path, step: int, named_params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                    scheduler, seed_rng: np.random.Generator, extra: dict[str, Any], keep: int = 2,
                    write: bool = True) -> Path | None:
    """Write the checkpoint for ``step`` atomically and prune to the newest ``keep``.

    Sharded (FSDP) parameters and optimizer moments are gathered whole first: a collective, so
    under FSDP every rank calls this, and only the one with ``write=True`` writes.
    """
    if not write:  # join every gather (collectives: the writer's order, weights then moments), keep nothing
        for v in named_params.values():
            _cpu_copy(v, keep=False)
        _optimizer_state(optimizer, named_params, keep=False)
        return None
    model_tensors = {k: _cpu_copy(v) for k, v in named_params.items()}
    opt_tensors, opt_json = _optimizer_state(optimizer, named_params)
    final = checkpoint_dir(run_dir, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        save_file(model_tensors, tmp / "model.safetensors")
        save_file(opt_tensors, tmp / "optimizer.safetensors")
        rng_json, rng_tensors = rng_state(seed_rng)
        save_file(rng_tensors, tmp / "rng.safetensors")
        state = {"step": step, "optimizer": opt_json, "scheduler": scheduler.state_dict(), "rng": rng_json, **extra}
        (tmp / "state.json").write_text(json.dumps(state))
        (tmp / COMPLETE).write_text(str(step))
        for part in tmp.iterdir():  # contents on disk before the rename publishes them (not only the names)
            _fsync_file(part)
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # the newest `keep` up to this step: a later one is left from before a resume that fell back past it (damaged)
    done = [p for done_step, p in _by_step(run_dir) if done_step <= step]
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for stale in final.parent.glob(".tmp-step_*"):  # assembled by a process killed mid-write (one writer per run)
        shutil.rmtree(stale, ignore_errors=True)
    return final


#: What a checkpoint's ``state.json`` must hold.
STATE_KEYS = ("step", "optimizer", "scheduler", "rng")


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint fully (raises on any missing or corrupt part)."""
    if not (path / COMPLETE).is_file():
        raise ValueError(f"{path} is incomplete (no {COMPLETE} marker)")
    state = json.loads((path / "state.json").read_text())
    missing = [key for key in STATE_KEYS if not isinstance(state, dict) or key not in state]
    if missing:
        raise ValueError(f"{path / 'state.json'} lacks {missing[0]!r}")
    return {
        "params": load_file(path / "model.safetensors"),
        "optimizer_tensors": load_file(path / "optimizer.safetensors"),
        "rng_tensors": load_file(path / "rng.safetensors"),
        "state": state,
    }


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """``run_dir``'s checkpoint directories, newest first (not read: some may be partial or damaged)."""
    return [p for _, p in reversed(_by_step(run_dir))]


def no_checkpoint(run_dir: Path) -> FileNotFoundError:
    """The error of a resume that finds nothing to restore."""
    return FileNotFoundError(f"no valid checkpoint under {run_dir / 'checkpoints'} to resume from")


def latest_checkpoint(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads; broken newer ones are skipped with a warning."""
    for path in checkpoint_dirs(run_dir):
        try:
            return path, load_checkpoint(path)
        except Exception as exc:  # corrupt or partial: fall back to the previous one
            warnings.warn(f"skipping checkpoint {path}: {exc}", stacklevel=2)
    return None


def restore_latest(run_dir: Path, named_params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                   scheduler, seed_rng: np.random.Generator) -> tuple[Path, int]:
    """Load the newest valid checkpoint of ``run_dir`` into params, optimizer, schedule and RNGs; returns (path, step).

    Raises ``FileNotFoundError`` if there is none and ``ValueError`` if it does not hold every
    trainable parameter of this model (a different model or LoRA setting).
    """
    found = latest_checkpoint(run_dir)
    if found is None:
        raise no_checkpoint(run_dir)
    path, ckpt = found
    missing = set(named_params) - set(ckpt["params"])
    if missing:
        raise ValueError(f"checkpoint {path} does not match this model: missing {sorted(missing)[:3]}")
    with torch.no_grad():
        for name, param in named_params.items():
            param.copy_(like(param, ckpt["params"][name]))  # a sharded parameter takes its own shard
    restore_optimizer(optimizer, named_params, ckpt["optimizer_tensors"], ckpt["state"]["optimizer"])
    scheduler.load_state_dict(ckpt["state"]["scheduler"])
    restore_rng(ckpt["state"]["rng"], ckpt["rng_tensors"], seed_rng)
    return path, int(ckpt["state"]["step"])


def truncate_metrics(metrics_path: Path, last_step: int) -> None:
    """Drop the lines of steps after ``last_step`` (lost with the killed process); keep the rest.

    A last line that does not parse is a write the kill cut short, and is dropped with the later steps;
    any other line that does not parse (or has no ``step``) is an error naming the file and line, and
    the file is left as it was.
    """
    kept = metrics_to_keep(metrics_path, last_step)
    write_text_atomic(metrics_path, "".join(line + "\n" for line in kept))  # a kill now leaves the old log whole


def read_metrics(metrics_path: Path) -> list[dict]:
    """Every record of a metrics log that :func:`truncate_metrics` has left (each line a JSON object with a ``step``)."""
    text = metrics_path.read_text() if metrics_path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def metrics_to_keep(metrics_path: Path, last_step: int) -> list[str]:
    """The lines of ``metrics_path`` that :func:`truncate_metrics` keeps (it raises the same errors); writes nothing."""
    lines = metrics_path.read_text().splitlines() if metrics_path.exists() else []
    kept = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = record["step"]
        except (ValueError, TypeError, KeyError):
            if number == len(lines):  # cut short by the kill: the step it describes is not in the checkpoint
                break
            raise ValueError(f"{metrics_path}:{number}: not a metrics record (a JSON object with a 'step'); "
                             "the run's metrics are damaged, so it is not resumed") from None
        if step <= last_step:
            kept.append(line)
    return kept


def restore_optimizer(optimizer: torch.optim.Optimizer, named_params: dict[str, torch.Tensor],
                      tensors: dict[str, torch.Tensor], saved: dict[str, Any]) -> None:
    names = list(named_params)
    state_dict = optimizer.state_dict()
    for group, saved_group in zip(state_dict["param_groups"], saved["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params" and k not in IMPLEMENTATION_KEYS})
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, name in enumerate(names):
        keys = [k for k in tensors if k.startswith(f"{name}::")]
        if keys:  # moments of a sharded parameter are sharded like it (AdamW's scalar step is not)
            state[i] = {k.split("::", 1)[1]: like(named_params[name], tensors[k]) for k in keys}
    state_dict["state"] = state
    optimizer.load_state_dict(state_dict)


def _optimizer_state(optimizer: torch.optim.Optimizer, named_params: dict[str, torch.Tensor], keep: bool = True):
    """AdamW state as flat safetensors keyed ``<param name>::<slot>``, plus JSON-able group settings.
    ``keep=False``: only join the gathers of sharded moments (a rank that does not write)."""
    index = {id(p): name for name, p in named_params.items()}
    tensors: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for slot, value in optimizer.state.get(p, {}).items():
                copy = _cpu_copy(value, keep)
                if keep:
                    tensors[f"{index[id(p)]}::{slot}"] = copy
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return tensors, {"param_groups": groups}


def _cpu_copy(tensor: torch.Tensor, keep: bool = True) -> torch.Tensor | None:
    """A contiguous CPU copy of the whole tensor (safetensors writes host memory; the live tensor may
    be on a GPU, or an FSDP shard, gathered here: a collective). ``keep=False``: gather, copy nothing."""
    whole = full_tensor(tensor.detach())
    return whole.to("cpu", copy=True).contiguous() if keep else None


def _to_json(obj):
    return [_to_json(x) for x in obj] if isinstance(obj, (tuple, list)) else obj


def _from_json(obj):
    return tuple(_from_json(x) for x in obj) if isinstance(obj, list) else obj


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
