"""Atomic writes: a temp file or dir next to the target, then ``os.replace``.

A failure (bad input found late, an exception, Ctrl-C) leaves the old file as it was and no
partial new one; the temp name starts with ``.`` and ends in ``.tmp`` so no ``*.jsonl`` or
``*.yaml`` glob picks it up.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterator, TextIO


def _new_file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_open(path: str | Path, encoding: str = "utf-8") -> Iterator[TextIO]:
    """``with atomic_open(path) as f: f.write(...)``: ``path`` is replaced only when the block ends without error.

    The new file keeps the mode of the file it replaces (a new one gets the umask's default).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = stat.S_IMODE(path.stat().st_mode) if path.is_file() else _new_file_mode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_open(path) as f:
        f.write(text)


def write_dir_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Build directory ``path`` with ``write(tmp_dir)``, then swap it in (an old ``path`` is removed only after)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    old = None
    try:
        write(tmp)
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", suffix=".tmp", dir=path.parent))
            os.replace(path, old / path.name)
        os.replace(tmp, path)
    except BaseException:
        if old is not None and not path.exists():  # put the old one back
            os.replace(old / path.name, path)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return path


def file_in_the_way(path: str | Path) -> Path | None:
    """The existing non-directory at ``path`` or at one of its parents (``mkdir -p path`` would fail on it), or None."""
    for candidate in (Path(path).absolute(), *Path(path).absolute().parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


def strict_json(value):
    """``value`` (dicts, lists, numbers, ...) with every NaN or infinite float replaced by None, for a JSON file that
    other tools read: ``json.dumps`` writes such floats as ``NaN``/``Infinity``, which strict JSON parsers reject."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def strict_dumps(value, indent: int | None = None) -> str:
    """``value`` as strict JSON text (:func:`strict_json`: NaN and infinities as ``null``), for files other tools read."""
    return json.dumps(strict_json(value), indent=indent, allow_nan=False)


__all__ = ["atomic_open", "write_text_atomic", "write_dir_atomic", "file_in_the_way", "strict_json", "strict_dumps", "file_sha256"]


def file_sha256(path: str | Path) -> str:
    """The hex SHA-256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
