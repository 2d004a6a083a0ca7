"""``ragen sweep``: seeds parsed, runs read and tabulated, a real sweep on the tiny model."""

from __future__ import annotations

import json

import pytest

from ragen.cli import main
from ragen.eval.sweep import SeedResult, format_table, parse_seeds, read_run


def test_parse_seeds():
    assert parse_seeds("0-3") == [0, 1, 2, 3]
    assert parse_seeds("5,0-2,1") == [5, 0, 1, 2]
    for bad in ("", "a", "3-1", "-1"):
        with pytest.raises(ValueError):
            parse_seeds(bad)


def _write_run(path, before, after, second):
    path.mkdir(parents=True)
    rows = [{"step": 0, "val/success": before, "val/Bandit/success": before},
            {"step": 1, "actor/entropy": 0.5, "collapse/in_group_reward_std": 0.3, "actor/grad_norm": 1.0},
            {"step": 2, "actor/entropy": 0.01, "collapse/in_group_reward_std": 0.3, "actor/grad_norm": 1.0,
             "val/success": after, "val/Bandit/success": after, "val/Bandit/info_second_listed": second}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "summary.json").write_text(json.dumps({"val_after": {}, "wall_time_s": 12.0}))


def test_read_run_and_table(tmp_path):
    _write_run(tmp_path / "a", 0.5, 0.75, 0.4)
    _write_run(tmp_path / "b", 0.5, 0.625, 0.6)
    results = [read_run(tmp_path / "a", 0), read_run(tmp_path / "b", 1)]
    assert results[0] == SeedResult(0, {"all": 0.5, "Bandit": 0.5}, {"all": 0.75, "Bandit": 0.75},
                                    {"Bandit/second_listed": 0.4}, warnings=0, wall_time_s=12.0)
    table = format_table(results)
    assert "| 0 | 0.500 | 0.750 | +0.250 | 0.500 → 0.750 | 0.40 | 0 | 12 |" in table  # low entropy alone: quiet
    # gains 0.25 and 0.125: mean 0.1875, sd 0.0884, t(1) = 12.706 → half 0.794
    assert "mean gain +0.188 (95 % CI -0.607 to +0.982, 2 seeds), min +0.125" in table
    assert "Bandit/second_listed at the end: 0.40 to 0.60" in table


def test_a_run_without_final_validation_is_refused(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text(json.dumps({"step": 0, "val/success": 0.5}) + "\n")
    with pytest.raises(ValueError, match="no validation"):
        read_run(tmp_path / "r", 0)


def test_sweep_runs_each_seed_once_and_reuses_finished_runs(tmp_path, capsys):
    args = ["sweep", "bandit", "--seeds", "0-1", "--out", str(tmp_path / "sw"), "--table", str(tmp_path / "t.md"),
            "model=tiny", "trainer.total_steps=1", "rollout.env_groups=2", "rollout.group_size=2",
            "rollout.max_new_tokens=4", "trainer.val_episodes=2"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "[sweep] seed 1" in first and (tmp_path / "sw" / "seed_1" / "summary.json").exists()
    assert main(args) == 0  # the second time both runs are read, not run
    second = capsys.readouterr().out
    assert "[sweep] seed" not in second
    assert (tmp_path / "t.md").read_text().startswith("| seed | start | end | gain |")


def test_sweep_refuses_a_bad_key_before_running(tmp_path, capsys):
    assert main(["sweep", "bandit", "--out", str(tmp_path), "trainer.nope=1"]) == 2
    assert "trainer.nope" in capsys.readouterr().err
