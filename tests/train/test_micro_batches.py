"""Micro-batches hold whole groups, so the update's shared-prompt forward runs each group's prompt once."""

import pytest
import torch

from ragen.config import load_config
from ragen.train import actor_update as update_module
from ragen.train.trainer import StarPOTrainer
from ragen.train.update_targets import group_contiguous

from tests.train.trajectories import shared_prompt_trajectories


def test_group_contiguous_keeps_the_rows_and_the_shuffled_group_order():
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    index = torch.tensor([4, 0, 7, 3, 1, 6, 5, 2])  # a shuffled mini-batch: groups 1, 0, 2 first appear in that order
    out = group_contiguous(index, group_ids)
    assert out.tolist() == [4, 3, 5, 0, 1, 2, 7, 6]
    assert sorted(out.tolist()) == sorted(index.tolist())
    assert group_contiguous(index[:3], group_ids).tolist() == [4, 0, 7]  # one row per group: unchanged


def test_each_micro_batch_runs_whole_groups(tmp_path, monkeypatch):
    config = load_config("bandit", ["model=tiny", f"trainer.output_dir={tmp_path}", "trainer.val_episodes=1",
                                    "algorithm.micro_batch_size=3", "algorithm.use_kl_loss=false"])  # no reference pass
    trainer = StarPOTrainer(config)
    trajs = shared_prompt_trajectories(trainer.tokenizer)  # 2 groups x 3 rows, one prompt per group
    prompts_per_call = []
    real = update_module.policy_forward

    def recording(model, input_ids, attention_mask, response_mask, **kw):
        starts = response_mask.argmax(dim=1)  # (B,): first response target = prompt length - 1
        prompts_per_call.append({tuple(row[m.bool()][: int(s) + 1].tolist()) for row, m, s in zip(input_ids, attention_mask, starts)})
        return real(model, input_ids, attention_mask, response_mask, **kw)

    monkeypatch.setattr(update_module, "policy_forward", recording)
    torch.manual_seed(0)
    order = torch.randperm(6)
    groups = [trajs[i].group_id for i in order.tolist()]
    assert groups[:3] != [groups[0]] * 3  # the row shuffle this seed draws splits both groups across micro-batches
    torch.manual_seed(0)
    trainer.update(trajs)
    assert len(prompts_per_call) == 2
    assert all(len(p) == 1 for p in prompts_per_call), prompts_per_call  # one distinct prompt per micro-batch


def test_group_contiguous_puts_groups_of_similar_length_together():
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    lengths = torch.tensor([10, 50, 30, 30, 50, 12, 5, 6])  # longest rows: group 0 50, 1 30, 2 50, 3 6
    index = torch.tensor([6, 2, 0, 4, 7, 3, 1, 5])  # groups first appear in the order 3, 1, 0, 2
    out = group_contiguous(index, group_ids, lengths)
    # longest group first; groups 0 and 2 tie at 50 and keep their shuffled order (0 before 2)
    assert out.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert group_contiguous(index, group_ids, torch.zeros(8, dtype=torch.long)).tolist() == \
        group_contiguous(index, group_ids).tolist()  # equal lengths: the shuffled group order decides


def test_scoring_in_length_order_writes_each_rows_logprobs_back_to_its_row(tmp_path):
    from ragen.train.batch import collate
    from ragen.train.logprobs import policy_forward

    config = load_config("bandit", ["model=tiny", f"trainer.output_dir={tmp_path}", "trainer.val_episodes=1",
                                    "trainer.precision=fp32", "algorithm.micro_batch_size=3"])
    trainer = StarPOTrainer(config)
    trajs = shared_prompt_trajectories(trainer.tokenizer)  # group 1's prompt is the longer: it is scored first
    batch = collate(trajs, trainer.tokenizer.pad_token_id)
    order = group_contiguous(torch.arange(len(batch)), batch.group_ids, batch.attention_mask.sum(1))
    assert order.tolist() == [3, 4, 5, 0, 1, 2]
    scored = trainer.actor.score(batch, policy=True, values=False, ref=False)["logprobs"]  # (B, T)
    for row in range(len(batch)):
        one = batch.select(slice(row, row + 1)).trim()
        alone = policy_forward(trainer.model, one.input_ids, one.attention_mask, one.response_mask,
                               temperature=config.rollout.temperature).logprobs
        T = one.response_mask.shape[1]
        mask = one.response_mask[0].bool()
        assert torch.allclose(scored[row, :T][mask], alone[0][mask], atol=1e-5), row
        assert not scored[row, T:].any()  # nothing written past the row's own targets


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_the_accumulated_gradient_does_not_depend_on_the_micro_batch_size(agg, tmp_path, monkeypatch):
    """``optimizer_step``'s claim: micro-batch losses weighted by their token (or sequence) share sum to one
    pass over the mini-batch. With every loss term on (clipped PG, entropy bonus, KL loss, critic) and two PPO
    epochs (so the second one's ratios move and clip), the gradients and every logged metric of 6 rows in 1,
    2 (4 + 2) and 6 micro-batches agree to fp32 rounding; that is why ``algorithm.micro_batch_size`` may change
    on ``--resume``."""
    runs, real_clip, real_forward = {}, update_module.clip_grad_norm_, update_module.policy_forward
    # micro-batches by row count (6, 4, 1 rows), and by a token budget of 31 padded tokens (rows of 23-32 tokens: one a pass; the
    # 32-token rows exceed it and run alone, checkpointed: gradient_checkpointing=auto)
    cuts = {6: ["algorithm.micro_batch_size=6"], 4: ["algorithm.micro_batch_size=4"], 1: ["algorithm.micro_batch_size=1"],
            "tokens": ["algorithm.micro_batch_size=6", "algorithm.max_tokens_per_micro_batch=31"]}
    for size, cut in cuts.items():
        config = load_config("bandit", [
            "model=tiny", f"trainer.output_dir={tmp_path / str(size)}", "trainer.val_episodes=1", "trainer.precision=fp32",
            "algorithm.adv_estimator=gae", "algorithm.use_kl_loss=true", "algorithm.kl_coef=0.1", "algorithm.ppo_epochs=2",
            "algorithm.clip_ratio_low=0.001", "algorithm.clip_ratio_high=0.001", "optim.lr=1e-3",
            "algorithm.entropy_coeff=0.01", f"algorithm.loss_agg_mode={agg}", "algorithm.max_tokens_per_micro_batch=0", *cut])
        torch.manual_seed(0)  # the same tiny weights and value head for every size
        trainer = StarPOTrainer(config)
        grads = []

        def record(params, max_norm, trainer=trainer, grads=grads):  # each step's accumulated gradient, before clipping
            named = [*trainer.model.named_parameters(), *(("value_head." + n, p) for n, p in trainer.value_head.named_parameters())]
            grads.append({n: p.grad.clone() for n, p in named if p.grad is not None})
            return real_clip(params, max_norm)

        monkeypatch.setattr(update_module, "clip_grad_norm_", record)
        passes = []

        def counting(model, input_ids, *args, passes=passes, real_forward=real_forward, **kw):
            if torch.is_grad_enabled():
                passes.append(tuple(input_ids.shape))
            return real_forward(model, input_ids, *args, **kw)

        monkeypatch.setattr(update_module, "policy_forward", counting)
        torch.manual_seed(1)
        metrics = trainer.update(shared_prompt_trajectories(trainer.tokenizer))
        runs[size] = grads, metrics
        if size == "tokens":  # the budget did cut: no pass above 31 tokens but for a row alone, checkpointed
            assert len(passes) > 2 and all(rows * length <= 31 or rows == 1 for rows, length in passes), passes
            assert trainer.checkpointing.on
    whole_grads, whole_metrics = runs[6]
    assert len(whole_grads) == 2 and any(g.abs().sum() > 0 for n, g in whole_grads[0].items() if n.startswith("value_head"))
    assert whole_metrics["actor/clipfrac_low"] + whole_metrics["actor/clipfrac_high"] > 0  # epoch 2 clips
    for size in (4, 1, "tokens"):
        grads, metrics = runs[size]
        for step, whole in zip(grads, whole_grads):
            assert step.keys() == whole.keys()
            for name, g in whole.items():
                # fp32 sums in other groupings: up to ~1.0e-4 relative seen at micro-batch 1 (seq-mean-token-mean)
                assert (step[name] - g).norm() <= 2e-4 * g.norm() + 1e-12, (size, name, (step[name] - g).norm() / g.norm())
        assert metrics.keys() == whole_metrics.keys()
        for key, value in whole_metrics.items():
            if key.startswith("time/"):
                continue
            assert metrics[key] == pytest.approx(value, rel=1e-3, abs=1e-6, nan_ok=True), (size, key)


def test_explained_variance_is_undefined_for_returns_constant_up_to_fp32_rounding():
    from ragen.train.update_targets import ExplainedVarianceSums

    torch.manual_seed(0)
    values = torch.randn(2, 64) * 5  # a critic that has learned something
    mask = torch.ones(2, 64)
    for reward in (0.0, -0.1, 1.0):  # every return equal: GAE's fp32 R = A + V keeps V's rounding noise
        returns = (torch.full_like(values, reward) - values) + values
        assert returns.std() > 0 or reward == 0.0  # the noise is there (or R is exactly 0)
        sums = ExplainedVarianceSums()
        sums.add(returns, values, mask)
        assert torch.isnan(torch.tensor(ExplainedVarianceSums.from_metrics(sums.as_metrics()))), reward
    # returns that really vary: the exact 1 - Var[R - V] / Var[R], in halves as micro-batches would add them
    returns = values + 0.5 * torch.randn_like(values)
    sums = ExplainedVarianceSums()
    sums.add(returns[:1], values[:1], mask[:1])
    sums.add(returns[1:], values[1:], mask[1:])
    r, d = returns.double().flatten(), (returns - values).double().flatten()
    expected = 1 - d.var(unbiased=False) / r.var(unbiased=False)
    assert ExplainedVarianceSums.from_metrics(sums.as_metrics()) == pytest.approx(expected.item(), rel=1e-9)


def test_the_updates_explained_variance_pools_the_sums_of_all_its_optimizer_steps(tmp_path):
    """With several optimizer steps per update (mini-batches of one row here) the logged explained variance is the
    one of all the update's tokens, from the steps' pooled sums: not a mean of per-step values (a step whose rows'
    returns are constant has none, NaN, which would make the mean NaN)."""
    from ragen.train.update_targets import EV_PREFIX, ExplainedVarianceSums

    config = load_config("bandit", ["model=tiny", f"trainer.output_dir={tmp_path}", "trainer.val_episodes=1",
                                    "trainer.precision=fp32", "algorithm.adv_estimator=gae", "algorithm.mini_batch_size=1"])
    torch.manual_seed(0)
    trainer = StarPOTrainer(config)
    with torch.no_grad():  # a critic with an opinion: the zero-initialised head predicts 0 everywhere
        torch.nn.init.normal_(trainer.value_head.linear.weight, std=0.5)
    steps, real_step = [], trainer.actor.optimizer_step

    def record(*args, **kwargs):
        metrics = real_step(*args, **kwargs)
        steps.append({k: v for k, v in metrics.items() if k.startswith(EV_PREFIX)})
        return metrics

    trainer.actor.optimizer_step = record
    torch.manual_seed(1)
    metrics = trainer.update(shared_prompt_trajectories(trainer.tokenizer))
    assert len(steps) > 2 and not any(k.startswith(EV_PREFIX) for k in metrics)
    pooled = {k: sum(step[k] for step in steps) for k in steps[0]}
    assert metrics["critic/explained_variance"] == pytest.approx(ExplainedVarianceSums.from_metrics(pooled), rel=1e-12)
    assert torch.isfinite(torch.tensor(metrics["critic/explained_variance"]))


@pytest.mark.parametrize("estimator", ["gae", "bi_level_gae"])
def test_equal_returns_of_long_episodes_stay_equal(estimator):
    """The critic estimators' chains sum over every response token; in fp32 that left ~T·1e-7·|V| of rounding in
    returns that are equal, and a 2 000-token episode logged an explained variance of ~-5e11. In fp64 they stay
    equal to fp32 precision: the explained variance is undefined (NaN), as for any constant returns."""
    from ragen.algos import AdvantageInputs, get_adv_estimator
    from ragen.train.update_targets import ExplainedVarianceSums

    torch.manual_seed(0)
    B, T = 8, 2048
    values = torch.randn(B, T)
    mask = torch.ones(B, T)
    turn_ends = torch.zeros(B, T, dtype=torch.bool)
    turn_ends[:, 511::512] = True
    out = get_adv_estimator(estimator)(AdvantageInputs(torch.zeros(B, T), mask, torch.arange(B), values=values,
                                                       turn_ends=turn_ends, gamma=1.0, lam=1.0, high_level_gamma=1.0))
    assert out.returns.dtype == torch.float32 and out.advantages.dtype == torch.float32
    assert out.returns.abs().max() < 1e-5  # every return is 0
    sums = ExplainedVarianceSums()
    sums.add(out.returns, values, mask)
    assert torch.isnan(torch.tensor(ExplainedVarianceSums.from_metrics(sums.as_metrics())))
