"""The tied embedding / LM-head weight's gradient in kept memory (ragen/train/tied_embedding.py) gives autograd's gradients.

Speed never changes results. Every parameter's gradient over two accumulated
micro-batches is compared with autograd's path (``policy_forward(..., tied_weight=False)``) in fp32
and under bf16 autocast, for the plain pass and both shared-prompt layouts, with a padding token
inside the rows (``nn.Embedding`` gives its row no lookup gradient).
"""

from __future__ import annotations

import pytest
import torch

import ragen.train.tied_embedding as tied_module
from ragen.models.tiny import load_tiny
from ragen.train.logprobs import policy_forward
from ragen.train.tied_embedding import TiedWeight, tied_weight_for


@pytest.fixture()
def model():
    model, _ = load_tiny(seed=3)  # its own copy: tests here set .grad and switch flags
    model.train()
    return model


def rows(model):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (4, 14), generator=g)  # (B, L)
    ids[2:, :6] = ids[2, :6]  # rows 2 and 3 share their prompt
    ids[1, 3] = ids[3, 8] = model.config.pad_token_id  # padding tokens the model reads (prompt and answer)
    mask = torch.ones_like(ids)
    mask[0, 12:] = 0  # right padding
    response = torch.zeros(4, 13)  # (B, T = L - 1)
    response[:, 5:] = 1
    response[0, 11:] = 0
    return ids, mask, response


def gradients(model, tied: bool, autocast: bool, **kwargs) -> dict[str, torch.Tensor]:
    """Every gradient after two micro-batches (losses weighted 1 and 2) accumulated from ``grad = None``."""
    ids, mask, response = rows(model)
    model.zero_grad(set_to_none=True)
    for weight in (1.0, 2.0):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = policy_forward(model, ids, mask, response, tied_weight=tied, **kwargs)
            loss = -weight * (out.logprobs * response).sum() / response.sum()
        loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("layout", [None, "split", "packed"])
def test_gradients_equal_autograds(model, autocast, layout):
    kwargs = {} if layout is None else {"prompt_lengths": torch.full((4,), 6), "prompt_layout": layout}
    expected = gradients(model, tied=False, autocast=autocast, **kwargs)
    got = gradients(model, tied=True, autocast=autocast, **kwargs)
    assert got.keys() == expected.keys() and "model.embed_tokens.weight" in got
    for name, grad in expected.items():
        # the same GEMMs (bf16 ones too); only the order of fp32 additions into W.grad differs
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_partial_block_of_vocabulary_rows(model, monkeypatch):
    """A vocabulary that is no multiple of ROWS: the last block is shorter."""
    assert model.config.vocab_size % 1000
    monkeypatch.setattr(tied_module, "ROWS", 1000)
    expected = gradients(model, tied=False, autocast=True)
    got = gradients(model, tied=True, autocast=True)
    torch.testing.assert_close(got["model.embed_tokens.weight"], expected["model.embed_tokens.weight"], rtol=1e-5, atol=1e-6)


def test_the_graph_has_no_dense_or_cast_nodes_for_the_tied_weight(model):
    ids, mask, response = rows(model)
    seen = set()

    def walk(fn):
        if fn is None or fn in seen:
            return
        seen.add(fn)
        for next_fn, _ in fn.next_functions:
            walk(next_fn)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = policy_forward(model, ids, mask, response)
    walk(out.logprobs.grad_fn)
    names = {type(fn).__name__ for fn in seen}
    assert {"_TiedHeadBackward", "_TiedLookupBackward"} <= names
    assert "EmbeddingBackward0" not in names
    weight = model.get_input_embeddings().weight
    casts_of_w = [fn for fn in seen if type(fn).__name__ == "ToCopyBackward0"
                  and any(getattr(nxt, "variable", None) is weight for nxt, _ in fn.next_functions)]
    assert not casts_of_w  # autocast's cast of W (and its fp32 gradient copy) is not in the graph


def test_w_grad_is_one_kept_buffer_across_steps(model):
    weight = model.get_input_embeddings().weight
    gradients(model, tied=True, autocast=True)
    first = weight.grad.data_ptr()
    gradients(model, tied=True, autocast=True)  # zero_grad(set_to_none=True) in between
    assert weight.grad.data_ptr() == first
    held = torch.ones_like(weight)
    weight.grad = held  # a gradient someone else set: accumulated into, in place
    ids, mask, response = rows(model)
    expected = gradients(model, tied=False, autocast=False)["model.embed_tokens.weight"]
    model.zero_grad(set_to_none=True)
    weight.grad = held.fill_(1.0)
    for scale in (1.0, 2.0):
        out = policy_forward(model, ids, mask, response)
        (-scale * (out.logprobs * response).sum() / response.sum()).backward()
    assert weight.grad is held
    torch.testing.assert_close(held - 1.0, expected, rtol=1e-5, atol=1e-6)


def test_where_it_does_not_apply(model):
    base = model
    assert TiedWeight.applies(base)
    with torch.no_grad(), tied_weight_for(base) as tied:
        assert tied is None  # no backward: nothing to keep
    with tied_weight_for(base, enabled=False) as tied:
        assert tied is None
    base.get_input_embeddings().weight.requires_grad_(False)
    assert not TiedWeight.applies(base)  # frozen (LoRA's base weights)
    base.get_input_embeddings().weight.requires_grad_(True)
    untied, _ = load_tiny(seed=3)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    assert not TiedWeight.applies(untied)
    bf16, _ = load_tiny(seed=3)
    assert not TiedWeight.applies(bf16.to(torch.bfloat16))
    scaled, _ = load_tiny(seed=3)
    scaled.get_input_embeddings().scale_grad_by_freq = True
    assert not TiedWeight.applies(scaled)


def test_the_modules_are_restored_after_the_block_also_on_error(model):
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    with pytest.raises(RuntimeError, match="boom"):
        with tied_weight_for(model) as tied:
            assert tied is not None and "forward" in vars(embedding) and "forward" in vars(head)
            raise RuntimeError("boom")
    assert "forward" not in vars(embedding) and "forward" not in vars(head)


def test_hooks_on_the_head_module_see_the_tied_heads_logits(model):
    """The tied head runs as the head module's forward, so its hooks (the benchmarks' probes, a user's) still run."""
    ids, mask, response = rows(model)
    seen = []
    handle = model.get_output_embeddings().register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = policy_forward(model, ids, mask, response)
    finally:
        handle.remove()
    assert len(seen) == 1 and seen[0].grad_fn is not None and type(seen[0].grad_fn).__name__ == "_TiedHeadBackward"
    assert seen[0].shape == (int(response.sum()), model.config.vocab_size) and out.logprobs.requires_grad


def test_a_weight_changed_before_the_backward_raises(model):
    """The head saves W for autograd's version check: a step between forward and backward is an error, not stale logits."""
    ids, mask, response = rows(model)
    out = policy_forward(model, ids, mask, response)
    with torch.no_grad():
        model.get_input_embeddings().weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.logprobs.sum().backward()


def test_optimizer_steps_between_passes_match_autograds_run(model):
    """Three SGD steps under bf16 autocast, zero_grad(set_to_none=True) between them: the kept cast must follow W
    (refreshed per forward) and the kept W.grad must start at zero each step, as autograd's path does. (SGD: an
    update linear in the gradient; Adam's first steps turn rounding-level differences in near-zero gradients into
    visible ones.)"""
    plain, _ = load_tiny(seed=3)
    plain.train()
    ids, mask, response = rows(model)
    optimizers = {m: torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, plain)}
    for step in range(3):
        grads = {}
        for m, tied in ((model, True), (plain, False)):
            optimizers[m].zero_grad(set_to_none=True)
            for weight in (1.0, 2.0):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = policy_forward(m, ids, mask, response, tied_weight=tied)
                    loss = -weight * (out.logprobs * response).sum() / response.sum()
                loss.backward()
            grads[tied] = [p.grad.clone() for p in m.parameters()]
            optimizers[m].step()
        for (name, _), a, b in zip(model.named_parameters(), grads[True], grads[False]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {step}: {name}")
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_a_resized_vocabulary_gets_new_buffers(model):
    """resize_token_embeddings keeps the Parameter and swaps its data: the kept buffers follow the new shape."""
    gradients(model, tied=True, autocast=True)
    model.resize_token_embeddings(model.config.vocab_size + 8)
    expected = gradients(model, tied=False, autocast=True)
    got = gradients(model, tied=True, autocast=True)
    assert got["model.embed_tokens.weight"].shape[0] == model.config.vocab_size
    torch.testing.assert_close(got["model.embed_tokens.weight"], expected["model.embed_tokens.weight"], rtol=1e-5, atol=1e-6)


def test_tensor_hooks_and_foreign_forwards_keep_autograds_path(model):
    weight = model.get_input_embeddings().weight
    handle = weight.register_hook(lambda grad: grad * 2)
    assert not TiedWeight.applies(model)
    handle.remove()
    assert TiedWeight.applies(model)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    embedding.forward = lambda ids: torch.nn.functional.embedding(ids, embedding.weight)  # e.g. an accelerate hook
    assert not TiedWeight.applies(model)
    del embedding.forward
    head.forward = lambda hidden: torch.nn.functional.linear(hidden, head.weight)
    assert not TiedWeight.applies(model)
    del head.forward
    assert TiedWeight.applies(model)
