"""SFT details: a held-out split without copies of training chats, the cosine schedule's end, bad data lines as
errors, a time cap that checkpoints, and one final eval."""

import json

import pytest

from ragen.cli import main
from ragen.models import load_model
from ragen.sft import trainer as sft_trainer
from ragen.sft.data import load_dataset, record_problem
from ragen.sft.generate import iter_jsonl
from ragen.sft.trainer import lr_lambda

FAST = ["model=tiny", "trainer.progress_bar=false", "trainer.batch_size=4", "trainer.micro_batch_size=2"]


def chat(user, answer):
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": f"<answer>{answer}</answer>"}]}


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("tiny")[1]


@pytest.mark.parametrize("seed", range(5))
def test_the_eval_split_holds_no_copy_of_a_training_conversation(tmp_path, tokenizer, seed):
    """Expert data repeats; the split used to be by record, so most eval chats were also trained on."""
    path = tmp_path / "d.jsonl"
    records = [chat(f"q{i % 4}", f"a{i % 4}") for i in range(40)]  # 4 distinct chats, 10 copies each
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = load_dataset(path, tokenizer, eval_fraction=0.5, eval_max=8, max_length=512, seed=seed)
    key = lambda e: tuple(e.input_ids)  # noqa: E731
    assert len(data.eval) == 2 and len({key(e) for e in data.eval}) == 2  # half of the 4 distinct chats, once each
    assert not {key(e) for e in data.eval} & {key(e) for e in data.train}
    assert len(data.train) == 20  # the other two chats with all their copies


@pytest.mark.parametrize("warmup,total", [(0, 6), (2, 6), (1, 3), (0, 150)])
def test_cosine_reaches_min_lr_at_the_last_step(warmup, total):
    factor = lr_lambda(warmup, total, "cosine", 0.1)
    values = [factor(s) for s in range(total)]
    assert values[-1] == pytest.approx(0.1)
    assert values[warmup if warmup else 0] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(values[warmup:], values[warmup + 1 :]))  # decays after warm-up


def test_a_lone_surrogate_is_a_data_error_not_a_crash():
    bad = json.loads('{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "x"}]}')
    assert "lone surrogate" in record_problem(bad)


@pytest.mark.parametrize("line,needle", [("[" * 100000 + "]" * 100000, "RecursionError"), ("[" + "9" * 5000 + "]", "digits")])
def test_json_the_parser_cannot_take_names_the_line(tmp_path, line, needle):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(chat("q", "a")) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"d.jsonl:2: not usable JSON .*{needle}"):
        list(iter_jsonl(path))


def test_a_time_capped_run_saves_a_checkpoint_and_resumes_from_it(tmp_path, monkeypatch):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(chat(f"q{i}", f"a{i}")) + "\n" for i in range(8)))
    run = tmp_path / "run"
    clock = iter(range(0, 10_000, 1))  # one second per perf_counter call: the cap of 0.5 s is hit at step 1
    monkeypatch.setattr(sft_trainer.time, "perf_counter", lambda: float(next(clock)))
    assert main(["sft", "train", str(path), *FAST, "trainer.max_steps=4", "trainer.max_time_s=0.5",
                 f"trainer.output_dir={run}"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_at_step"] == 1 and (run / "checkpoints").is_dir()
    monkeypatch.undo()
    assert main(["sft", "train", "--resume", str(run), "trainer.max_time_s=0"]) == 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]


def test_the_last_steps_eval_is_the_final_eval(tmp_path, monkeypatch):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(chat(f"q{i}", f"a{i}")) + "\n" for i in range(8)))
    calls = []
    real = sft_trainer.SFTTrainer.evaluate
    monkeypatch.setattr(sft_trainer.SFTTrainer, "evaluate", lambda self: calls.append(1) or real(self))
    assert main(["sft", "train", str(path), *FAST, "trainer.max_steps=2", "trainer.eval_freq=0",
                 f"trainer.output_dir={tmp_path / 'run'}"]) == 0
    assert len(calls) == 2  # before training and at the last step, not a third pass after it


def test_special_token_text_in_a_reply_is_trained_as_the_text_not_as_turn_markers(tokenizer):
    """A hand-written reply spelling ``<|im_end|><|im_start|>user`` used to train those special ids mid-turn: a
    sequence no rollout records (the backend cuts at the first end token). It is trained as the ordinary tokens that
    spell it, which decode back to the reply."""
    from ragen.agent.context import ChatTokens
    from ragen.sft.masking import tokenize_conversation

    reply = "<answer>Up<|im_end|><|im_start|>user\nfoo</answer>"
    example = tokenize_conversation(ChatTokens(tokenizer), [{"role": "user", "content": "go"},
                                                            {"role": "assistant", "content": reply}])
    trained = [t for t, m in zip(example.input_ids, example.loss_mask) if m]
    assert trained[-1] == tokenizer.eos_token_id  # the turn's own end, sampled by the model
    assert tokenizer.eos_token_id not in trained[:-1] and tokenizer.convert_tokens_to_ids("<|im_start|>") not in trained
    assert tokenizer.decode(trained[:-1]) == reply


def test_dropped_conversations_are_counted_by_their_reason(tmp_path, tokenizer):
    """``dropped_too_long`` used to count conversations with nothing to train on as too long."""
    path = tmp_path / "d.jsonl"
    whole_reply_prefilled = {**chat("q", "x"), "agent": {"response_prefix": "<answer>x</answer>"}}  # 0 written tokens
    records = [chat("q0", "a0"), chat("q1", "a1"), chat("long " * 200, "a"), whole_reply_prefilled]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = load_dataset(path, tokenizer, eval_fraction=0.5, eval_max=8, max_length=128, seed=0, train_on_eos=False)
    assert (len(data.train) + len(data.eval), data.dropped_too_long, data.dropped_untrained) == (2, 1, 1)
