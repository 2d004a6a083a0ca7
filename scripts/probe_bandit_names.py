"""Does a model know which bandit arm names are risky? A zero-shot probe, no training.

For each arm name ``n`` and each (template, word pair), the score is
``log P(word_risky | template(n)) - log P(word_safe | template(n))`` at the next token.
A pair of arms is ranked correctly when the high (risky) arm scores above the low one;
the probe reports, per template, the fraction of (high, low) name pairs ranked correctly
on the training names and on the disjoint test names (``ragen.envs.bandit.NAMES``).

Choose the probe on the training names only: the test column of the row that is best on
training names estimates what the model's own knowledge, elicited that way, can do on unseen
names. Rows chosen by their test column would be fitted to the test set.

    .venv/bin/python scripts/probe_bandit_names.py [MODEL]   # default: smollm2-135m
"""

from __future__ import annotations

import argparse
import itertools

import torch

from ragen.envs.bandit import NAMES
from ragen.models import ModelLoadError, load_model

TEMPLATES = [
    "Q: Is being a {n} a risky job or a safe job?\nA: Being a {n} is a",
    "A {n} has a job that is very",
    "Question: Which word describes the life of a {n}, risky or safe?\nAnswer: The life of a {n} is",
    "Being a {n} is",
]
WORD_PAIRS = [("risky", "safe"), ("dangerous", "safe"), ("dangerous", "boring")]


@torch.no_grad()
def next_word_log_odds(model, tokenizer, text: str, word_a: str, word_b: str) -> float:
    """log P(" word_a") - log P(" word_b") for the token after ``text`` (each word's first token)."""
    a, b = (tokenizer.encode(" " + w, add_special_tokens=False)[0] for w in (word_a, word_b))
    logprobs = model(tokenizer(text, return_tensors="pt").input_ids).logits[0, -1].log_softmax(-1)  # (V,)
    return float(logprobs[a] - logprobs[b])


def pairs_ranked(scores: dict[str, float], split: str) -> tuple[int, int]:
    """(correctly ranked, all) (high, low) name pairs of ``split`` under ``scores``."""
    pairs = list(itertools.product(NAMES[split]["high"], NAMES[split]["low"]))
    return sum(scores[h] > scores[lo] for h, lo in pairs), len(pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    args = parser.parse_args()
    try:
        model, tokenizer = load_model(args.model)
    except ModelLoadError as exc:
        parser.error(str(exc))  # one line, exit status 2
    model.eval()
    names = sorted({n for split in NAMES.values() for group in split.values() for n in group})
    print("train pairs  test pairs  words            template")
    for template, (a, b) in itertools.product(TEMPLATES, WORD_PAIRS):
        scores = {n: next_word_log_odds(model, tokenizer, template.format(n=n), a, b) for n in names}
        (tr, n_tr), (te, n_te) = pairs_ranked(scores, "train"), pairs_ranked(scores, "test")
        print(f"{tr:5d}/{n_tr:<5d} {te:5d}/{n_te:<5d}  {a + '/' + b:16s} {template!r}")


if __name__ == "__main__":
    main()
