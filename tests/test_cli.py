"""The ``ragen`` command: config errors exit 2 naming the key; ``ragen envs`` lists envs."""

import subprocess
import sys

import pytest

from ragen.cli import main
from ragen.config import ConfigError, load_config


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.bogus=1", "config key 'trainer.bogus'"),
        ("trainer.total_steps=abc", "config key 'trainer.total_steps'"),
        ("nonsense=1", "config key 'nonsense'"),
        ("rollout.group_size=0", "config key 'rollout.group_size': must be >= 1"),
        ("rollout.reuse_kv_max_gb=0", "config key 'rollout.reuse_kv_max_gb': must be > 0"),
        ("rollout.max_episodes_in_flight=-1", "config key 'rollout.max_episodes_in_flight': must be >= 0"),
        ("trainer.precision=fp8", "config key 'trainer.precision'"),
        ("notakeyvalue", "is not key=value"),
    ],
)
def test_bad_config_exits_2_naming_the_key(override, message, capsys):
    assert main(["train", "bandit", "model=tiny", override]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bad_env_config_and_model_path_exit_2(capsys, tmp_path):
    assert main(["train", "bandit", "model=tiny", "env.config.arms=3", f"trainer.output_dir={tmp_path/'a'}"]) == 2
    assert "unknown config key 'arms'" in capsys.readouterr().err
    assert main(["train", "bandit", f"model={tmp_path}", f"trainer.output_dir={tmp_path/'b'}"]) == 2
    assert "is not a model" in capsys.readouterr().err


def test_presets_and_overrides_layer():
    config = load_config("bandit", ["trainer.total_steps=3", "optim.lr=1e-5"])
    assert config.env.name == "bandit" and config.trainer.total_steps == 3 and config.optim.lr == 1e-5
    assert load_config("sokoban").env.name == "sokoban"
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("missing.yaml")


def test_ragen_envs_lists_builtin_envs():
    out = subprocess.run([sys.executable, "-m", "ragen", "envs"], capture_output=True, text=True, check=True).stdout
    assert "bandit" in out and "sokoban" in out and "max_steps" in out


def test_overrides_may_follow_options(tmp_path, capsys):
    """``ragen sft generate ENV --n N --out F key=value``: the override after the options still applies."""
    import json

    out = tmp_path / "think.jsonl"
    assert main(["sft", "generate", "bandit", "--n", "2", "--out", str(out), "agent.enable_think=true",
                 "agent.response_prefix=<think>"]) == 0
    replies = [m["content"] for line in out.read_text().splitlines() for m in json.loads(line)["messages"]
               if m["role"] == "assistant"]
    assert replies and all("</think><answer>" in r for r in replies), replies  # the bandit preset alone: no think
    with pytest.raises(SystemExit) as exit_info:  # a stray option still fails the argparse way
        main(["sft", "generate", "bandit", "--n", "2", "--out", str(out), "--bogus"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # and so does a non key=value word
        main(["sft", "generate", "bandit", "--n", "2", "--out", str(out), "stray"])
