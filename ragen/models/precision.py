"""Which compute precision pays off on this machine.

bf16 autocast is only a win where the CPU multiplies bf16 natively (AVX-512 BF16 or AMX):
there oneDNN runs bf16 matmuls ~5x faster than fp32. Elsewhere (e.g. AVX2-only CPUs) torch
falls back to a reference bf16 GEMM that is 5-60x *slower* than fp32 — measured on a
2-core AMD EPYC (AVX2): fp32 ~60 GFLOP/s, bf16 0.9-23 GFLOP/s depending on transposition.
``precision: auto`` therefore picks bf16 only where it is native, and the choice is written
into the run's resolved config so a run is reproducible on the same hardware.
"""

from __future__ import annotations

import functools

import torch

from ragen.models.device import cuda_index

PRECISIONS = ("auto", "bf16", "fp32")
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, tuple[str, ...]]:
    """``/proc/cpuinfo``'s fields, ``{key: (each processor's value, ...)}`` (empty where it cannot be read)."""
    fields: dict[str, list[str]] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), []).append(value.strip())
    except OSError:  # not Linux: nothing known
        pass
    return {key: tuple(values) for key, values in fields.items()}


def cpu_flags() -> frozenset[str]:
    """Every feature flag ``/proc/cpuinfo`` lists for any processor (x86 ``flags``, Arm ``Features``); empty where it
    cannot be read (not Linux)."""
    info = _cpuinfo()
    return frozenset(flag for key in ("flags", "Features") for value in info.get(key, ()) for flag in value.split())


def cpu_has_native_bf16() -> bool:
    """True when the CPU advertises bf16 arithmetic (x86 ``avx512_bf16``/``amx_bf16``, Arm ``bf16``)."""
    flags = cpu_flags()  # not Linux: no flags, be conservative
    return any(flag in flags for flag in _NATIVE_BF16_FLAGS) or "bf16" in flags


def intel_cpu() -> bool:
    """Whether ``/proc/cpuinfo`` names an Intel CPU (``vendor_id`` ``GenuineIntel``)."""
    return "GenuineIntel" in _cpuinfo().get("vendor_id", ())


def resolve_precision(precision: str, device: str = "auto") -> str:
    """Map ``auto`` to ``bf16`` or ``fp32`` for the run's ``trainer.device``; pass others through.

    bf16 on a GPU that supports it, or on a CPU with native bf16; fp32 otherwise. ``device``
    is the ``trainer.device`` spec: ``cpu`` judges the CPU even where a GPU is visible.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision != "auto":
        return precision
    on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if on_gpu:
        return "bf16" if gpu_has_native_bf16(device) else "fp32"
    return "bf16" if cpu_has_native_bf16() else "fp32"


def gpu_has_native_bf16(device: str = "auto") -> bool:
    """True when the run's GPU (``cuda:N``, else ``cuda:LOCAL_RANK``) computes bf16 natively (Ampere or newer).

    ``torch.cuda.is_bf16_supported()`` alone also says yes on older GPUs that only emulate it.
    """
    if not torch.cuda.is_available():
        return False
    index = cuda_index(device)
    if index >= torch.cuda.device_count():
        return False  # resolve_device reports the bad index
    with torch.cuda.device(index):
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
