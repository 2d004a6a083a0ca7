import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny():
    """The tiny random Llama model and the embedded model's real tokenizer."""
    from ragen.models import load_model

    return load_model("tiny")


@pytest.fixture(scope="session")
def tokenizer(tiny):
    return tiny[1]
