"""Which device a run's model lives on: ``trainer.device`` (``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``).

``auto`` is the GPU this process owns when CUDA is visible -- ``cuda:LOCAL_RANK``, so each
``torchrun`` rank takes its own GPU -- and the CPU otherwise. The device is resolved when a
trainer (RL or SFT) or ``ragen eval`` builds its model, not in the config: under ``torchrun``
every rank resolves its own, while ``config.yaml`` keeps what the user wrote.

Data stays on the CPU until it meets the model: collation, advantages, filters and the
run's bookkeeping are small, device-agnostic tensors; micro-batches and their targets move to
the model's device right before the forward pass (``TrainBatch.to``), and generation moves
its prompt tensors there (``HFBackend``). Results come back to the CPU through ``.tolist()``,
``.item()`` or a copy into a CPU tensor.
"""

from __future__ import annotations

import os
import re

import torch

#: What ``trainer.device`` accepts (``cuda:N`` for any N).
DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_spec(spec: str) -> str | None:
    """Why ``spec`` is not a valid ``trainer.device`` value, or None when it is (no hardware check)."""
    if not isinstance(spec, str) or not _PATTERN.fullmatch(spec):
        return f"must be one of {', '.join(DEVICE_CHOICES)}, got {spec!r}"
    return None


def resolve_device(spec: str = "auto", key: str = "trainer.device") -> torch.device:
    """The ``torch.device`` for ``spec``; ``auto``/``cuda`` mean ``cuda:LOCAL_RANK`` (0 outside torchrun).

    A CUDA result also becomes the process's current CUDA device (``torch.cuda.set_device``),
    so helpers that look at "the" GPU look at this one. Raises ``ValueError`` naming ``key``
    and the problem when the spec is malformed, CUDA is asked for but not visible, the index
    is past the visible GPUs, or an explicit ``cuda:N`` is given to a multi-process
    (``torchrun``) run, where every rank would take the same GPU.
    """
    problem = check_device_spec(spec)
    if problem:
        raise ValueError(f"config key {key!r}: {problem}")
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"config key {key!r}: {spec!r} asks for CUDA, but torch sees no CUDA GPU here "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use cpu or auto")
    if ":" in spec and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(f"config key {key!r}: {spec!r} would put every torchrun rank on the same GPU; "
                         "use auto or cuda (= cuda:LOCAL_RANK, one GPU per rank)")
    index = cuda_index(spec)
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"config key {key!r}: {spec!r} means cuda:{index}, but only {count} CUDA GPU(s) are visible")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def cuda_index(spec: str) -> int:
    """The GPU a CUDA spec names: N for ``cuda:N``, else ``LOCAL_RANK`` (0 outside torchrun)."""
    return int(spec.split(":")[1]) if ":" in spec else int(os.environ.get("LOCAL_RANK", "0"))


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (CPU for a model without parameters)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


__all__ = ["DEVICE_CHOICES", "check_device_spec", "cuda_index", "model_device", "resolve_device"]
