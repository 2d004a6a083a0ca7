"""Supervised fine-tuning from demonstrations (``ragen sft``), one job per module.

* :mod:`ragen.sft.rationale` -- short, honest ``<think>`` text derived from a solver's plan;
* :mod:`ragen.sft.generate` -- expert episodes and rejection-sampled rollouts as chat JSONL;
* :mod:`ragen.sft.masking` -- a conversation → token ids + assistant-token mask, the rollout's way;
* :mod:`ragen.sft.data` -- tokenized data set, eval split, batches;
* :mod:`ragen.sft.config` -- the typed SFT config;
* :mod:`ragen.sft.trainer` -- the training loop and run directory;
* :mod:`ragen.sft.merge` -- LoRA adapter → standalone Hugging Face model;
* :mod:`ragen.sft.cli` -- the ``ragen sft`` subcommands.

Nothing heavy is imported here, so ``ragen --help`` stays fast. See ``docs/sft.md``.
"""
