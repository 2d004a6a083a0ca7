"""``gradient_checkpointing=auto``: checkpoint the decoder layers only for updates whose samples the token budget
cannot split, and say so once.

The token budget (``max_tokens_per_micro_batch``, ragen/train/micro_batches.py) bounds a pass's activations by
running fewer samples together; a sample longer than the budget still runs, alone, with activations the budget did
not plan for. Checkpointing recomputes each layer in the backward pass (about one extra forward, ~1/3 more update
compute) and keeps only the layer inputs: it pays exactly there. For short samples it would cost that third for
memory the budget already bounds, so ``auto`` leaves it off.
"""

from __future__ import annotations

from typing import Callable

from ragen.models.checkpointing import disable_checkpointing, enable_checkpointing


class CheckpointingChoice:
    """Applies ``setting`` (``auto`` | ``true`` | ``false``) to ``model`` before each update."""

    def __init__(self, model, setting: str, max_tokens: int, say: Callable[[str], None], prefix: str = "[ragen]"):
        self.model, self.setting, self.max_tokens, self.say, self.prefix = model, setting, max_tokens, say, prefix
        self.on: bool | None = None
        self._said: set[bool] = set()
        if setting == "true":
            self._apply(True, "trainer.gradient_checkpointing=true")
        elif setting == "false":
            disable_checkpointing(model)
            self.on = False

    def before_update(self, longest_sample: int) -> bool:
        """Switch checkpointing for an update whose longest sample has ``longest_sample`` tokens; whether it is on."""
        if self.setting != "auto":
            return self.setting == "true"
        needed = bool(self.max_tokens) and longest_sample > self.max_tokens
        if needed != self.on:
            why = (f"a sample of {longest_sample} tokens is longer than max_tokens_per_micro_batch={self.max_tokens}"
                   if needed else f"every sample fits max_tokens_per_micro_batch={self.max_tokens} "
                   f"(longest {longest_sample} tokens)")
            self._apply(needed, why)
        return needed

    def _apply(self, on: bool, why: str) -> None:
        (enable_checkpointing if on else disable_checkpointing)(self.model)
        self.on = on
        if on not in self._said:  # each choice said once, with its first reason, however often updates switch
            self._said.add(on)
            self.say(f"{self.prefix} activation checkpointing {'on' if on else 'off'}: {why}")
