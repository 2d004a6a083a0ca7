"""SFT data set: chat JSONL → tokenized examples → train/eval split → padded batches.

Batches use the trainer's target coordinates (:mod:`ragen.train.batch`): a sequence of
``L`` ids gives ``T = L - 1`` targets, and ``loss_mask[:, t]`` says whether token
``t + 1`` was written by the assistant.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ragen.agent.context import ChatTokens
from ragen.sft.generate import read_jsonl
from ragen.sft.masking import TokenizedExample, tokenize_conversation


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


def tokenize_records(records: list[dict], tokenizer, *, train_on_eos: bool = True) -> list[TokenizedExample]:
    """Every record's ``messages`` through :func:`tokenize_conversation` (prefix from the record's ``agent``)."""
    chat = ChatTokens(tokenizer)
    out = []
    for i, record in enumerate(records):
        if "messages" not in record:
            raise ValueError(f"record {i}: no 'messages' key")
        prefix = (record.get("agent") or {}).get("response_prefix", "") or ""
        try:
            out.append(tokenize_conversation(chat, record["messages"], response_prefix=prefix, train_on_eos=train_on_eos))
        except ValueError as exc:
            raise ValueError(f"record {i}: {exc}") from None
    return out


def load_dataset(path: str | Path, tokenizer, *, eval_fraction: float, eval_max: int, max_length: int,
                 seed: int, train_on_eos: bool = True) -> SFTDataset:
    """Tokenize ``path``, drop over-long conversations, and hold out a seeded random eval split.

    The eval split is ``min(eval_max, max(1, round(eval_fraction * n)))`` conversations
    (none if only one conversation is left, so a single example still trains).
    """
    records = read_jsonl(path)
    if not records:
        raise ValueError(f"{path}: no records")
    examples = tokenize_records(records, tokenizer, train_on_eos=train_on_eos)
    kept = [e for e in examples if len(e) <= max_length and e.num_trained > 0]
    dropped = len(examples) - len(kept)
    if not kept:
        raise ValueError(f"{path}: every conversation is longer than data.max_length={max_length} tokens")
    order = np.random.default_rng(seed).permutation(len(kept))
    n_eval = min(eval_max, max(1, round(eval_fraction * len(kept)))) if len(kept) > 1 else 0
    eval_set = [kept[i] for i in order[:n_eval]]
    train_set = [kept[i] for i in order[n_eval:]]
    return SFTDataset(train_set, eval_set, dropped)


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


__all__ = ["SFTBatch", "SFTDataset", "tokenize_records", "load_dataset", "collate", "epoch_order", "step_examples"]
