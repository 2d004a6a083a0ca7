"""ragen's C++ kernels (``ragen/models/csrc/``): each library built once per machine, loaded once per process.

Two libraries, each a :class:`NativeLibrary`:

* :data:`DECODE` (``decode_step.cpp``, ``torch.ops.ragen_native``): the bf16 grouped decode step. Only CPUs with
  AVX-512 BF16 are tried: it serves the bf16 decode step, which ragen runs on the CPU only there
  (:func:`ragen.models.precision.cpu_has_native_bf16`).
* :data:`GEMM` (``panel_gemm.cpp``, ``torch.ops.ragen_gemm``): fp32 linears for decode-sized calls on weights packed
  into column panels (:mod:`ragen.models.packed_linear`); AVX2 and FMA.

:func:`ops` and :func:`gemm_ops` return the loaded namespace or None, with :func:`unavailable_reason` saying why.
A source is compiled with torch's own extension builder (``torch.utils.cpp_extension.load``, ninja and the machine's
C++ compiler, ``-O3 -march=native -fopenmp``) on first use: ~15 s on the 2-core EPYC. Each build runs in its own
temporary directory; the library is then moved into ``$RAGEN_NATIVE_DIR`` (default ``native/`` in ragen's cache,
``~/.cache/ragen``) under a name that hashes the source, the flags, torch's version and the CPU's flags, so concurrent
builders (pytest-xdist workers, Ray actors) never wait on a lock a killed build left behind, and a changed source or
another machine sharing the directory never loads a stale library.

A build that fails (no compiler, no ninja) is reported once as a warning and the Python path runs instead: the same
arithmetic, slower.
"""

from __future__ import annotations

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

CSRC = Path(__file__).with_name("csrc")
#: Compiler flags: -march=native for the CPU's vector extensions (a library is built on, and kept for, the machine that
#: runs it); -fopenmp so that ``at::parallel_for`` in the kernels runs on torch's OpenMP threads (without it ATen's
#: header compiles it to a serial loop); no FMA contraction, so the rotary embedding rounds each product as the Python
#: step does (the kernels' explicit FMAs are unaffected).
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")
#: Linker flags: libgomp, which resolves to the copy torch already loaded (same soname: one OpenMP runtime).
LDFLAGS = ("-fopenmp",)


class NativeLibrary:
    """One C++ source registering ops under ``torch.ops.<name>``: built on first use, then loaded from the cache."""

    def __init__(self, name: str, source: Path, required_flags: tuple[str, ...], probe: str, what: str):
        self.name, self.source, self.required_flags, self.probe, self.what = name, source, required_flags, probe, what
        self.reason: str | None = None  # why ops() returned None
        self._lock = threading.Lock()  # one build or load per process, even when threads (Ray actors) ask at once
        self._loaded = False
        self._tried = False

    def key(self) -> str:
        """A hash of everything the built library depends on: the source, the flags, torch, Python and the CPU's flags."""
        flags = " ".join(sorted(cpu_flags()))
        h = hashlib.sha256()
        for part in (self.source.read_bytes(), repr((FLAGS, LDFLAGS)).encode(), torch.__version__.encode(),
                     torch.__file__.encode(), flags.encode(), str(sys.version_info[:2]).encode()):
            h.update(part)
            h.update(b"\0")
        return h.hexdigest()[:16]

    def ops(self):
        """``torch.ops.<name>`` once the library is loaded (built first if this machine has none), else None."""
        if self._loaded:
            return getattr(torch.ops, self.name)
        with self._lock:
            if not self._tried:
                self._tried = True
                self._loaded = self.load() is not None
        return getattr(torch.ops, self.name) if self._loaded else None

    def load(self):
        """Build or load the library now (no caching: :meth:`ops` calls this once); None, with :attr:`reason`, if not."""
        missing = [f for f in self.required_flags if f not in cpu_flags()]
        if missing:
            self.reason = f"this CPU lacks {', '.join(missing)}"
            return None
        if os.environ.get("RAGEN_NATIVE", "1") == "0":
            self.reason = "RAGEN_NATIVE=0"
            return None
        if self.registered():  # loaded already in this process (a test, another instance)
            return getattr(torch.ops, self.name)
        try:
            target = cache_dir() / f"{self.name}-{self.key()}.so"
            if target.exists():
                torch.ops.load_library(str(target))
            else:
                _build(self, target)
            if not self.registered():
                raise RuntimeError(f"{target.name} registered no {self.name}::{self.probe}")
        except Exception as e:  # noqa: BLE001 (any build or load failure: the Python path runs instead)
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            errors = [line for line in lines if "error" in line.lower()]  # the compiler's own messages, if any
            detail = " | ".join((errors or lines or [type(e).__name__])[:3])
            self.reason = f"building {self.source.name} failed ({type(e).__name__}: {detail[:600]})"
            warnings.warn(f"ragen: {self.what} unavailable, computing in Python instead: {self.reason}", stacklevel=3)
            return None
        return getattr(torch.ops, self.name)

    def registered(self) -> bool:
        try:
            getattr(getattr(torch.ops, self.name), self.probe)
            return True
        except (AttributeError, RuntimeError):
            return False


#: The bf16 grouped decode step (:mod:`ragen.models.native_decode`).
DECODE = NativeLibrary("ragen_native", CSRC / "decode_step.cpp", ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
                       "decode_grouped", "native decode kernels")
#: The fp32 panel GEMM (:class:`ragen.models.packed_linear.PackedLinear`).
GEMM = NativeLibrary("ragen_gemm", CSRC / "panel_gemm.cpp", ("avx2", "fma"), "linear_panels", "native panel GEMM")


def cache_dir() -> Path:
    """Where built libraries are kept: ``$RAGEN_NATIVE_DIR``, else ``native/`` under ragen's cache root
    (``$RAGEN_CACHE_DIR``, default ``~/.cache/ragen``, as the embedded model's)."""
    if os.environ.get("RAGEN_NATIVE_DIR"):
        return Path(os.environ["RAGEN_NATIVE_DIR"])
    return cache_root() / "native"


def ops():
    """``torch.ops.ragen_native`` (the decode step), or None: :func:`unavailable_reason` says why."""
    return DECODE.ops()


def gemm_ops():
    """``torch.ops.ragen_gemm`` (the panel GEMM), or None: ``GEMM.reason`` says why."""
    return GEMM.ops()


def unavailable_reason(library: NativeLibrary = DECODE) -> str | None:
    """Why ``library.ops()`` returned None (after it was called), or None."""
    return library.reason


def _build(library: NativeLibrary, target: Path) -> None:
    """Compile ``library``'s source into ``target`` (in a temporary build directory, moved into place atomically)."""
    from torch.utils.cpp_extension import load

    target.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix="build-", dir=target.parent))
    path = os.environ.get("PATH")
    try:
        # torch runs `ninja` from PATH: the ninja package's binary sits beside this interpreter, which an unactivated
        # venv (`.venv/bin/ragen ...`) does not put on PATH
        os.environ["PATH"] = os.pathsep.join([_ninja_dir(), path]) if path else _ninja_dir()
        # loads the library from the build directory too (registering its ops in this process) and returns its path
        built = load(name=library.name, sources=[str(library.source)], extra_cflags=list(FLAGS),
                     extra_ldflags=list(LDFLAGS), is_python_module=False, build_directory=str(build), verbose=False)
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
