"""Linears on oneDNN-packed bf16 weights under autocast: autocast's outputs, repacked when weights change."""

import copy

import pytest
import torch
import torch.nn.functional as F

from ragen.models import load_model
from ragen.models.backend import HFBackend, SamplingParams
from ragen.models.lora import apply_lora
from ragen.models.packed_gemm import PackedLinears, packable, supported

pytestmark = pytest.mark.skipif(not supported(), reason="no oneDNN bf16 linear on packed weights in this torch/CPU")


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def head_outputs(model):
    seen = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    return seen, handle


@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_equals_autocasts_linear_at_any_row_count(bias):
    torch.manual_seed(0)
    for out_features, in_features in [(576, 576), (192, 576), (1536, 576), (576, 1536), (4096, 576)]:
        linear = torch.nn.Linear(in_features, out_features, bias=bias)
        packs = PackedLinears()
        with packs.session():
            for rows in (1, 3, 16, 64, 300):
                h = torch.randn(2, rows, in_features)
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                    ref = F.linear(h, linear.weight, linear.bias)
                    with packs.active(linear) as switched:
                        out = linear(h)
                assert switched == [linear] and out.dtype == ref.dtype == torch.bfloat16 and out.shape == ref.shape
                torch.testing.assert_close(out, ref, rtol=0, atol=0)
        assert packs.packed_count == 1  # packed once in the session, reused for every row count


@pytest.mark.parametrize("do_sample", [False, True])
def test_generation_gives_the_plain_paths_tokens_and_logits(tiny, do_sample):
    model, tokenizer = tiny
    prompts = [tokenizer(t)["input_ids"] for t in ["The arms are Apple and Stuntman.", "Hi", "Sokoban: push the box."]] * 2
    params = SamplingParams(max_new_tokens=12, do_sample=do_sample, temperature=1.0)
    results = {}
    for packed in (False, True):
        backend = HFBackend(model, tokenizer, precision="bf16", packed_gemm=packed, reuse_kv=False)
        seen, handle = head_outputs(model)
        torch.manual_seed(0)
        try:
            results[packed] = ([g.token_ids for g in backend.generate(prompts, params)], seen)
        finally:
            handle.remove()
        assert (backend.packed.packed_count > 0) is packed
    assert results[True][0] == results[False][0]
    assert len(results[True][1]) == len(results[False][1])
    for a, b in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not any("forward" in vars(m) for m in model.modules())  # restored after the call


def test_packs_last_one_session_and_the_next_rollout_follows_an_optimizer_step(tiny):
    model, tokenizer = copy.deepcopy(tiny[0]), tiny[1]
    prompts = [tokenizer("The arms are Apple and Stuntman.")["input_ids"]] * 2
    params = SamplingParams(max_new_tokens=8, do_sample=False)
    packed, plain = (HFBackend(model, tokenizer, precision="bf16", packed_gemm=p, reuse_kv=False) for p in (True, False))
    linears = sum(1 for m in model.modules() if type(m) is torch.nn.Linear)
    with packed.session():
        packed.generate(prompts, params)
        packed.generate(prompts, params)
    assert packed.packed.packed_count == linears  # one session (a multi-turn rollout): packed once
    packed.generate(prompts, params)
    packed.generate(prompts, params)
    assert packed.packed.packed_count == 3 * linears  # outside a session: per call
    # Fused AdamW (the trainer's) changes the weights in place without bumping their version
    # counters, which is why packs never outlive a session or a call.
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
    before = [p._version for p in model.parameters()]
    ids = torch.tensor(prompts)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert [p._version for p in model.parameters()] == before
    seen, handle = head_outputs(model)
    try:
        with packed.session():
            after_packed = [g.token_ids for g in packed.generate(prompts, params)]
        n = len(seen)
        after_plain = [g.token_ids for g in plain.generate(prompts, params)]
    finally:
        handle.remove()
    assert after_packed == after_plain
    assert len(seen) == 2 * n
    for a, b in zip(seen[:n], seen[n:]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_rollout_packs_once_for_all_its_turns(tiny):
    import ragen.envs
    from ragen.agent import Rollout
    from ragen.agent.rollout import AgentSettings

    model, tokenizer = tiny
    backend = HFBackend(model, tokenizer, precision="bf16")
    settings = AgentSettings(max_turn=3, enable_think=False)
    envs = [ragen.envs.make("frozen_lake", size=4, is_slippery=False) for _ in range(2)]
    trajs = Rollout(backend, tokenizer, settings, SamplingParams(max_new_tokens=6, do_sample=False)).run(
        envs, [0, 1], [0, 1], "frozen_lake")
    assert max(len(t.turns) for t in trajs) >= 2  # several generate calls
    assert backend.packed.packed_count == sum(1 for m in model.modules() if type(m) is torch.nn.Linear)


def test_only_plain_linears_under_bf16_autocast_without_grad_are_switched(tiny):
    model = tiny[0]
    packs = PackedLinears()
    plain = sum(1 for m in model.modules() if type(m) is torch.nn.Linear)
    with torch.no_grad():
        with packs.active(model) as switched:
            assert switched == []  # no autocast
        with torch.autocast("cpu", dtype=torch.bfloat16), packs.active(model, enabled=False) as switched:
            assert switched == []
        with torch.autocast("cpu", dtype=torch.bfloat16), packs.active(model) as switched:
            assert len(switched) == plain
    with torch.autocast("cpu", dtype=torch.bfloat16), packs.active(model) as switched:
        assert switched == []  # gradients on: training keeps nn.Linear


def test_lora_models_generate_the_same_tokens_and_logits_packed(tiny):
    model, tokenizer = tiny
    lora = apply_lora(copy.deepcopy(model), rank=2, alpha=4.0, dropout=0.0, target_modules=["q_proj", "v_proj"])
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # peft starts B at zero: make the adapters matter
    prompts = [tokenizer("The arms are Apple and Stuntman.")["input_ids"], tokenizer("Hi")["input_ids"]]
    params = SamplingParams(max_new_tokens=8, do_sample=False)
    results = {}
    for packed in (False, True):
        backend = HFBackend(lora, tokenizer, precision="bf16", packed_gemm=packed, reuse_kv=False)
        seen, handle = head_outputs(lora)
        try:
            results[packed] = ([g.token_ids for g in backend.generate(prompts, params)], seen)
        finally:
            handle.remove()
        # the plain base layers and the adapters' A/B linears inside peft's LoRA layers are packed
        assert backend.packed.packed_count == (sum(1 for m in lora.modules() if type(m) is torch.nn.Linear) if packed else 0)
    assert results[True][0] == results[False][0]
    for a, b in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_session_drops_its_packs_on_error_and_does_not_nest(tiny):
    model, tokenizer = tiny
    backend = HFBackend(model, tokenizer, precision="bf16", reuse_kv=False)
    prompts = [tokenizer("Hi")["input_ids"]]
    with pytest.raises(RuntimeError, match="boom"):
        with backend.session():
            backend.generate(prompts, SamplingParams(max_new_tokens=2, do_sample=False))
            assert backend.packed._packs
            raise RuntimeError("boom")
    assert not backend.packed._packs
    with backend.session(), pytest.raises(RuntimeError, match="nest"):
        with backend.session():
            pass


def test_linears_are_restored_on_error(tiny):
    model = tiny[0]
    with pytest.raises(RuntimeError, match="boom"):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), PackedLinears().active(model) as switched:
            assert switched
            raise RuntimeError("boom")
    assert not any("forward" in vars(m) for m in model.modules())
