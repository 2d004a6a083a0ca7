"""Real tiny-model SFT runs through the CLI: the loss falls, run dirs load as models, LoRA merges exactly, resume is exact."""

import json

import pytest
import torch
from safetensors.torch import load_file

from ragen.cli import main
from ragen.models import load_model

FAST = ["model=tiny", "trainer.progress_bar=false", "trainer.batch_size=4", "trainer.micro_batch_size=2"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    # Bandit answers are short: the LM head over a 49k vocabulary is most of a tiny model's cost.
    path = tmp_path_factory.mktemp("sft") / "bandit.jsonl"
    assert main(["sft", "generate", "bandit", "--n", "12", "--out", str(path)]) == 0
    return path


def metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_full_finetune_lowers_the_loss_and_rl_continues_from_it(data, tmp_path):
    run = tmp_path / "sft"
    assert main(["sft", "train", str(data), *FAST, "trainer.max_steps=8", "optim.lr=1e-2", "optim.warmup_steps=0",
                 "trainer.save_freq=4", f"trainer.output_dir={run}"]) == 0
    lines = metrics(run)
    assert [line["step"] for line in lines] == list(range(9))
    before, after = lines[0]["eval/loss"], lines[-1]["eval/loss"]
    assert after < 0.7 * before, (before, after)  # random init: ~ln(49152) = 10.8 nats per token
    assert lines[-1]["train/loss"] < lines[1]["train/loss"]
    assert all(line["train/tokens"] > 0 and line["train/grad_norm"] > 0 for line in lines[1:])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_conversations"] == 1 and summary["train_conversations"] == 11
    assert (run / "checkpoints" / "step_000008" / "COMPLETE").is_file()
    assert (run / "final" / "config.json").is_file() and (run / "final" / "tokenizer.json").is_file()
    assert "model: tiny" in (run / "config.yaml").read_text()

    # RL continues from the SFT result: `ragen train ... model=SFT_RUN_DIR`.
    model, _ = load_model(str(run))
    trained = load_file(run / "final" / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(model.state_dict()[name], trained[name])
    rl = tmp_path / "rl"
    assert main(["train", "bandit", f"model={run}", "trainer.total_steps=1", f"trainer.output_dir={rl}",
                 "rollout.env_groups=1", "rollout.group_size=2", "rollout.max_new_tokens=8",
                 "trainer.val_episodes=1", "trainer.progress_bar=false", "trainer.plot=false"]) == 0
    assert (rl / "final" / "model.safetensors").is_file()


def test_lora_merge_gives_the_adapter_model_logits(data, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "lora"
    assert main(["sft", "train", str(data), *FAST, "trainer.max_steps=3", "lora.rank=8", "lora.alpha=16",
                 "optim.lr=1e-2", "optim.warmup_steps=0", f"trainer.output_dir={run}"]) == 0
    adapter = json.loads((run / "final" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "tiny"
    out = tmp_path / "merged"
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert main(["sft", "merge", str(run), "--out", str(busy)]) == 2  # a directory with files: refused, kept
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]
    assert main(["sft", "merge", str(run), "--out", str(out)]) == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left behind

    merged = AutoModelForCausalLM.from_pretrained(out).eval()  # transformers alone, no ragen, no peft
    tokenizer = AutoTokenizer.from_pretrained(out)
    base, _ = load_model("tiny")
    base_logits_model, _ = load_model("tiny")
    with_adapter = PeftModel.from_pretrained(base, run / "final").eval()  # unmerged: base + B A on the fly
    ids = tokenizer("<think>The box is 1 row below the target.</think><answer>Up</answer>", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = with_adapter(ids).logits  # (1, L, V)
        got = merged(ids).logits
        untouched = base_logits_model(ids).logits
    assert (expected - untouched).abs().max() > 1e-3  # the adapter really changes the model ...
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)  # ... and the merge keeps that change exactly
    # The run dir itself loads as a model (adapter merged on its base on the fly).
    model, _ = load_model(str(run))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-4, rtol=1e-4)
    # ... as a plain model: every weight trainable, as from_pretrained gives it (peft's merge leaves them frozen),
    # so a full fine-tune continues from a LoRA run: RL and SFT alike.
    assert all(p.requires_grad for p in model.parameters())
    rl = tmp_path / "rl"
    assert main(["train", "bandit", f"model={run}", "trainer.total_steps=1", f"trainer.output_dir={rl}",
                 "rollout.env_groups=1", "rollout.group_size=2", "rollout.max_new_tokens=8",
                 "trainer.val_episodes=1", "trainer.progress_bar=false", "trainer.plot=false"]) == 0
    assert (rl / "final" / "model.safetensors").is_file() and not (rl / "final" / "adapter_config.json").exists()
    assert main(["sft", "train", str(data), *FAST, f"model={run}", "trainer.max_steps=1",
                 f"trainer.output_dir={tmp_path / 'sft_again'}"]) == 0


def test_resume_continues_exactly(data, tmp_path):
    common = [str(data), *FAST, "trainer.precision=fp32", "optim.schedule=constant", "optim.warmup_steps=1",
              "optim.lr=1e-3", "trainer.save_freq=2"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["sft", "train", *common, "trainer.max_steps=4", f"trainer.output_dir={straight}"]) == 0
    assert main(["sft", "train", *common, "trainer.max_steps=2", f"trainer.output_dir={split}"]) == 0
    assert main(["sft", "train", "--resume", str(split), "trainer.max_steps=4"]) == 0
    a = load_file(straight / "final" / "model.safetensors")
    b = load_file(split / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [line["step"] for line in metrics(split)] == [0, 1, 2, 3, 4]
    losses = lambda run: [line["train/loss"] for line in metrics(run)[1:]]  # noqa: E731
    assert losses(split) == losses(straight)


def test_the_micro_batch_size_changes_only_rounding_so_resume_accepts_it(tmp_path, monkeypatch):
    """Each micro-batch's summed NLL is divided by the whole batch's token count, so conversations of different
    lengths in one pass or in several give the same gradient (fp32 rounding). The usual fix after an OOM kill, a
    smaller ``trainer.micro_batch_size``, is therefore allowed on ``--resume`` without ``--force``."""
    from ragen.sft.config import load_sft_config
    from ragen.sft.generate import write_jsonl
    from ragen.sft.trainer import SFTTrainer

    replies = ["<answer>A</answer>", "<answer>the long way round, then A</answer>", "<answer>B B B B B B B B</answer>", "x"]
    data = tmp_path / "uneven.jsonl"
    write_jsonl([{"messages": [{"role": "user", "content": f"Pick {i}."}, {"role": "assistant", "content": r}]}
                 for i, r in enumerate(replies * 2)], data)
    grads = {}
    real_clip = torch.nn.utils.clip_grad_norm_

    def record(params, max_norm):  # the accumulated gradient, before clipping
        grads[size] = [p.grad.clone() for p in params]
        return real_clip(params, max_norm)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", record)
    losses = {}
    # by rows (4, 3, 1 a pass), and by a token budget of 40 padded tokens (the longest chat exceeds it: alone, and
    # checkpointed by gradient_checkpointing=auto)
    cuts = {4: ["trainer.micro_batch_size=4"], 3: ["trainer.micro_batch_size=3"], 1: ["trainer.micro_batch_size=1"],
            "tokens": ["trainer.micro_batch_size=4", "trainer.max_tokens_per_micro_batch=40"]}
    for size, cut in cuts.items():
        config = load_sft_config(None, [f"data.path={data}", *FAST, "trainer.precision=fp32", *cut,
                                        f"trainer.output_dir={tmp_path / str(size)}"])
        trainer = SFTTrainer(config)
        batch = trainer.data.train[:4]
        assert len({e.num_trained for e in batch}) > 2  # uneven: a per-micro-batch mean would weigh tokens differently
        losses[size] = trainer.optimizer_step(batch)["train/loss"]
        if size == "tokens":
            assert max(len(e) for e in batch) > 40 and trainer.checkpointing.on
            assert len(trainer.micro_batches(sorted(batch, key=len))) > 1
    for size in (3, 1, "tokens"):
        assert losses[size] == pytest.approx(losses[4], rel=1e-6)
        for got, whole in zip(grads[size], grads[4]):
            assert (got - whole).norm() <= 1e-5 * whole.norm() + 1e-12
    # resume with a smaller micro-batch: accepted without --force
    run = tmp_path / "run"
    common = [str(data), *FAST, "trainer.save_freq=1", "trainer.save_final=false", f"trainer.output_dir={run}"]
    assert main(["sft", "train", *common, "trainer.max_steps=1"]) == 0
    assert main(["sft", "train", "--resume", str(run), "trainer.max_steps=2", "trainer.micro_batch_size=1"]) == 0
    assert [m["step"] for m in metrics(run)] == [0, 1, 2]


@pytest.mark.parametrize("args,key", [
    (["trainer.nope=1"], "trainer.nope"),
    (["trainer.max_steps=abc"], "trainer.max_steps"),
    (["data.eval_fraction=2"], "data.eval_fraction"),
    (["optim.schedule=linear"], "optim.schedule"),
])
def test_bad_train_config_is_one_line_and_exit_2(data, args, key, capsys, tmp_path):
    assert main(["sft", "train", str(data), "model=tiny", f"trainer.output_dir={tmp_path}", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err and err.startswith("ragen: error:")
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("argv,needle", [
    (["sft", "train", "missing.jsonl", "model=tiny"], "data.path"),
    (["sft", "generate", "sokoban", "agent.bogus=1", "--out", "x.jsonl"], "agent.bogus"),
    (["sft", "generate", "sokoban", "--n", "0", "--out", "x.jsonl"], "--n"),
    (["sft", "merge", "tiny", "--out", "merged"], "not a"),
])
def test_other_mistakes_exit_2(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err
    assert not (tmp_path / "x.jsonl").exists()


def test_relative_paths_are_recorded_absolute_so_a_run_loads_from_any_directory(data, tmp_path, monkeypatch):
    from ragen.config import load_config

    model, tokenizer = load_model("tiny")
    work = tmp_path / "work"
    (work / "base").mkdir(parents=True)
    model.save_pretrained(work / "base")
    tokenizer.save_pretrained(work / "base")
    (work / "demos.jsonl").write_bytes(data.read_bytes())
    monkeypatch.chdir(work)
    assert main(["sft", "train", "demos.jsonl", *FAST[1:], "model=base", "trainer.max_steps=2", "trainer.save_freq=2", "lora.rank=4",
                 "trainer.output_dir=runs/lora"]) == 0
    run = work / "runs" / "lora"
    recorded = (run / "config.yaml").read_text()
    assert f"model: {work / 'base'}" in recorded and f"path: {work / 'demos.jsonl'}" in recorded
    assert json.loads((run / "final" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(work / "base")
    assert load_config("bandit", ["model=base"]).model == str(work / "base")
    assert load_config("bandit", ["model=tiny"]).model == "tiny"  # built-in names stay names
    assert load_config("bandit", ["model=tyni"]).model == "tyni"  # a path that does not exist: its error names it as typed
    here, _ = load_model(str(run))

    # elsewhere: a directory of the same name holding another model must not be picked up
    other = tmp_path / "other"
    (other / "base").mkdir(parents=True)
    load_model("tiny", seed=1)[0].save_pretrained(other / "base")
    tokenizer.save_pretrained(other / "base")
    monkeypatch.chdir(other)
    there, _ = load_model(str(run))
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(here(ids).logits, there(ids).logits)
    assert main(["sft", "train", "--resume", str(run), "trainer.max_steps=3"]) == 0  # data.path found from here too


def test_resume_refuses_a_data_file_rewritten_in_place_unless_forced(data, tmp_path, capsys):
    demos = tmp_path / "demos.jsonl"
    demos.write_bytes(data.read_bytes())
    run = tmp_path / "run"
    assert main(["sft", "train", str(demos), *FAST, "trainer.max_steps=2", "trainer.save_freq=2",
                 f"trainer.output_dir={run}"]) == 0
    lines = demos.read_text().splitlines()
    demos.write_text("\n".join(lines[:-1]) + "\n")  # one conversation fewer, same path
    before = (run / "metrics.jsonl").read_text(), (run / "config.yaml").read_text()
    capsys.readouterr()
    assert main(["sft", "train", "--resume", str(run), "trainer.max_steps=3", "--print-config"]) == 2  # checked there too
    assert main(["sft", "train", "--resume", str(run), "trainer.max_steps=3"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0] == err[1]
    assert f"--resume: {demos} changed since step_000002 was written" in err[1] and "pass --force" in err[1]
    assert ((run / "metrics.jsonl").read_text(), (run / "config.yaml").read_text()) == before  # nothing touched
    assert main(["sft", "train", "--resume", str(run), "--force", "trainer.max_steps=3"]) == 0
    assert [line["step"] for line in metrics(run)] == [0, 1, 2, 3]
