"""trainer.device: resolving it, refusing bad values, and every stage running with the model on that device.

The device-parametrised tests run on ``cpu`` everywhere and on ``cuda`` when asked for on a
machine with a GPU (``RAGEN_TEST_CUDA=1 pytest tests/train/test_device.py``; the rest of the
suite is pinned to the CPU by ``tests/conftest.py``): the same code path, checked against a CPU
reference computed in the same test or by where every tensor lives.
"""

import contextlib
import copy
import json

import pytest
import torch

from ragen.agent import AgentConfig, Rollout
from ragen.cli import main
from ragen.config import ConfigError, load_config
from ragen.envs import make
from ragen.models import HFBackend, SamplingParams
from ragen.models import device as dev
from ragen.models import precision as prec
from safetensors.torch import load_file

from ragen.sft.config import load_sft_config
from ragen.train.batch import TrainBatch
from ragen.train.logprobs import policy_forward
from ragen.train.trainer import StarPOTrainer
from ragen.train.update_targets import UpdateTargets

from tests.train.trajectories import shared_prompt_trajectories

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not CUDA, reason="no CUDA GPU visible (on a GPU machine: RAGEN_TEST_CUDA=1 pytest tests/train/test_device.py)"))]
FAST = ["model=tiny", "trainer.progress_bar=false", "trainer.val_episodes=2", "rollout.env_groups=2",
        "rollout.group_size=2", "rollout.max_new_tokens=8"]


# -- resolving the spec ----------------------------------------------------------------------


def fake_gpus(monkeypatch, count: int) -> list[int]:
    """Pretend ``count`` GPUs are visible; returns the list ``set_device`` calls are recorded in."""
    current = []
    monkeypatch.setattr(dev.torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(dev.torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(dev.torch.cuda, "set_device", current.append)
    return current


def test_auto_is_the_cpu_without_cuda(monkeypatch):
    fake_gpus(monkeypatch, 0)
    assert dev.resolve_device("auto") == torch.device("cpu")
    assert dev.resolve_device("cpu") == torch.device("cpu")


def test_auto_and_cuda_take_the_local_rank_gpu(monkeypatch):
    current = fake_gpus(monkeypatch, 4)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert dev.resolve_device("auto") == torch.device("cuda", 0)
    assert dev.resolve_device("cuda:1") == torch.device("cuda", 1)  # an explicit index, one process
    assert current == [0, 1]  # each CUDA result became the current device
    monkeypatch.setenv("LOCAL_RANK", "3")  # torchrun's fourth process on this node
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert dev.resolve_device("auto") == torch.device("cuda", 3)
    assert dev.resolve_device("cuda") == torch.device("cuda", 3)
    assert dev.resolve_device("cpu") == torch.device("cpu")  # and cpu stays cpu with GPUs around
    with pytest.raises(ValueError, match=r"'trainer.device'.*every torchrun rank on the same GPU"):
        dev.resolve_device("cuda:1")


def test_missing_or_too_few_gpus_are_named(monkeypatch):
    fake_gpus(monkeypatch, 0)
    with pytest.raises(ValueError, match=r"'trainer.device'.*no CUDA GPU"):
        dev.resolve_device("cuda")
    fake_gpus(monkeypatch, 2)
    with pytest.raises(ValueError, match=r"'trainer.device'.*cuda:2.*only 2 CUDA GPU"):
        dev.resolve_device("cuda:2")


@pytest.mark.parametrize("spec", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda:0:1", "mps", "", "cpu\n", " cpu"])
def test_malformed_specs_are_refused(spec):
    assert dev.check_device_spec(spec) is not None
    with pytest.raises(ValueError, match="trainer.device"):
        dev.resolve_device(spec)


def test_config_refuses_a_malformed_device_naming_the_key():
    with pytest.raises(ConfigError, match="trainer.device"):
        load_config("bandit", ["trainer.device=gpu"])
    assert load_config("bandit", ["trainer.device=cuda:1"]).trainer.device == "cuda:1"  # form only: no GPU check here


def test_sft_config_refuses_a_malformed_device(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    with pytest.raises(ConfigError, match="trainer.device"):
        load_sft_config(None, [f"data.path={data}", "trainer.device=tpu"])


@pytest.mark.skipif(CUDA, reason="needs a machine without CUDA")
def test_train_with_cuda_on_a_cpu_machine_exits_2_naming_the_key(tmp_path, capsys):
    assert main(["train", "bandit", *FAST, "trainer.device=cuda", f"trainer.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trainer.device" in err[0] and "no CUDA GPU" in err[0], err
    assert main(["train", "bandit", *FAST, "trainer.device=gpu", f"trainer.output_dir={tmp_path}/b"]) == 2


def test_auto_precision_judges_the_device_the_run_uses(monkeypatch):
    """A visible bf16 GPU must not make a ``trainer.device=cpu`` run use bf16 on a CPU without it."""
    monkeypatch.setattr(prec.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(prec, "gpu_has_native_bf16", lambda device="auto": True)
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: False)
    assert prec.resolve_precision("auto", "auto") == "bf16"
    assert prec.resolve_precision("auto", "cuda:0") == "bf16"
    assert prec.resolve_precision("auto", "cpu") == "fp32"
    assert load_config("bandit", ["trainer.device=cpu"]).trainer.precision == "fp32"


def test_gpus_that_only_emulate_bf16_get_fp32(monkeypatch):
    """``is_bf16_supported()`` says yes on pre-Ampere GPUs (emulation); auto must ask for native support."""
    asked = []

    def supported(including_emulation=True):
        asked.append(including_emulation)
        return including_emulation  # an emulating GPU: yes with emulation, no without

    monkeypatch.setattr(prec.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(prec.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(prec.torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(prec.torch.cuda, "is_bf16_supported", supported)
    assert prec.resolve_precision("auto", "cuda:1") == "fp32" and asked == [False]


# -- tensors follow the model ----------------------------------------------------------------


def test_batches_and_targets_move_every_tensor():
    B, L = 2, 5
    batch = TrainBatch(
        input_ids=torch.zeros(B, L, dtype=torch.long), attention_mask=torch.ones(B, L, dtype=torch.long),
        response_mask=torch.ones(B, L - 1), token_rewards=torch.zeros(B, L - 1), turn_rewards=torch.zeros(B, L - 1),
        turn_ends=torch.zeros(B, L - 1, dtype=torch.bool), group_ids=torch.zeros(B, dtype=torch.long),
        scores=torch.zeros(B), anchor_ids=torch.zeros(B, L - 1, dtype=torch.long), step_returns=torch.zeros(B, L - 1),
    )
    moved = batch.to(torch.device("meta"))  # shapes only: any field left behind stays on cpu
    assert {k: v.device.type for k, v in moved.__dict__.items()} == {k: "meta" for k in batch.__dict__}
    targets = UpdateTargets(advantages=torch.zeros(B, L - 1), returns=torch.zeros(B, L - 1), old_values=torch.zeros(B, L - 1))
    moved_targets = targets.to(torch.device("meta"))
    assert moved_targets.advantages.is_meta and moved_targets.returns.is_meta and moved_targets.old_values.is_meta
    assert moved_targets.old_logprobs is None and moved_targets.ref_logprobs is None


def shared_prompt_batch(pad_id: int):
    """Two groups of two rows: rows of a group share their prompt, answers of different lengths, right-padded."""
    torch.manual_seed(0)
    prompts = [torch.randint(10, 1000, (n,)).tolist() for n in (9, 6)]
    answers = [torch.randint(10, 1000, (n,)).tolist() for n in (3, 5, 4, 2)]
    rows = [prompts[i // 2] + a for i, a in enumerate(answers)]
    L = max(map(len, rows))
    ids = torch.full((4, L), pad_id, dtype=torch.long)
    mask = torch.zeros((4, L), dtype=torch.long)
    response = torch.zeros((4, L - 1))
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
        mask[r, : len(row)] = 1
        p = len(prompts[r // 2])
        response[r, p - 1 : len(row) - 1] = 1
    return ids, mask, response


@pytest.mark.parametrize("device", DEVICES)
def test_policy_forward_on_the_device_equals_the_cpu_reference(tiny, device):
    model, tokenizer = tiny
    ids, mask, response = shared_prompt_batch(tokenizer.pad_token_id)
    plens = response.argmax(1) + 1
    reference = policy_forward(model, ids, mask, response, with_entropy=True, prompt_lengths=plens)
    on_device = copy.deepcopy(model).to(device)
    d = torch.device(device)
    for shared in (plens.to(d), None):
        out = policy_forward(on_device, ids.to(d), mask.to(d), response.to(d), with_entropy=True, prompt_lengths=shared)
        assert out.logprobs.device.type == device
        torch.testing.assert_close(out.logprobs.cpu(), reference.logprobs, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.entropy.cpu(), reference.entropy, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_multi_turn_rollout_on_the_device_plays_the_cpu_tokens(tiny, device):
    """Shared-prompt prefill, kept KV caches resumed over 3 turns, stop strings: same greedy tokens as on the CPU."""
    model, tokenizer = tiny
    settings = AgentConfig(max_turn=3, max_actions_per_turn=2)
    sampling = SamplingParams(max_new_tokens=12, do_sample=False, stop=("</answer>",))

    def play(m):
        backend = HFBackend(m, tokenizer, precision="fp32", reuse_kv=True)
        trajs = Rollout(backend, tokenizer, settings, sampling).run(
            [make("sokoban") for _ in range(4)], [5, 5, 6, 6], [0, 0, 1, 1], "sokoban")
        return trajs, backend

    cpu_trajs, _ = play(model)
    dev_trajs, backend = play(copy.deepcopy(model).to(device))
    assert backend.device.type == device
    assert backend.stats.reused_tokens > 0  # turns 2-3 resumed kept caches on the device
    assert [t.input_ids for t in dev_trajs] == [t.input_ids for t in cpu_trajs]


@pytest.mark.parametrize("device", DEVICES)
def test_every_trained_tensor_lives_on_the_device(tmp_path, device):
    """Policy, LoRA adapters, critic, KL reference and AdamW state on the device after a real update."""
    for extra in (["algorithm.adv_estimator=gae", "algorithm.use_kl_loss=true"], ["lora.rank=4", "algorithm.use_kl_loss=true"]):
        config = load_config("bandit", ["model=tiny", "trainer.val_episodes=1", f"trainer.device={device}",
                                        f"trainer.output_dir={tmp_path / extra[0]}", *extra])
        trainer = StarPOTrainer(config)
        metrics = trainer.update(shared_prompt_trajectories(trainer.tokenizer))
        assert metrics["actor/grad_norm"] > 0
        tensors = list(trainer.model.parameters()) + [s for st in trainer.optimizer.state.values()
                                                      for k, s in st.items() if k != "step"]
        if trainer.value_head is not None:
            tensors += list(trainer.value_head.parameters())
        if trainer.ref_model is not None:
            tensors += list(trainer.ref_model.parameters())
        assert trainer.optimizer.state and {t.device.type for t in tensors} == {device}


@pytest.mark.parametrize("device", DEVICES)
def test_train_checkpoint_resume_and_sft_on_the_device(tmp_path, device):
    """PPO with a critic and a KL reference (every model-side tensor of the update), checkpoints, resume, SFT."""
    run = tmp_path / "rl"
    args = ["train", "bandit", *FAST, f"trainer.device={device}", "algorithm.adv_estimator=gae",
            "algorithm.use_kl_loss=true", "trainer.save_freq=1", f"trainer.output_dir={run}"]
    assert main([*args, "trainer.total_steps=2"]) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert all(line["actor/grad_norm"] > 0 and "critic/explained_variance" in line for line in lines[1:])
    assert (run / "checkpoints" / "step_000002" / "COMPLETE").is_file() and (run / "final" / "model.safetensors").is_file()
    rng = load_file(run / "checkpoints" / "step_000002" / "rng.safetensors")
    assert ("torch_cuda_0" in rng) == (device == "cuda")  # GPU sampling's generator is saved too
    assert main(["train", "--resume", str(run), "trainer.total_steps=3"]) == 0
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]

    data = tmp_path / "bandit.jsonl"
    assert main(["sft", "generate", "bandit", "--n", "6", "--out", str(data)]) == 0
    sft = tmp_path / "sft"
    assert main(["sft", "train", str(data), "model=tiny", "trainer.progress_bar=false", "trainer.batch_size=4",
                 "trainer.micro_batch_size=2", "trainer.max_steps=3", "optim.lr=1e-2", "optim.warmup_steps=0",
                 f"trainer.device={device}", f"trainer.output_dir={sft}"]) == 0
    sft_lines = [json.loads(line) for line in (sft / "metrics.jsonl").read_text().splitlines()]
    assert sft_lines[-1]["eval/loss"] < sft_lines[0]["eval/loss"]
