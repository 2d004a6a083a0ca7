"""The configuration reference: every key of ``ragen train`` and ``ragen sft train`` with its type, default and meaning,
read from the config dataclasses themselves (their ``#:`` comments), so the reference cannot drift from the code.

``ragen config --list`` prints it as Markdown; ``docs/configuration.md`` is that output, and a test keeps them equal.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from typing import Any

from ragen.envs.base import field_default

_COMMENT = re.compile(r"^\s*#:\s?(.*)$")
_FIELD = re.compile(r"^\s*(\w+)\s*:")


def field_comments(cls: type) -> dict[str, str]:
    """``{field: its #: comment lines joined}`` from the source of ``cls`` and its dataclass bases (the comment block
    right above each field; a subclass's comment wins over its base's)."""
    comments: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if base is not object and "__dataclass_fields__" in vars(base):
            comments.update(_own_field_comments(base))
    return comments


def _own_field_comments(cls: type) -> dict[str, str]:
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        comment = _COMMENT.match(line)
        if comment:
            pending.append(comment.group(1).strip())
            continue
        match = _FIELD.match(line)
        if match and pending:
            comments[match.group(1)] = " ".join(pending)
        if line.strip():
            pending = []
    return comments


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    text = re.sub(r"\b(?:typing|ragen\.config_schema|ragen\.config)\.", "", str(tp))
    return re.sub(r"\bOptional\[(.+)\]", r"\1 | None", text).replace("|", "\\|")


def _default(value: Any) -> str:
    if dataclasses.is_dataclass(value):
        return ""
    return "`" + repr(value).replace("|", "\\|") + "`" if value != "" else "`''`"


def rows(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """``(dotted key, type, default, meaning)`` for every leaf field of the dataclass ``cls``, depth first."""
    out: list[tuple[str, str, str, str]] = []
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        default = field_default(f)
        if dataclasses.is_dataclass(tp):
            out += rows(tp, f"{prefix}{f.name}.")
            continue
        meaning = comments.get(f.name, "")
        out.append((f"{prefix}{f.name}", _type_name(tp), _default(default), meaning.replace("``", "`").replace("|", "\\|")))
    return out


def reference_markdown() -> str:
    """The whole reference: ``ragen train``'s keys, then ``ragen sft train``'s."""
    from ragen.config import RunConfig
    from ragen.sft.config import SFTConfig

    lines = ["# Configuration reference", "",
             "Every key, its type, its default and what it does. Generated from the config dataclasses by "
             "`ragen config --list` (a test keeps this page equal to its output). Set a key in a YAML preset "
             "(`ragen/configs/`) or on the command line as `key=value`; an unknown key or a value of the wrong type "
             "is refused with its name (exit status 2).", ""]
    for title, cls in (("`ragen train` (RL)", RunConfig), ("`ragen sft train` (SFT)", SFTConfig)):
        lines += [f"## {title}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        lines += [f"| `{key}` | {tp} | {default} | {meaning} |" for key, tp, default, meaning in rows(cls)]
        lines.append("")
    return "\n".join(lines)
