"""What the ``ragen`` command and its ``sft`` subcommands share: the error line, exit statuses, quiet transformers."""

from __future__ import annotations

import os
import sys

USAGE_ERROR = 2


def _fail(message: str) -> int:
    print(f"ragen: error: {message}", file=sys.stderr)
    return USAGE_ERROR


def _rank0() -> bool:
    """Rank 0 of a torchrun launch (its ``RANK``), or a single process: what the CLI reads before any process group."""
    return os.environ.get("RANK", "0") == "0"


def note_lost_env_settings(config) -> None:
    """One stderr line (rank 0 only) naming ``env.config`` settings from a YAML file that ``es.train`` leaves unused."""
    from ragen.config import lost_env_settings

    lost = lost_env_settings(config)
    if lost and _rank0():
        groups = sum(entry.groups for entry in config.es.train)
        print(f"ragen: note: {', '.join(lost)} not used: es.train is set, so its tags are the training envs "
              f"({groups} groups in all; env settings go on a tag: es.tags.TAG.config.KEY; docs/env_tags.md)",
              file=sys.stderr)


#: Exit status of a run stopped by Ctrl-C (its checkpoint saved), as shells report SIGINT: ``train && eval`` stops there.
INTERRUPTED = 128 + 2


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
