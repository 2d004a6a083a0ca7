"""ragen's C++ decode kernels (``ragen/models/csrc/decode_step.cpp``): built once per machine, loaded once per process.

:func:`ops` returns ``torch.ops.ragen_native`` (``decode_grouped``, and its kernels alone for tests) or None, with
:func:`unavailable_reason` saying why. The source is compiled with torch's own extension builder
(``torch.utils.cpp_extension.load``, ninja and the machine's C++ compiler, ``-O3 -march=native``) on first use:
~15 s on the 2-core EPYC. Each build runs in its own temporary directory; the library is then moved into
``$RAGEN_NATIVE_DIR`` (default ``native/`` in ragen's cache, ``~/.cache/ragen``) under a name that hashes the source, the flags, torch's
version and the CPU's flags, so concurrent builders (pytest-xdist workers, Ray actors) never wait on a lock a killed
build left behind, and a changed source or another machine sharing the directory never loads a stale library.

Only CPUs with AVX-512 BF16 are tried: the kernels serve the bf16 decode step, which ragen runs on the CPU only
there (:func:`ragen.models.precision.cpu_has_native_bf16`). A build that fails (no compiler, no ninja) is reported
once as a warning and the Python path runs instead: the same arithmetic, slower.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from ragen.models.embedded import cache_root
from ragen.models.precision import cpu_flags

SOURCE = Path(__file__).with_name("csrc") / "decode_step.cpp"
#: Compiler flags: -march=native for AVX-512 BF16 (the library is built on, and kept for, the machine that runs it);
#: no FMA contraction, so the rotary embedding rounds each product as the Python step does.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off")
NAME = "ragen_native"
_REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")

_reason: str | None = None
_lock = threading.Lock()  # one build or load per process, even when threads (Ray actors' rollouts) ask at once


def cache_dir() -> Path:
    """Where built libraries are kept: ``$RAGEN_NATIVE_DIR``, else ``native/`` under ragen's cache root
    (``$RAGEN_CACHE_DIR``, default ``~/.cache/ragen``, as the embedded model's)."""
    if os.environ.get("RAGEN_NATIVE_DIR"):
        return Path(os.environ["RAGEN_NATIVE_DIR"])
    return cache_root() / "native"


def library_key() -> str:
    """A hash of everything the built library depends on: the source, the flags, torch, Python and the CPU's flags."""
    flags = " ".join(sorted(cpu_flags()))
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), repr(FLAGS).encode(), torch.__version__.encode(),
                 torch.__file__.encode(), flags.encode(), str(sys.version_info[:2]).encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _build(target: Path) -> None:
    """Compile the source into ``target`` (a temporary build directory, moved into place atomically)."""
    from torch.utils.cpp_extension import load

    target.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix="build-", dir=target.parent))
    path = os.environ.get("PATH")
    try:
        # torch runs `ninja` from PATH: the ninja package's binary sits beside this interpreter, which an unactivated
        # venv (`.venv/bin/ragen ...`) does not put on PATH
        os.environ["PATH"] = os.pathsep.join([_ninja_dir(), path]) if path else _ninja_dir()
        # loads the library from the build directory too (registering torch.ops.ragen_native in this process) and
        # returns its path
        built = load(name=NAME, sources=[str(SOURCE)], extra_cflags=list(FLAGS), is_python_module=False,
                     build_directory=str(build), verbose=False)
        os.replace(built, target)
    finally:
        if path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = path
        shutil.rmtree(build, ignore_errors=True)


def _ninja_dir() -> str:
    """The directory of the ninja package's binary (``pip install ninja``), else this interpreter's."""
    try:
        import ninja

        return str(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        return os.path.dirname(sys.executable)


@functools.cache
def ops():
    """``torch.ops.ragen_native`` once the library is loaded (built first if this machine has none), else None."""
    with _lock:
        return _load()


def _load():
    global _reason
    flags = cpu_flags()
    missing = [f for f in _REQUIRED_FLAGS if f not in flags]
    if missing:
        _reason = f"this CPU lacks {', '.join(missing)}"
        return None
    if os.environ.get("RAGEN_NATIVE", "1") == "0":
        _reason = "RAGEN_NATIVE=0"
        return None
    if _registered():  # a racing first call (functools.cache does not serialise them) loaded it already
        return torch.ops.ragen_native
    if _reason is not None and _reason.startswith("building"):  # a racing first call failed already: not again
        return None
    try:
        target = cache_dir() / f"{NAME}-{library_key()}.so"
        if target.exists():
            torch.ops.load_library(str(target))
        else:
            _build(target)
        if not _registered():
            raise RuntimeError(f"{target.name} registered no ragen_native::decode_grouped")
    except Exception as e:  # noqa: BLE001 (any build or load failure: the Python path runs instead)
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower()]  # the compiler's own messages, if any
        detail = " | ".join((errors or lines or [type(e).__name__])[:3])
        _reason = f"building {SOURCE.name} failed ({type(e).__name__}: {detail[:600]})"
        warnings.warn(f"ragen: native decode kernels unavailable, decoding in Python instead: {_reason}", stacklevel=2)
        return None
    return torch.ops.ragen_native


def _registered() -> bool:
    try:
        torch.ops.ragen_native.decode_grouped  # noqa: B018
        return True
    except (AttributeError, RuntimeError):
        return False


def unavailable_reason() -> str | None:
    """Why :func:`ops` returned None (after it was called), or None."""
    return _reason
