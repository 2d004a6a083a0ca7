"""Per-episode KV caches kept between turns, so a turn prefills only what is new.

In ``context_mode=full`` every prompt of an episode extends the previous one: turn ``k+1``
sees turn ``k``'s prompt, the model's reply and the env's answer. Re-encoding that history
every turn makes a 5-turn rollout prefill the first prompt five times. After each
``generate`` the backend stores each row's keys and values (padding columns removed) under
the token ids they encode; the next turn looks up the longest stored prefix of each prompt
and prefills only the rest.

Entries live for one :meth:`PrefixKVCache.session` (one ``Rollout.run``): the policy's
weights do not change inside it, and nothing is kept when they do. An entry is removed when
a prompt takes it, and the backend drops the entries no prompt of a call took (every episode
still playing is in every call), so a session holds at most one entry per episode still playing.

A session's entries grow with every turn (each holds its episode's whole history), so they are
bounded: ``max_bytes`` caps the bytes of keys and values kept between calls. An entry that does
not fit is not kept, and its episode prefills its whole history at the next turn, as without the
cache: the same computation, more prefill work (greedy decoding gives the same tokens; a sampled
run draws its random numbers in another row order once rows are refused, see ``HFBackend``).
A call takes every entry at its start but prefills its rows batch by batch, so a taken entry stays
in memory until its batch has copied it: taken entries count against the budget (``held``) until
the backend releases them, and the kept and held caches together never exceed ``max_bytes``
(otherwise a call's new entries could fill the budget while its older ones are still in memory:
twice the budget). Without any bound, ``ragen eval`` of 512 twenty-turn FrozenLake episodes in one
rollout holds ~19 GB.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class CachedPrefix:
    """The keys and values of ``len(token_ids)`` tokens, one ``(heads, len, head_dim)`` pair per layer."""

    token_ids: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)


class PrefixKVCache:
    """Stored per-episode KV caches, looked up by token-id prefix, at most ``max_bytes`` of them (None: no bound)."""

    def __init__(self, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        self.max_bytes = max_bytes
        #: Bytes of keys and values stored now, and the most stored or held at once since this cache was made.
        self.nbytes = 0
        self.peak_nbytes = 0
        #: Bytes of entries taken by a call whose rows have not copied them yet (see :meth:`release`).
        self.held = 0
        #: Entries not kept because the budget was full, in the current (or last) session: their
        #: episodes prefill their history again.
        self.refused = 0
        self.active = False
        #: Rows with the same tokens (a group's greedy twins) keep one entry each.
        self._entries: dict[tuple[int, ...], list[CachedPrefix]] = {}
        #: How many entries have each length, so a lookup slices the prompt once per length.
        self._lengths: dict[int, int] = {}

    @contextlib.contextmanager
    def session(self, enabled: bool = True):
        """Keep entries between ``generate`` calls inside this block only (and only if ``enabled``)."""
        self.clear()
        self.refused, self.held = 0, 0
        self.active = enabled
        try:
            yield self
        finally:
            self.active = False
            self.clear()
            self.held = 0

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return sum(self._lengths.values())

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` would be kept now."""
        return self.max_bytes is None or self.nbytes + self.held + nbytes <= self.max_bytes

    def admits(self, nbytes: int) -> bool:
        """:meth:`fits`, counting a refusal in ``refused`` when it does not."""
        if self.fits(nbytes):
            return True
        self.refused += 1
        return False

    def put(self, entry: CachedPrefix) -> None:
        """Keep ``entry`` for a later :meth:`take` if a session is on and it fits the budget (else count it refused)."""
        if not self.active or not len(entry):
            return
        size = entry.nbytes
        if not self.admits(size):
            return
        self.nbytes += size
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes + self.held)
        self._entries.setdefault(entry.token_ids, []).append(entry)
        self._lengths[len(entry)] = self._lengths.get(len(entry), 0) + 1

    def take(self, prompt: list[int]) -> CachedPrefix | None:
        """Remove and return the longest stored entry whose tokens start ``prompt`` (None if none does); its bytes
        count as ``held`` until :meth:`release`."""
        if not self.active:
            return None
        for length in sorted(self._lengths, reverse=True):
            if length > len(prompt):
                continue
            key = tuple(prompt[:length])
            same = self._entries.get(key)
            if same:
                entry = same.pop()
                if not same:
                    del self._entries[key]
                self._lengths[length] -= 1
                if not self._lengths[length]:
                    del self._lengths[length]
                self.nbytes -= entry.nbytes
                self.held += entry.nbytes
                return entry
        return None

    def release(self, nbytes: int) -> None:
        """Stop counting ``nbytes`` of taken entries: their rows have copied them and dropped them."""
        self.held = max(self.held - nbytes, 0)
