import pytest
from gymnasium.utils.env_checker import check_env

import ragen.envs
from ragen.envs.bandit import NAMES


def test_check_env_and_registry():
    check_env(ragen.envs.make("bandit"), skip_render_check=True)


def test_arms_come_from_the_name_set_and_payoffs_follow_the_rules():
    env = ragen.envs.make("bandit")
    high_rewards = []
    for seed in range(400):
        env.reset(seed=seed)
        high_name = env.action_lookup[env.high_action]
        low_action = 3 - env.high_action
        assert high_name in NAMES["train"]["high"] and env.action_lookup[low_action] in NAMES["train"]["low"]
        if seed % 2:
            _, reward, terminated, truncated, info = env.step(low_action)
            assert reward == pytest.approx(0.1) and not info["success"]
        else:
            _, reward, terminated, truncated, info = env.step(env.high_action)
            assert reward in (0.0, 1.0) and info["success"]
            high_rewards.append(reward)
        assert terminated and not truncated
    # The risky arm pays 1 with probability 0.25: 200 pulls, mean within ~4 standard errors.
    assert abs(sum(high_rewards) / len(high_rewards) - 0.25) < 0.13


def test_test_names_are_disjoint_from_train_names():
    train = set(NAMES["train"]["low"] + NAMES["train"]["high"])
    test = set(NAMES["test"]["low"] + NAMES["test"]["high"])
    assert not train & test
    env = ragen.envs.make("bandit", name_set="test")
    env.reset(seed=3)
    assert set(env.action_lookup.values()) <= test


def test_wide_training_names_extend_the_training_lists_and_stay_apart_from_the_test_names():
    wide, train, test = NAMES["train_wide"], NAMES["train"], NAMES["test"]
    test_names = {n.lower() for side in test.values() for n in side}
    for side in ("low", "high"):
        assert wide[side][: len(train[side])] == train[side]  # the training lists come first, unchanged
        assert len(wide[side]) == 32 and len({n.lower() for n in wide[side]}) == 32
        assert not {n.lower() for n in wide[side]} & test_names
    env = ragen.envs.make("bandit", name_set="train_wide")
    seen = set()
    for seed in range(300):
        env.reset(seed=seed)
        high, low = env.action_lookup[env.high_action], env.action_lookup[3 - env.high_action]
        assert high in wide["high"] and low in wide["low"]
        assert env.parse_action(f"{high}") == env.high_action
        seen.update((high, low))
    assert len(seen) > 48  # draws reach beyond the 16 training names


def test_same_seed_same_episode():
    a, b = ragen.envs.make("bandit"), ragen.envs.make("bandit")
    for seed in range(20):
        assert a.reset(seed=seed)[0] == b.reset(seed=seed)[0]
        assert a.step(1)[1] == b.step(1)[1]


def test_answer_text_maps_to_the_named_arm():
    env = ragen.envs.make("bandit")
    env.reset(seed=0)
    name = env.action_lookup[2]
    assert env.parse_action(f"  {name.upper()} ") == 2
    assert env.parse_action("neither") is None


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown config key 'arms'"):
        ragen.envs.make("bandit", arms=3)
    with pytest.raises(ValueError, match="name_set must be one of"):
        ragen.envs.make("bandit", name_set="nope")
    env = ragen.envs.make("bandit")
    env.reset(seed=0)
    with pytest.raises(ValueError, match="invalid action id 7"):
        env.step(7)
    env.step(1)
    with pytest.raises(ValueError, match="episode is over"):
        env.step(1)

@pytest.mark.parametrize("low_payoff, best", [(0.1, "high"), (0.25, "high"), (0.5, "low")])
def test_success_is_pulling_the_arm_with_the_higher_expected_payoff(low_payoff, best):
    # high arm: 1.0 with probability 0.25 (mean 0.25); a tie goes to the high arm
    env = ragen.envs.make("bandit", low_payoff=low_payoff)
    for seed in range(20):
        env.reset(seed=seed)
        best_action = env.high_action if best == "high" else 3 - env.high_action
        assert env.best_action == best_action
        _, _, _, _, info = env.step(best_action)
        assert info["success"]
        env.reset(seed=seed)
        _, _, _, _, info = env.step(3 - best_action)
        assert not info["success"]


def test_step_reports_whether_the_second_listed_arm_was_pulled():
    """``info["metric/second_listed"]`` is 1.0 exactly when the answer named the arm shown second."""
    env = ragen.envs.make("bandit")
    for seed in range(20):
        obs, _ = env.reset(seed=seed)
        second = env.action_lookup[2]
        assert obs.index(env.action_lookup[1]) < obs.index(second)  # action 2 is the arm listed second
        action = 1 + seed % 2
        _, _, _, _, info = env.step(action)
        assert info["metric/second_listed"] == (1.0 if action == 2 else 0.0)


def test_seed_parity_order_balances_consecutive_seeds_and_keeps_names_and_payoffs():
    """``arm_order="seed_parity"`` lists the high arm second exactly on odd seeds, so the 64 validation seeds split
    32 / 32 (a position habit scores 0.5), while the names and the payoff draw stay the seed's."""
    from ragen.agent.env_sets import VAL_SEED_BASE

    drawn, parity = ragen.envs.make("bandit"), ragen.envs.make("bandit", arm_order="seed_parity")
    seeds = [VAL_SEED_BASE + i for i in range(64)]
    second = 0
    for seed in seeds:
        drawn.reset(seed=seed)
        obs, info = parity.reset(seed=seed)
        assert parity.high_action == (2 if seed % 2 else 1)
        assert info["high_arm"] == drawn.action_lookup[drawn.high_action]
        assert set(parity.action_lookup.values()) == set(drawn.action_lookup.values())
        assert obs.index(parity.action_lookup[1]) < obs.index(parity.action_lookup[2])
        assert parity.step(parity.high_action)[1] == drawn.step(drawn.high_action)[1]  # same payoff draw
        second += parity.high_action == 2
    assert second == 32
    # the drawn order of these seeds is not balanced (why the validation tags use the parity)
    assert sum(drawn.reset(seed=s) is not None and drawn.high_action == 2 for s in seeds) == 39


def test_seed_parity_order_needs_a_seed_and_a_known_name():
    with pytest.raises(ValueError, match="arm_order must be one of \\['drawn', 'seed_parity', 'group_balanced'\\]"):
        ragen.envs.make("bandit", arm_order="random")
    env = ragen.envs.make("bandit", arm_order="seed_parity")
    with pytest.raises(ValueError, match="needs reset\\(seed=...\\)"):
        env.reset()
    # the validation tags use it
    from ragen.envs.tags import resolve_tag

    assert all(resolve_tag(t).config["arm_order"] == "seed_parity" for t in ("Bandit", "BanditTest"))


def test_own_payoff_draw_gives_each_group_member_its_own_reproducible_draw():
    """``own_payoff_draw``: the envs of a group (same seed) see the same arms, but the high arm's payoff is drawn per
    ``group_member``, reproducibly; the default keeps the group's shared draw, and member 0 is not special."""
    shared, own = ragen.envs.make("bandit"), ragen.envs.make("bandit", own_payoff_draw=True)

    def pulls(env, seed):
        out = []
        for member in range(6):
            obs, _ = env.reset(seed=seed, options={"group_member": member})
            out.append((obs, env.step(env.high_action)[1]))
        return out

    differ = 0
    hits = []
    for seed in range(60):
        a, b = pulls(own, seed), pulls(shared, seed)
        assert a == pulls(own, seed)  # reproducible
        assert len({obs for obs, _ in a + b}) == 1  # the same start for every member, either way
        assert len({r for _, r in b}) == 1  # shared: one draw for the whole group
        differ += len({r for _, r in a}) > 1
        hits += [r for _, r in a]
    assert differ > 20  # P(6 equal draws) = 0.75^6 + 0.25^6 ~ 0.18
    assert abs(sum(hits) / len(hits) - 0.25) < 0.07  # 360 pulls of a 0.25 arm, within ~3 standard errors
    with pytest.raises(ValueError, match="options\\['group_member'\\] must be an int >= 0"):
        own.reset(seed=0, options={"group_member": -1})


def test_group_balanced_order_alternates_within_a_group_and_keeps_names_and_draws():
    """Even members see the seed's drawn order, odd members the other one; names and own payoff draws are unchanged."""
    from ragen.envs.bandit import BanditEnv

    for seed in range(20):
        drawn = BanditEnv(own_payoff_draw=True)
        balanced = BanditEnv(own_payoff_draw=True, arm_order="group_balanced")
        for member in range(4):
            drawn.reset(seed=seed, options={"group_member": member})
            balanced.reset(seed=seed, options={"group_member": member})
            swapped = member % 2 == 1
            assert balanced.high_action == (3 - drawn.high_action if swapped else drawn.high_action)
            assert sorted(balanced.action_lookup.values()) == sorted(drawn.action_lookup.values())
            high_d, high_b = drawn.action_lookup[drawn.high_action], balanced.action_lookup[balanced.high_action]
            assert high_d == high_b
            # the same arm meets the same payoff draw
            assert drawn.step(drawn.high_action)[1] == balanced.step(balanced.high_action)[1]


def test_group_balanced_groups_list_each_arm_first_equally_often():
    from ragen.envs.bandit import BanditEnv

    env = BanditEnv(arm_order="group_balanced")
    firsts = []
    for member in range(4):
        env.reset(seed=7, options={"group_member": member})
        firsts.append(env.high_action == 1)
    assert sum(firsts) == 2
