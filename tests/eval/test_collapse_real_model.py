"""Slow: a real SmolLM2-135M run that collapses on purpose, and the alarm that says so.

Seed 3 of the bandit with group-balanced arm orders and no KL anchor ends answering the first-listed arm whatever
the names (validation 0.500): the run ``tests/eval/data/bandit_position_habit.jsonl`` was recorded from. Run with
``.venv/bin/python -m pytest -m slow tests/eval/test_collapse_real_model.py`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import pytest

from ragen.cli import main


@pytest.mark.slow
def test_a_position_habit_run_trips_the_habit_alarm(tmp_path, capsys):
    assert main(["train", "bandit", "seed=3", "env.config.arm_order=group_balanced", "algorithm.use_kl_loss=false",
                 "optim.lr=1e-5", "trainer.total_steps=36", f"trainer.output_dir={tmp_path}", "trainer.progress_bar=false",
                 "trainer.save_final=false", "trainer.plot=false"]) == 0
    out = capsys.readouterr().out
    assert "the answers follow a habit, not the input" in out
