"""SFT data set: chat JSONL → tokenized examples → train/eval split → padded batches.

Batches use the trainer's target coordinates (:mod:`ragen.train.batch`): a sequence of
``L`` ids gives ``T = L - 1`` targets, and ``loss_mask[:, t]`` says whether token
``t + 1`` was written by the assistant.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ragen.agent.context import ChatTokens
from ragen.sft.generate import iter_jsonl, json_kind
from ragen.sft.masking import TokenizedExample, conversation_problem, tokenize_conversation


@dataclass
class SFTBatch:
    input_ids: torch.Tensor  # (B, L) right-padded
    attention_mask: torch.Tensor  # (B, L)
    loss_mask: torch.Tensor  # (B, T = L - 1) float, 1 where target t + 1 is an assistant token

    def __len__(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class SFTDataset:
    train: list[TokenizedExample]
    eval: list[TokenizedExample]
    #: Conversations dropped for being longer than ``max_length`` tokens.
    dropped_too_long: int = 0
    #: Conversations within ``max_length`` dropped for holding no token to train on (no assistant reply text).
    dropped_untrained: int = 0


#: Message roles a training conversation may hold (what ``ragen sft generate`` writes).
ROLES = ("system", "user", "assistant")


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def record_problem(record: Any) -> str | None:
    """What makes ``record`` unusable as a training conversation (the shape :func:`tokenize_conversation` needs), or None."""
    if not isinstance(record, dict):
        return f"not a JSON object (got {json_kind(record)})"
    if "messages" not in record:
        return "no 'messages' key"
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if messages == [] else json_kind(messages)
        return f"'messages' must be a non-empty list of {{role, content}} objects (got {got})"
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{k}] is not an object (got {json_kind(message)})"
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            shown = repr(role) if isinstance(role, str) else json_kind(role)
            return f"messages[{k}].role must be 'system', 'user' or 'assistant' (got {shown})"
        if not isinstance(message.get("content"), str):
            return f"messages[{k}].content must be a string (got {json_kind(message.get('content'))})"
        if not _utf8(message["content"]):  # JSON's \ud800 escapes decode to lone surrogates no tokenizer takes
            return f"messages[{k}].content holds a lone surrogate (a \\uD800-\\uDFFF escape without its pair): not text"
    agent = record.get("agent")
    if agent is not None:
        if not isinstance(agent, dict):
            return f"'agent' must be an object of agent settings (got {json_kind(agent)})"
        prefix = agent.get("response_prefix")
        if prefix is not None and not isinstance(prefix, str):
            return f"agent.response_prefix must be a string (got {json_kind(prefix)})"
    return conversation_problem(messages, (agent or {}).get("response_prefix") or "")


def tokenize_records(records: list[dict], tokenizer, *, train_on_eos: bool = True,
                     labels: list[str] | None = None) -> list[TokenizedExample]:
    """Every record's ``messages`` through :func:`tokenize_conversation` (prefix from the record's ``agent``).

    A malformed record raises ``ValueError`` starting with its label (``labels[i]``, default
    ``record i``; :func:`load_dataset` passes ``FILE:LINE``).
    """
    chat = ChatTokens(tokenizer)
    out = []
    for i, record in enumerate(records):
        label = labels[i] if labels is not None else f"record {i}"
        problem = record_problem(record)
        if problem:
            raise ValueError(f"{label}: {problem}")
        prefix = (record.get("agent") or {}).get("response_prefix", "") or ""
        try:
            out.append(tokenize_conversation(chat, record["messages"], response_prefix=prefix, train_on_eos=train_on_eos))
        except ValueError as exc:
            raise ValueError(f"{label}: {exc}") from None
    return out


def load_dataset(path: str | Path, tokenizer, *, eval_fraction: float, eval_max: int, max_length: int,
                 seed: int, train_on_eos: bool = True) -> SFTDataset:
    """Tokenize ``path``, drop over-long conversations, and hold out a seeded random eval split.

    The eval split is ``min(eval_max, max(1, round(eval_fraction * n)))`` of the ``n`` *distinct* conversations
    (identical token sequences count once), each once, with none of its copies left in training (none if only one
    distinct conversation is left, so a single example still trains); repeats stay in the training split. A line that is
    not a well-formed conversation raises ``ValueError`` naming the file, the line and the problem.
    """
    numbered = list(iter_jsonl(path))
    if not numbered:
        raise ValueError(f"{path}: no records")
    examples = tokenize_records([record for _, record in numbered], tokenizer, train_on_eos=train_on_eos,
                                labels=[f"{path}:{number}" for number, _ in numbered])
    kept = [e for e in examples if len(e) <= max_length and e.num_trained > 0]
    too_long = sum(len(e) > max_length for e in examples)
    if not kept:
        if all(len(e) > max_length for e in examples):
            raise ValueError(f"{path}: every conversation is longer than data.max_length={max_length} tokens")
        raise ValueError(f"{path}: no conversation within data.max_length={max_length} tokens has an assistant token to train on")
    # held out by distinct conversation: expert data repeats (a bandit prompt and its answer come back many times),
    # and a copy of a training conversation in the eval split would measure recall, not generalisation
    distinct: dict[tuple, list[TokenizedExample]] = {}
    for e in kept:
        distinct.setdefault((tuple(e.input_ids), tuple(e.loss_mask)), []).append(e)
    copies = list(distinct.values())
    order = np.random.default_rng(seed).permutation(len(copies))
    n_eval = min(eval_max, max(1, round(eval_fraction * len(copies)))) if len(copies) > 1 else 0
    eval_set = [copies[i][0] for i in order[:n_eval]]  # each held-out conversation once
    train_set = [e for i in order[n_eval:] for e in copies[i]]  # repeats kept: they weight the training data
    return SFTDataset(train_set, eval_set, too_long, len(examples) - len(kept) - too_long)


def collate(examples: list[TokenizedExample], pad_id: int) -> SFTBatch:
    """Right-pad ``examples`` into one batch."""
    B = len(examples)
    L = max(len(e) for e in examples)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    loss_mask = torch.zeros((B, L - 1))
    for b, example in enumerate(examples):
        n = len(example)
        input_ids[b, :n] = torch.tensor(example.input_ids)
        attention_mask[b, :n] = 1
        loss_mask[b, : n - 1] = torch.tensor(example.loss_mask[1:], dtype=torch.float)
    return SFTBatch(input_ids, attention_mask, loss_mask)


@functools.lru_cache(maxsize=8)
def epoch_order(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    """The shuffled order of epoch ``epoch``: a function of ``(seed, epoch)`` only, so resume is exact."""
    return tuple(np.random.default_rng([seed, epoch]).permutation(n).tolist())


def step_examples(train: list[TokenizedExample], batch_size: int, seed: int, step: int) -> list[TokenizedExample]:
    """The examples of optimizer step ``step`` (1-based): consecutive slices of each epoch's order.

    An epoch's last, partial batch is filled from the next epoch's order, so every step
    has ``min(batch_size, len(train))`` examples.
    """
    n = len(train)
    size = min(batch_size, n)
    start = (step - 1) * size
    picked = []
    for position in range(start, start + size):
        epoch, index = divmod(position, n)
        picked.append(train[epoch_order(n, seed, epoch)[index]])
    return picked


__all__ = ["SFTBatch", "SFTDataset", "ROLES", "record_problem", "tokenize_records", "load_dataset", "collate", "epoch_order", "step_examples"]
