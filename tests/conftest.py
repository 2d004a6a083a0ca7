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


#: The longest test files, longest first (seconds of test time summed per file, `pytest --durations=0` on a
#: 2-core CPU: 30 to 110 s each). They are collected first: under
#: `--dist loadfile` xdist deals files out in collection order, and one of these dealt last (tests/train comes
#: last alphabetically) kept one worker busy for a minute or more after the other had run out of files.
RUN_FIRST = (
    "tests/train/test_ray_rollout.py", "tests/train/test_resume.py", "tests/train/test_fsdp.py",
    "tests/train/test_algorithms_wired.py", "tests/models/test_adapter_and_model_dir_loading.py", "tests/models/test_sampling.py",
    "tests/sft/test_train.py", "tests/eval/test_optimality.py", "tests/train/test_window_mode.py",
    "tests/train/test_run_records_and_checkpoints.py", "tests/eval/test_evaluate.py",
)


def pytest_collection_modifyitems(session, config, items):
    """Move :data:`RUN_FIRST`'s files to the front, in that order; every other test keeps its place."""
    root = config.rootpath
    rank = {name: i for i, name in enumerate(RUN_FIRST)}

    def place(item):
        try:
            name = item.path.relative_to(root).as_posix()
        except ValueError:  # a test outside the repo (a path given on the command line)
            return len(rank)
        return rank.get(name, len(rank))

    items.sort(key=place)  # stable
