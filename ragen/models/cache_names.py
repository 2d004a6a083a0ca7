"""The name transformers gives a model's KV cache, in calls and in outputs.

transformers 5.x renamed ``past_key_values`` to ``cache`` (forward keyword, ``generate``
keyword and the output field) and keeps the old name only as a deprecated alias, to be
removed in 5.40 (the warning says so). ragen supports every 5.x release, so the name is
read once from the installed library instead of being spelled out at each call site.
"""

from __future__ import annotations

import dataclasses

from transformers.modeling_outputs import BaseModelOutputWithPast

#: ``"cache"`` on transformers releases that renamed it, ``"past_key_values"`` before.
CACHE_KWARG = "cache" if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)} else "past_key_values"


def with_cache(cache, **kwargs) -> dict:
    """``kwargs`` plus the KV cache under the installed transformers' name for it."""
    kwargs[CACHE_KWARG] = cache
    return kwargs


def output_cache(output):
    """The KV cache a forward (or ``generate``) returned, whatever the installed release calls it."""
    return getattr(output, CACHE_KWARG)
