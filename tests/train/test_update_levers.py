"""Update-side speed levers give the plain path's numbers (speed never changes results).

* the entropy metric without an autograd graph (``entropy_grad=False``, used when ``entropy_coeff == 0``),
  which also takes the hand-written target log-prob backward (``tests/train/test_target_logprobs.py``);
* fused AdamW against torch's for-loop AdamW, and checkpoints that do not carry the fused flag.
"""

from __future__ import annotations

import torch

from ragen.train.checkpoint import _optimizer_state, restore_optimizer
from ragen.train.logprobs import policy_forward
from ragen.train.optimizer import adamw, can_fuse


def batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (3, 12), generator=g)  # (B, L)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    response = torch.zeros(3, 11)  # (B, T = L - 1)
    response[:, 6:] = 1
    return ids, mask, response


def grads_of(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_entropy_as_a_metric_has_no_graph_and_changes_nothing(tiny):
    model, _ = tiny
    ids, mask, response = batch(model.config.vocab_size)
    with_graph = policy_forward(model, ids, mask, response, with_entropy=True, entropy_grad=True)
    metric = policy_forward(model, ids, mask, response, with_entropy=True, entropy_grad=False)
    assert with_graph.entropy.requires_grad and not metric.entropy.requires_grad
    # fp32 in both; the metric path sums in another order (ragen/train/target_logprobs.py)
    torch.testing.assert_close(metric.entropy, with_graph.entropy.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(metric.logprobs.detach(), with_graph.logprobs.detach(), rtol=1e-5, atol=1e-5)
    assert (metric.entropy[response.bool()] > 0).all()
    # the loss the trainer builds with entropy_coeff = 0: same gradients either way
    a = grads_of(model, -(with_graph.logprobs * response).sum() - 0.0 * with_graph.entropy.sum())
    b = grads_of(model, -(metric.logprobs * response).sum())
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


def graph_nodes(tensor: torch.Tensor) -> set[str]:
    seen, stack, names = set(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return names


def test_temperature_one_skips_the_division_with_the_same_logprobs(tiny):
    """On the autograd path (an entropy bonus) the division is a graph node only when T != 1."""
    model, _ = tiny
    ids, mask, response = batch(model.config.vocab_size)

    def graph(temperature):
        out = policy_forward(model, ids, mask, response, temperature=temperature, with_entropy=True, entropy_grad=True)
        return graph_nodes(out.logprobs)

    assert "DivBackward0" not in graph(1.0)
    assert "DivBackward0" in graph(2.0)
    with torch.no_grad():
        at_one = policy_forward(model, ids, mask, response, temperature=1.0).logprobs
        near_one = policy_forward(model, ids, mask, response, temperature=1.0 + 1e-7).logprobs  # divides
        hot = policy_forward(model, ids, mask, response, temperature=2.0).logprobs
    torch.testing.assert_close(at_one, near_one, rtol=0, atol=1e-5)
    assert not torch.allclose(at_one, hot)  # the division is applied when it matters


def params_like(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).requires_grad_() for shape in [(64, 32), (32,), (7, 5, 3)]]


def run_steps(optimizer, params, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()


def test_fused_adamw_matches_the_for_loop_implementation():
    fused_params, loop_params = params_like(0), params_like(0)
    fused = adamw(fused_params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    loop = torch.optim.AdamW(loop_params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, foreach=False)
    assert can_fuse(fused_params) and fused.param_groups[0]["fused"]
    run_steps(fused, fused_params, 5)
    run_steps(loop, loop_params, 5)
    moved = [(a - b).abs().max().item() for a, b in zip(fused_params, params_like(0))]
    assert min(moved) > 1e-3  # the steps did something
    for a, b in zip(fused_params, loop_params):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for a, b in zip(fused.state.values(), loop.state.values()):
        torch.testing.assert_close(a["exp_avg_sq"], b["exp_avg_sq"], rtol=1e-5, atol=1e-9)


def test_a_checkpoint_restores_moments_but_not_the_fused_flag():
    params = params_like(0)
    fused = adamw(params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    run_steps(fused, params, 3)
    tensors, groups = _optimizer_state(fused, dict(zip("abc", params)))
    assert groups["param_groups"][0]["fused"] is True
    fresh = params_like(0)
    unfused = torch.optim.AdamW(fresh, lr=1.0, betas=(0.5, 0.5), weight_decay=0.0, foreach=False)
    restore_optimizer(unfused, dict(zip("abc", fresh)), tensors, groups)
    group = unfused.param_groups[0]
    assert not group["fused"] and group["foreach"] is False  # how this process steps stays its own
    assert (group["lr"], tuple(group["betas"]), group["weight_decay"]) == (1e-2, (0.9, 0.99), 0.1)  # the run's settings
    for old, new in zip(params, fresh):
        torch.testing.assert_close(unfused.state[new]["exp_avg"], fused.state[old]["exp_avg"], rtol=0, atol=0)


def test_only_plain_floating_tensors_are_fused_and_fused_false_is_torchs_default(monkeypatch):
    import ragen.train.optimizer as optimizer

    assert not can_fuse([]) and not can_fuse([torch.zeros(3, dtype=torch.long)])
    params = params_like(0)
    assert can_fuse(params)
    assert adamw(params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0, fused=False).param_groups[0]["fused"] is None
    monkeypatch.setattr(optimizer, "DTensor", torch.nn.Parameter)  # stand-in: these now count as sharded
    sharded = [torch.nn.Parameter(torch.zeros(3))] + params
    assert not can_fuse(sharded)
    assert adamw(sharded, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0).param_groups[0]["fused"] is None


def shared_prompt_batch(vocab: int):
    ids, _, response = batch(vocab)
    ids[1:, :7] = ids[1, :7]  # rows 1 and 2 share their 7-token prompt, row 0 has its own
    mask = torch.ones_like(ids)
    mask[0, 10:] = 0  # right padding, as the trainer's batches
    response[0, 9:] = 0
    return ids, mask, response


def test_the_shared_prompt_pass_looks_up_embeddings_once(tiny):
    """The split layout's prompt pass and continuation pass share one embedding call (one dense (V, H) gradient, not two),
    with the plain pass's log-probs and gradients (the embedding's included), in fp32 and under autocast."""
    from ragen.train.logprobs import embeds_equal_ids

    model, _ = tiny
    assert embeds_equal_ids(model.get_decoder())
    ids, mask, response = shared_prompt_batch(model.config.vocab_size)
    for autocast, tol in ((False, 1e-5), (True, 2e-2)):
        calls = []
        handle = model.get_input_embeddings().register_forward_hook(lambda module, args, out: calls.append(1))
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = policy_forward(model, ids, mask, response, prompt_lengths=torch.full((3,), 7), prompt_layout="split")
        finally:
            handle.remove()
        assert len(calls) == 1
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            plain = policy_forward(model, ids, mask, response)
        torch.testing.assert_close(out.logprobs, plain.logprobs, rtol=tol, atol=tol)
        shared_grads = grads_of(model, -(out.logprobs * response).sum())
        plain_grads = grads_of(model, -(plain.logprobs * response).sum())
        assert shared_grads.keys() == plain_grads.keys() and "model.embed_tokens.weight" in shared_grads
        for name, grad in plain_grads.items():
            assert (shared_grads[name] - grad).norm() <= tol * grad.norm() + 1e-8, (autocast, name)


def test_prompts_without_continuations_need_no_second_pass(tiny):
    """prompt_lengths covering whole rows (S = 0): the prompt pass alone gives the plain pass's hidden states."""
    from ragen.train.logprobs import decoder_hidden

    model, _ = tiny
    ids, mask, _ = shared_prompt_batch(model.config.vocab_size)
    mask[:] = 1
    with torch.no_grad():
        shared = decoder_hidden(model, ids, mask, prompt_lengths=torch.full((3,), ids.shape[1]), layout="split")
        plain = decoder_hidden(model, ids, mask)
    torch.testing.assert_close(shared, plain, rtol=1e-5, atol=1e-5)


def test_decoders_that_treat_ids_and_embeddings_differently_get_two_lookups(tiny, monkeypatch):
    """A decoder with ``embed_scale`` (scaled only in its input_ids branch, e.g. MVP) keeps the input_ids calls."""
    model, _ = tiny
    decoder = model.get_decoder()
    monkeypatch.setattr(decoder, "embed_scale", 1.0, raising=False)
    ids, mask, response = shared_prompt_batch(model.config.vocab_size)
    calls = []
    handle = model.get_input_embeddings().register_forward_hook(lambda module, args, out: calls.append(1))
    try:
        policy_forward(model, ids, mask, response, prompt_lengths=torch.full((3,), 7), prompt_layout="split")
    finally:
        handle.remove()
    assert len(calls) == 2
