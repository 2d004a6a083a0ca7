"""``ragen eval``: tiny model, run dirs (full and LoRA), bad paths, JSON report, pass@k."""

from __future__ import annotations

import json
import math
import re
from itertools import combinations

import pytest
import torch

from ragen.cli import main
from ragen.config import load_config
from ragen.eval.evaluate import evaluate, format_table, pass_at_k, run_baseline, validation_seeds
from ragen.agent.env_sets import VAL_SEED_BASE

HEADLINE = ["model", "env", "episodes", "seeds", "k", "n", "temperature", "success", "pass_at_k", "reward_mean",
            "valid_action_rate", "response_length", "greedy", "sampled", "baselines", "notes"]
SMALL_TRAIN = ["model=tiny", "trainer.total_steps=1", "rollout.env_groups=2", "rollout.group_size=2",
               "trainer.val_episodes=2", "trainer.val_before_train=false", "trainer.progress_bar=false",
               "trainer.log_rollouts_freq=0", "trainer.plot=false"]


def test_pass_at_k_matches_its_definition():
    # 1 - C(n-c, k)/C(n, k) is the chance that k of the n samples, drawn without replacement, hold a success.
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                draws = list(combinations([True] * c + [False] * (n - c), k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws))
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(10, 3, 1) == pytest.approx(0.3)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_seeds_are_the_training_validation_seeds():
    assert validation_seeds(3) == [VAL_SEED_BASE, VAL_SEED_BASE + 1, VAL_SEED_BASE + 2]


def test_ragen_eval_tiny_json_report(tmp_path, capsys):
    out = tmp_path / "sub" / "report.json"
    assert main(["eval", "tiny", "bandit", "es.val=[{tag: Bandit}]", "trainer.val_episodes=4", "--k", "2", "--n", "3",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert all(key in report for key in HEADLINE), set(HEADLINE) - set(report)
    assert report["model"] == "tiny" and report["env"] == "bandit" and report["episodes"] == 4
    assert report["seeds"] == {"first": VAL_SEED_BASE, "count": 4}
    assert report["k"] == 2 and report["n"] == 3 and "pass@2" in report
    assert report["sampled"]["episodes"] == 12 and report["greedy"]["episodes"] == 4
    for key in ("success", "pass_at_k", "valid_action_rate"):
        assert 0.0 <= report[key] <= 1.0
    assert report["response_length"] > 0
    assert set(report["baselines"]) == {"random", "expert"}
    assert report["baselines"]["expert"]["success"] == 1.0  # the oracle always pulls the high arm
    assert [t["seed"] for t in report["examples"]["greedy"]] == [VAL_SEED_BASE + i for i in range(3)]
    table = capsys.readouterr().out
    preset_t = load_config("bandit").rollout.temperature
    for label in ("model, greedy", f"model, T={preset_t:g} x3", "random agent", "expert agent (oracle)", "pass@2"):
        assert label in table


def test_greedy_only_and_no_baselines(tmp_path):
    out = tmp_path / "r.json"
    assert main(["eval", "tiny", "bandit", "es.val=[]", "trainer.val_episodes=2", "--k", "0", "--no-baselines",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["sampled"] is None and report["pass_at_k"] is None and report["baselines"] == {}


def test_eval_matches_training_validation_of_a_run_dir(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "bandit", *SMALL_TRAIN, f"trainer.output_dir={run}"]) == 0
    val_after = json.loads((run / "summary.json").read_text())["val_after"]
    out = tmp_path / "eval.json"
    # ENV_OR_YAML may be the run dir itself: its config.yaml (same agent settings, same val_episodes).
    assert main(["eval", str(run), str(run), "--k", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    # The bandit preset validates greedily on two tags: eval's greedy numbers are training's, tag by tag.
    assert list(report["tags"]) == ["Bandit", "BanditTest"]
    for tag, tag_report in report["tags"].items():
        assert tag_report["episodes"] == 2
        assert tag_report["success"] == val_after[f"val/{tag}/success"]
        assert tag_report["reward_mean"] == pytest.approx(val_after[f"val/{tag}/reward_mean"])
        assert tag_report["response_length"] == pytest.approx(val_after[f"val/{tag}/response_length"])


def test_eval_a_lora_run_dir_merges_the_adapter(tmp_path):
    run = tmp_path / "lora"
    assert main(["train", "bandit", *SMALL_TRAIN, "lora.rank=2", f"trainer.output_dir={run}"]) == 0
    assert (run / "final" / "adapter_config.json").is_file()
    # The tiny model's rewards do not vary, so one GRPO step leaves lora_B at its zero init:
    # give the saved adapter non-zero B matrices so that merging visibly changes the weights.
    from safetensors.torch import load_file, save_file

    weights_file = run / "final" / "adapter_model.safetensors"
    weights = load_file(weights_file)
    generator = torch.Generator().manual_seed(0)
    weights = {k: torch.randn(v.shape, generator=generator) if "lora_B" in k else v for k, v in weights.items()}
    save_file(weights, weights_file)
    from ragen.eval.evaluate import make_backend
    from ragen.models import load_model

    config = load_config(str(run / "config.yaml"))
    config.model = str(run)
    backend, _ = make_backend(config)
    base, _ = load_model("tiny", seed=config.seed)
    merged = dict(backend.model.named_parameters())
    assert not any("lora" in name for name in merged)
    changed = [n for n, p in base.named_parameters() if not torch.equal(p, merged[n])]
    assert changed and all("proj" in n for n in changed)  # only LoRA-targeted weights moved
    assert main(["eval", str(run), "bandit", "trainer.val_episodes=2", "--k", "0", "--no-baselines"]) == 0


def test_not_a_model_is_one_line_exit_2(tmp_path, capsys):
    bogus = tmp_path / "not-a-model"
    bogus.mkdir()
    (bogus / "notes.txt").write_text("hello")
    assert main(["eval", str(bogus), "bandit", "--no-baselines"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ragen: error:") and str(bogus) in err[0]
    assert "Traceback" not in err[0]
    # a directory that claims to be a model but is not loadable: still one line, naming the path
    (bogus / "config.json").write_text("{}")
    assert main(["eval", str(bogus), "bandit", "--no-baselines"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bogus) in err[0]


def test_user_errors_exit_2(capsys):
    assert main(["eval", "tiny", "bandit", "no_such.key=1"]) == 2
    assert main(["eval", "tiny", "nonexistent.yaml"]) == 2
    assert main(["eval", "tiny", "bandit", "--k", "3", "--n", "2"]) == 2
    assert main(["eval", "tiny", "bandit", "es.val=[]", "env.config.name_set=nope", "--no-baselines"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("ragen: error:") for line in err)


def test_env_without_expert_is_skipped_with_a_note(monkeypatch):
    from ragen.envs.agents import ExpertAgent

    def no_expert(self, env):
        raise ValueError("no expert for BanditEnv: give the env an expert_actions() method returning answer strings")

    monkeypatch.setattr(ExpertAgent, "plan", no_expert)
    config = load_config("bandit", ["model=tiny", "trainer.val_episodes=2", "es.val=[]"])
    assert "skipped" in run_baseline(config, "expert", validation_seeds(2))
    report = evaluate(config, k=0)
    assert "skipped" in report["baselines"]["expert"] and "success" in report["baselines"]["random"]
    assert any("expert baseline skipped" in note for note in report["notes"])
    table = format_table(report)
    assert re.search(r"expert agent \(oracle\)\s+skipped", table) and "note: expert baseline skipped" in table
    assert not math.isnan(report["success"])


def test_eval_plays_the_configs_validation_tags(tmp_path):
    """Like training validation: every es.val tag with its own env, config, horizon and instructions."""
    lake = ("es.tags={Lake: {env: frozen_lake, config: {size: 4, is_slippery: false}, max_turn: 2, max_actions_per_turn: 3, "
            "instructions: 'Reach G quickly.'}}")
    out = tmp_path / "report.json"
    assert main(["eval", "tiny", "bandit", lake, "es.val=[{tag: Lake, episodes: 2}, {tag: BanditTest, episodes: 3}]",
                 "--k", "0", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report["tags"]) == ["Lake", "BanditTest"]
    lake_report, bandit_report = report["tags"]["Lake"], report["tags"]["BanditTest"]
    assert lake_report["env"] == "frozen_lake" and lake_report["episodes"] == 2
    assert lake_report["env_config"] == {"size": 4, "is_slippery": False}
    example = lake_report["examples"]["greedy"][0]
    assert example["tag"] == "Lake" and len(example["turns"]) <= 2
    assert bandit_report["env"] == "bandit" and bandit_report["episodes"] == 3
    assert bandit_report["env_config"] == {"name_set": "test", "arm_order": "seed_parity"}
    assert lake_report["baselines"]["expert"]["success"] == 1.0  # deterministic lake: the planner always arrives
    # FrozenLake episodes are replayed and scored against the exact optimum; on deterministic ice
    # the value estimate of each episode is its success, so the means agree exactly.
    optimality = lake_report["optimality"]
    assert optimality["episodes"] == 2 and optimality["value_estimate"] == pytest.approx(lake_report["success"])
    assert bandit_report["optimality"] is None
    assert "model, greedy, value" in format_table(lake_report)
    assert "model, greedy, value" not in format_table(bandit_report)


def test_an_env_override_the_validation_tags_would_ignore_exits_2(capsys, tmp_path):
    # The bandit preset evaluates its es.val tags (Bandit, BanditTest), each with its own env config: an env.*
    # override would change nothing, so it is refused, naming the key, the tags and both ways to say it.
    assert main(["eval", "tiny", "bandit", "env.config.name_set=test", "--k", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'env.config.name_set'" in err and "Bandit, BanditTest" in err
    assert "es.tags.TAG.config.name_set=VALUE" in err and "'es.val=[]'" in err
    # Either way is accepted: the env itself on the test names, or the tag changed.
    out = tmp_path / "report.json"
    assert main(["eval", "tiny", "bandit", "es.val=[]", "env.config.name_set=test", "trainer.val_episodes=1", "--k", "0",
                 "--no-baselines", "--json", str(out)]) == 0
    assert main(["eval", "tiny", "bandit", "es.tags.BanditTest.config.high_payoff=2.0", "trainer.val_episodes=1",
                 "--k", "0", "--no-baselines"]) == 0


def test_the_json_report_is_strict_json_when_a_rate_is_undefined(tmp_path, capsys):
    """``--k 0`` runs no sampled episodes, so a rate over them is undefined: null in the file, not ``NaN`` (which
    ``json.dumps`` writes by default and strict parsers, JavaScript's among them, reject)."""
    out = tmp_path / "report.json"
    assert main(["eval", "tiny", "frozenlake_slippery_study", "trainer.val_episodes=2", "--k", "0", "--json", str(out)]) == 0

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    report = json.loads(out.read_text(), parse_constant=refuse)
    assert report["episodes"] == 2
    table = capsys.readouterr().out  # no sampled row, so no legend for one
    assert "success: greedy decoding, with its 95 % Wilson interval; valid = format-valid turn rate." in table and "model sampled row" not in table


def test_strict_json_replaces_non_finite_floats_at_any_depth():
    from ragen.files import strict_json

    value = {"a": float("nan"), "b": [1.0, float("inf"), {"c": -float("inf")}], "d": (2, "x"), "e": None}
    assert strict_json(value) == {"a": None, "b": [1.0, None, {"c": None}], "d": [2, "x"], "e": None}
