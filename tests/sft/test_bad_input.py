"""Bad input to `ragen sft` is one `ragen: error:` line, exit 2, and loses nothing: no output
file, run config or user file is emptied or overwritten by a command that then fails."""

import json

import pytest

from ragen.cli import main
from ragen.config import ConfigError, load_config, to_yaml
from ragen.sft.config import load_sft_config
from ragen.sft.generate import write_jsonl

FAST = ["model=tiny", "trainer.progress_bar=false", "trainer.batch_size=4", "trainer.micro_batch_size=2",
        "trainer.precision=fp32", "optim.warmup_steps=0"]
GOOD = {"messages": [{"role": "user", "content": "Pick an arm."}, {"role": "assistant", "content": "<answer>A</answer>"}],
        "agent": {"response_prefix": ""}}


def one_error_line(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ragen: error:"), err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def no_temp_files(directory):
    return not [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft_bad") / "bandit.jsonl"
    assert main(["sft", "generate", "bandit", "--n", "6", "--out", str(path)]) == 0
    return path


def fake_run(tmp_path, lines):
    """A `ragen train` run dir (bandit) whose rollouts/step_000001.jsonl holds ``lines`` verbatim."""
    run = tmp_path / "run"
    (run / "rollouts").mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(load_config("bandit")))
    (run / "rollouts" / "step_000001.jsonl").write_text("".join(line + "\n" for line in lines))
    return run


# ---------------------------------------------------------------- 1. generate --out

@pytest.mark.parametrize("argv,needle", [
    (["bandit", "env.config.high_prob=5", "--n", "3"], "high_prob"),
    (["--from-run", "nonexistent_run"], "nonexistent_run"),
])
def test_generate_bad_input_keeps_an_existing_out_file(argv, needle, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.jsonl").write_text("precious\n")
    assert main(["sft", "generate", *argv, "--out", "keep.jsonl"]) == 2
    one_error_line(capsys, needle)
    assert (tmp_path / "keep.jsonl").read_text() == "precious\n"
    assert no_temp_files(tmp_path)


def test_generate_from_run_with_nothing_to_keep_keeps_the_out_file(tmp_path, capsys):
    run = fake_run(tmp_path, [json.dumps({"seed": 1, "success": False, "error": "", "turns": []})])
    out = tmp_path / "keep.jsonl"
    out.write_text("precious\n")
    assert main(["sft", "generate", "--from-run", str(run), "--out", str(out)]) == 2
    one_error_line(capsys, "no successful")
    assert out.read_text() == "precious\n"


@pytest.mark.parametrize("target", ["rollouts/step_000001.jsonl", "config.yaml", "rollouts/sft.jsonl"])
def test_generate_refuses_to_write_over_its_own_input(target, tmp_path, capsys):
    run = fake_run(tmp_path, [json.dumps({"seed": 1, "success": False, "error": "", "turns": []})])
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert main(["sft", "generate", "--from-run", str(run), "--out", str(run / target)]) == 2
    one_error_line(capsys, "--out")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_generate_refuses_its_yaml_config_as_out(tmp_path, capsys):
    config = tmp_path / "bandit.yaml"
    config.write_text(to_yaml(load_config("bandit")))
    text = config.read_text()
    assert main(["sft", "generate", str(config), "--n", "2", "--out", str(config)]) == 2
    one_error_line(capsys, "input")
    assert config.read_text() == text


def test_write_jsonl_failing_midway_leaves_the_old_file(tmp_path):
    out = tmp_path / "data.jsonl"
    out.write_text("old\n")

    def records():
        yield {"a": 1}
        raise ValueError("found late")

    with pytest.raises(ValueError, match="found late"):
        write_jsonl(records(), out)
    assert out.read_text() == "old\n" and no_temp_files(tmp_path)
    assert write_jsonl([{"a": 1}, {"b": 2}], out) == 2
    assert out.read_text() == '{"a": 1}\n{"b": 2}\n' and no_temp_files(tmp_path)


# ---------------------------------------------------------------- 5. --from-run logs

@pytest.mark.parametrize("bad,needle", [
    ("[1]", "not a rollout record: not a JSON object"),
    ("{garbled", "not JSON"),
    ('{"seed": 1, "success": true, "error": "", "turns": [5]}', "turns[0]"),
])
def test_from_run_bad_log_line_names_file_and_line(bad, needle, tmp_path, capsys):
    ok = json.dumps({"seed": 1, "success": False, "error": "", "turns": []})
    run = fake_run(tmp_path, [ok, bad])
    out = tmp_path / "rs.jsonl"
    assert main(["sft", "generate", "--from-run", str(run), "--out", str(out)]) == 2
    one_error_line(capsys, "step_000001.jsonl:2:", needle)
    assert not out.exists()


# ---------------------------------------------------------------- 4. training records

@pytest.mark.parametrize("bad,needle", [
    ({"messages": "hi"}, "'messages' must be a non-empty list"),
    ({"messages": [1, 2]}, "messages[0] is not an object"),
    ({**GOOD, "agent": 5}, "'agent' must be an object"),
    ({**GOOD, "agent": {"response_prefix": 3}}, "agent.response_prefix must be a string"),
    ({"messages": [{"role": "user", "content": ["x"]}]}, "messages[0].content must be a string"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"text": "hi"}, "no 'messages' key"),
    ([1], "not a JSON object"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant message"),
])
def test_bad_training_record_names_file_line_and_problem(bad, needle, tmp_path, capsys):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(bad) + "\n")
    run = tmp_path / "run"
    assert main(["sft", "train", str(path), *FAST, f"trainer.output_dir={run}"]) == 2
    one_error_line(capsys, f"{path}:3:", needle)
    assert not run.exists()


def test_non_utf8_training_data_names_file_and_line(tmp_path, capsys):
    path = tmp_path / "data.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
    assert main(["sft", "train", str(path), *FAST, f"trainer.output_dir={tmp_path / 'run'}"]) == 2
    one_error_line(capsys, f"{path}:2:", "UTF-8")


# ---------------------------------------------------------------- 6. YAML configs

@pytest.mark.parametrize("content,needle", [
    (b"trainer: {max_steps: [1\n", "not valid YAML"),
    (b"\x00\xff\xfe\x80binary", "UTF-8"),
    (b"- 1\n- 2\n", "mapping"),
    (b"5\n", "mapping"),
    (b"trainer:\n  nope: 1\n", "trainer.nope"),
    (b"optim:\n  betas: {a: 1}\n", "a mapping where it has a list"),
])
def test_bad_yaml_config_is_a_config_error_naming_the_file(content, needle, tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=needle) as info:
        load_sft_config(str(path))
    assert str(path) in str(info.value)
    # The same file as a run's saved config: `--resume` exits 2 and leaves it as it was.
    assert main(["sft", "train", "--resume", str(tmp_path)]) == 2
    one_error_line(capsys, str(path), needle)
    assert path.read_bytes() == content


@pytest.mark.parametrize("override,needle", [
    ("optim.betas={a: 1}", "a mapping where it has a list"),
    ("trainer.max_steps=[", "not valid YAML"),
])
def test_bad_override_value_names_the_override(override, needle):
    with pytest.raises(ConfigError, match=needle) as info:
        load_sft_config(None, [override])
    assert override in str(info.value)


# ---------------------------------------------------------------- 2. --resume

@pytest.fixture(scope="module")
def checkpointed_run(data, tmp_path_factory):
    run = tmp_path_factory.mktemp("sft_resume") / "run"
    assert main(["sft", "train", str(data), *FAST, "trainer.max_steps=2", "trainer.save_freq=2",
                 "trainer.save_final=false", f"trainer.output_dir={run}"]) == 0
    return run


def test_resume_refuses_result_changing_overrides_without_force(checkpointed_run, capsys):
    config = (checkpointed_run / "config.yaml").read_bytes()
    metrics = (checkpointed_run / "metrics.jsonl").read_bytes()
    assert main(["sft", "train", "--resume", str(checkpointed_run), "seed=9", "optim.lr=0.3"]) == 2
    one_error_line(capsys, "optim.lr", "seed", "--force")
    assert (checkpointed_run / "config.yaml").read_bytes() == config
    assert (checkpointed_run / "metrics.jsonl").read_bytes() == metrics


def test_resume_with_force_accepts_and_records_the_overrides(checkpointed_run, tmp_path):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(checkpointed_run, run)
    assert main(["sft", "train", "--resume", str(run), "--force", "optim.lr=0.003", "trainer.max_steps=3"]) == 0
    assert "lr: 0.003" in (run / "config.yaml").read_text()
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]


def test_failed_resume_leaves_config_yaml_as_it_was(data, tmp_path, capsys):
    run = tmp_path / "run"  # a run without a checkpoint: resume must fail
    assert main(["sft", "train", str(data), *FAST, "trainer.max_steps=1", "trainer.save_final=false",
                 f"trainer.output_dir={run}"]) == 0
    config = (run / "config.yaml").read_bytes()
    assert main(["sft", "train", "--resume", str(run), "trainer.max_steps=5"]) == 2  # a resume-safe key
    one_error_line(capsys, "checkpoint")
    assert (run / "config.yaml").read_bytes() == config


# ---------------------------------------------------------------- 3. output dir

@pytest.mark.parametrize("name", ["config.yaml", "summary.json", "final", "checkpoints"])
def test_new_run_refuses_a_dir_holding_what_it_would_write(name, data, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    if name in ("final", "checkpoints"):
        (out / name).mkdir()
        (out / name / "weights.bin").write_text("mine")
    else:
        (out / name).write_text("mine")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(["sft", "train", str(data), *FAST, "trainer.max_steps=1", f"trainer.output_dir={out}"]) == 2
    one_error_line(capsys, str(out), name, "another trainer.output_dir")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_new_run_in_a_dir_of_unrelated_files_keeps_them(data, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["sft", "train", str(data), *FAST, "trainer.max_steps=1", "trainer.save_final=false",
                 f"trainer.output_dir={out}"]) == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "summary.json").is_file() and (out / "config.yaml").is_file()
    assert no_temp_files(out)
    # A run that stopped before it logged anything left only its own config.yaml: the same command starts it over.
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    (crashed / "config.yaml").write_text((out / "config.yaml").read_text())
    assert main(["sft", "train", str(data), *FAST, "trainer.max_steps=1", "trainer.save_final=false",
                 f"trainer.output_dir={crashed}"]) == 0
    assert (crashed / "summary.json").is_file()


# ---------------------------------------------------------------- --print-config

def test_print_config_checks_the_run_without_loading_a_model_or_writing(data, tmp_path, capsys, monkeypatch):
    import ragen.models.loading
    import ragen.sft.trainer

    def no_model(*args, **kwargs):
        raise AssertionError("--print-config loaded a model")

    monkeypatch.setattr(ragen.models.loading, "load_model", no_model)
    monkeypatch.setattr(ragen.sft.trainer, "load_model", no_model)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    assert main(["sft", "train", str(data), *FAST, "optim.lr=0.003", f"trainer.output_dir={out}", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # no run dir, no runs/
    (tmp_path / "printed.yaml").write_text(printed)
    assert load_sft_config(str(tmp_path / "printed.yaml")) == load_sft_config(
        None, [f"data.path={data}", *FAST, "optim.lr=0.003", f"trainer.output_dir={out}"])
    # a line that is no conversation, named by FILE:LINE, as the run itself would stop on it
    bad = tmp_path / "bad.jsonl"
    write_jsonl([GOOD, {"messages": []}], bad)
    assert main(["sft", "train", str(bad), *FAST, f"trainer.output_dir={out}", "--print-config"]) == 2
    one_error_line(capsys, f"{bad}:2", "'messages'")
    assert capsys.readouterr().out == ""
    # ... also the conversation's shape, which needs no tokenizer (the run finds it while tokenising)
    write_jsonl([GOOD, {"messages": [{"role": "user", "content": "Pick an arm."}]}], bad)
    assert main(["sft", "train", str(bad), *FAST, f"trainer.output_dir={out}", "--print-config"]) == 2
    one_error_line(capsys, f"{bad}:2", "no assistant message")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "final").mkdir()
    assert main(["sft", "train", str(data), *FAST, f"trainer.output_dir={taken}", "--print-config"]) == 2
    one_error_line(capsys, "already holds final")
