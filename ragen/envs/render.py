"""RGB frames of grid envs: coloured tiles with simple glyphs, drawn with numpy alone.

No pygame, no display, no image files: a frame is a pure function of the grid and the tile
size, so the same state always gives the same bytes. Used by Sokoban and FrozenLake for
``render_mode="rgb_array"``; :func:`encode_png` turns a frame into PNG bytes with the
standard library (``zlib`` + ``struct``), for the trajectory viewer.

A tile is a background colour plus glyphs painted in order, each a shape scaled to the tile:
``disc``, ``ring``, ``square``, ``diamond``, ``cross`` or ``bricks`` (mortar lines).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Mapping

import numpy as np

#: Default edge length of one grid cell, in pixels.
TILE_SIZE = 32

RGB = tuple[int, int, int]


@dataclass(frozen=True)
class Glyph:
    """A shape centred in the tile. ``size`` is its half-extent (radius) in tile widths, ``width`` a line width."""

    shape: str
    color: RGB
    size: float = 0.3
    width: float = 0.08


@dataclass(frozen=True)
class Tile:
    background: RGB
    glyphs: tuple[Glyph, ...] = ()
    #: Draw a 1-pixel darker outline so neighbouring cells of the same colour stay apart.
    outline: bool = True


SHAPES = ("disc", "ring", "square", "diamond", "cross", "bricks")


def _mask(glyph: Glyph, size: int) -> np.ndarray:
    # Pixel centres in [-0.5, 0.5] tile units, y down.
    c = (np.arange(size) + 0.5) / size - 0.5
    y, x = np.meshgrid(c, c, indexing="ij")
    r, w = glyph.size, glyph.width
    if glyph.shape == "disc":
        return x * x + y * y <= r * r
    if glyph.shape == "ring":
        d2 = x * x + y * y
        return (d2 <= r * r) & (d2 >= (r - w) ** 2)
    if glyph.shape == "square":
        return np.maximum(abs(x), abs(y)) <= r
    if glyph.shape == "diamond":
        return abs(x) + abs(y) <= r
    if glyph.shape == "cross":
        return ((abs(x - y) <= w) | (abs(x + y) <= w)) & (np.maximum(abs(x), abs(y)) <= r)
    if glyph.shape == "bricks":
        # Two courses of bricks per tile, joints staggered between the courses.
        half = w / 2
        course = abs(y) <= half
        joints = np.where(y < 0, abs(x) <= half, abs(x) >= 0.5 - half)
        return course | joints
    raise ValueError(f"unknown glyph shape {glyph.shape!r}; known: {', '.join(SHAPES)}")


@lru_cache(maxsize=256)
def tile_image(tile: Tile, size: int) -> np.ndarray:
    """One ``(size, size, 3)`` uint8 tile (cached; treat as read-only)."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tile size must be a positive int, got {size!r}")
    img = np.empty((size, size, 3), dtype=np.uint8)
    img[:] = tile.background
    for glyph in tile.glyphs:
        img[_mask(glyph, size)] = glyph.color
    if tile.outline and size >= 4:
        edge = (np.asarray(tile.background, dtype=np.float64) * 0.8).astype(np.uint8)
        img[0, :] = img[-1, :] = edge
        img[:, 0] = img[:, -1] = edge
    img.setflags(write=False)
    return img


def draw_grid(rows: Iterable[str], tiles: Mapping[str, Tile], tile_size: int = TILE_SIZE) -> np.ndarray:
    """Paint a grid of symbols (one string per row) as an ``(H, W, 3)`` uint8 image, ``tile_size`` px per cell."""
    rows = list(rows)
    if not rows:
        return np.zeros((0, 0, 3), dtype=np.uint8)
    width = len(rows[0])
    if any(len(row) != width for row in rows):
        raise ValueError("draw_grid: ragged rows")
    out = np.empty((len(rows) * tile_size, width * tile_size, 3), dtype=np.uint8)
    for r, row in enumerate(rows):
        for c, symbol in enumerate(row):
            if symbol not in tiles:
                raise ValueError(f"draw_grid: no tile for symbol {symbol!r}")
            out[r * tile_size:(r + 1) * tile_size, c * tile_size:(c + 1) * tile_size] = tile_image(tiles[symbol], tile_size)
    return out


def encode_png(frame: np.ndarray, level: int = 9) -> bytes:
    """An ``(H, W, 3)`` uint8 array as PNG bytes (8-bit RGB, no interlace), with the standard library only."""
    frame = np.asarray(frame)
    if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3 or 0 in frame.shape[:2]:
        raise ValueError(f"encode_png: need a non-empty (H, W, 3) uint8 array, got {frame.dtype} {frame.shape}")
    height, width, _ = frame.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    # Filter type 0 (None) on every scanline.
    raw = np.concatenate([np.zeros((height, 1), dtype=np.uint8), frame.reshape(height, width * 3)], axis=1)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw.tobytes(), level))
        + chunk(b"IEND", b"")
    )


def check_render_mode(env_name: str, render_mode: str | None, modes: Iterable[str]) -> str | None:
    """``render_mode`` if it is None or one of ``modes``; else a ``ValueError`` naming the valid ones."""
    modes = list(modes)
    if render_mode is not None and render_mode not in modes:
        raise ValueError(f"{env_name}: unsupported render_mode {render_mode!r}; supported: {', '.join(modes)} or None")
    return render_mode


def check_tile_size(env_name: str, tile_size: int) -> int:
    if isinstance(tile_size, bool) or not isinstance(tile_size, int) or tile_size < 1:
        raise ValueError(f"{env_name}: tile_size must be a positive int, got {tile_size!r}")
    return tile_size


class TiledRender:
    """``render()`` for a text env that can also draw its grid (mix in before ``TextEnv``).

    ``render()`` is the observation text, or with ``render_mode="rgb_array"`` the RGB frame of
    :meth:`render_rgb`. The env supplies ``tiles`` (grid symbol → :class:`Tile`), ``_text()``
    (the observation text) and ``_tile_rows()`` (the grid as rows of symbols, None before
    ``reset``), and calls :meth:`_init_render` from its constructor.
    """

    tiles: Mapping[str, Tile] = {}

    def _init_render(self, env_name: str, render_mode: str | None, tile_size: int) -> None:
        self.render_mode = check_render_mode(env_name, render_mode, self.metadata["render_modes"])
        self.tile_size = check_tile_size(env_name, tile_size)

    def render(self) -> str | np.ndarray:
        """The observation text; with ``render_mode="rgb_array"`` the RGB frame (:meth:`render_rgb`)."""
        if self.render_mode == "rgb_array":
            return self.render_rgb()
        return self._text()

    def render_rgb(self) -> np.ndarray:
        """The grid as an ``(H, W, 3)`` uint8 image, ``tile_size`` px per cell ((0, 0, 3) before ``reset``)."""
        rows = self._tile_rows()
        if rows is None:
            return np.zeros((0, 0, 3), dtype=np.uint8)
        return draw_grid(rows, self.tiles, self.tile_size)
