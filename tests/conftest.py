import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite is the CPU suite on every machine (trainer.device=auto would pick a visible GPU):
# GPU checks are opt-in, RAGEN_TEST_CUDA=1 pytest tests/train/test_device.py (docs/scaling.md).
if os.environ.get("RAGEN_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (`pytest -n N`) the workers share the cores: each one (and the processes its tests start)
# gets its share of OpenMP threads instead of every worker taking them all, unless the caller set a count.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1 and "OMP_NUM_THREADS" not in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)  # not on macOS
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cores // _workers))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny():
    """The tiny random Llama model and the embedded model's real tokenizer."""
    from ragen.models import load_model

    return load_model("tiny")


@pytest.fixture(scope="session")
def tokenizer(tiny):
    return tiny[1]
