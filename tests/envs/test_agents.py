"""Baseline agents: the expert is optimal where its solver is, the random agent is far below it."""

import numpy as np
import pytest

import ragen.envs
from ragen.envs.agents import ExpertAgent, RandomAgent, evaluate_agent, make_agent, run_episode
from ragen.envs.frozen_lake import success_probability
from ragen.envs.sokoban import solve as solve_sokoban

SEEDS = range(50)
DETERMINISTIC_LAKE = {"is_slippery": False}


def test_expert_solves_every_sokoban_6x6_room_optimally():
    env = ragen.envs.make("sokoban", dim_room=(6, 6), num_boxes=1)
    for seed in SEEDS:
        env.reset(seed=seed)
        shortest = len(solve_sokoban(env))
        result = run_episode(env, ExpertAgent(), seed=seed)
        assert result["success"], seed
        assert result["steps"] == shortest  # optimal: as few moves as the BFS plan
        assert result["invalid_turns"] == 0


def test_expert_vs_random_on_sokoban_and_deterministic_lake():
    # Sokoban with the preset's budget of 10 actions (6x6 one-box rooms are short: a random
    # walk of 100 steps solves about half of them); FrozenLake with its own 100 steps.
    for name, cfg, turns in [("sokoban", {}, 10), ("frozen_lake", DETERMINISTIC_LAKE, 100)]:
        expert = evaluate_agent(name, cfg, ExpertAgent(), SEEDS, max_turns=turns)
        random = evaluate_agent(name, cfg, RandomAgent(seed=0), SEEDS, max_turns=turns)
        assert expert["success"] == 1.0, name
        assert random["success"] <= 0.4, (name, random)
        assert expert["reward_mean"] > random["reward_mean"]
        assert expert["episodes"] == random["episodes"] == 50


def test_expert_on_slippery_lake_matches_the_solvers_success_probability():
    env = ragen.envs.make("frozen_lake")
    expected, wins = 0.0, 0
    n = 100
    for seed in range(n):
        env.reset(seed=seed)
        expected += success_probability(env, horizon=env.config.max_steps)
        wins += run_episode(env, ExpertAgent(), seed=seed)["success"]
    assert abs(wins / n - expected / n) < 0.1


@pytest.mark.parametrize(
    "name, cfg",
    [
        ("bandit", {}),
        ("countdown", {}),
        ("sudoku", {}),
        ("math_qa", {}),
        ("sokoban", {"num_boxes": 2, "dim_room": (7, 7)}),
    ],
)
def test_expert_succeeds_on_other_envs(name, cfg):
    assert evaluate_agent(name, cfg, ExpertAgent(), range(10))["success"] == 1.0


@pytest.mark.parametrize("name", sorted(["sokoban", "frozen_lake", "countdown", "sudoku", "bandit", "math_qa"]))
def test_expert_answers_parse_back_through_parse_action(name):
    env = ragen.envs.make(name)
    for seed in range(5):
        env.reset(seed=seed)
        answers = ExpertAgent().act(env)
        assert answers and all(isinstance(a, str) and "||" not in a for a in answers)
        assert all(env.parse_action(a) is not None for a in answers), answers
        # and as a model would write them: one <answer> block with actions joined by ||
        from ragen.agent.parser import parse_response

        parsed = parse_response(f"<answer>{' || '.join(answers)}</answer>", enable_think=False, max_actions=len(answers))
        assert parsed.format_valid and parsed.actions == [a.strip() for a in answers]


def test_max_actions_per_turn_caps_answers_and_keeps_optimality():
    env = ragen.envs.make("sokoban")
    env.reset(seed=3)
    shortest = len(solve_sokoban(env))
    result = run_episode(env, ExpertAgent(max_actions_per_turn=2), seed=3)
    assert result["success"] and result["steps"] == shortest and result["turns"] == -(-shortest // 2)


def test_random_agent_is_seeded_per_episode():
    env = ragen.envs.make("sokoban")
    a = run_episode(env, RandomAgent(seed=7), seed=1, max_turns=20, record=True)
    b = run_episode(env, RandomAgent(seed=7), seed=1, max_turns=20, record=True)
    c = run_episode(env, RandomAgent(seed=8), seed=1, max_turns=20, record=True)
    actions = lambda r: [t["actions"] for t in r["transcript"]]  # noqa: E731
    assert actions(a) == actions(b) != actions(c)
    # uniform over the env's own names
    assert {x for t in actions(a) for x in t} <= set(env.action_lookup.values())


def test_record_transcript_and_make_agent():
    env = ragen.envs.make("bandit")
    result = run_episode(env, make_agent("expert"), seed=0, record=True)
    assert result["turns"] == 1 and result["transcript"][0]["actions"] == [result["transcript"][0]["actions"][0]]
    assert "Which arm" in result["transcript"][0]["observation"]
    with pytest.raises(ValueError, match="unknown agent"):
        make_agent("oracle")


def test_expert_without_solver_raises_naming_the_hook():
    from ragen.envs.base import TextEnv

    class NoSolver(TextEnv):
        action_lookup = {1: "go"}

    with pytest.raises(ValueError, match="expert_actions"):
        ExpertAgent().act(NoSolver())


def test_record_conversation_is_the_rollouts_chat_with_the_expert_answering():
    from ragen.agent.context import PromptFormat
    from ragen.agent.parser import parse_response
    from ragen.agent import AgentConfig
    from ragen.agent.conversation import record_conversation

    settings = AgentConfig(max_turn=5, max_actions_per_turn=2, max_actions_per_traj=10)
    env = ragen.envs.make("sokoban")
    seed = next(s for s in range(100) if env.reset(seed=s) and len(solve_sokoban(env)) >= 4)
    convo = record_conversation(env, ExpertAgent(max_actions_per_turn=2), seed=seed, settings=settings)
    messages = convo["messages"]
    assert convo["success"] and [m["role"] for m in messages[:3]] == ["system", "user", "assistant"]
    obs, _ = env.reset(seed=seed)
    fmt = PromptFormat(True, 2, "||")
    assert messages[1]["content"] == fmt.first_user_message(env.instructions, obs, 1, 10)
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    for reply in replies:
        parsed = parse_response(reply, enable_think=True, max_actions=2)
        assert parsed.format_valid and all(env.parse_action(a) for a in parsed.actions)
    # the second user message carries the first turn's reward and the new state
    first_actions = parse_response(replies[0], max_actions=2).actions
    reward = sum(env.step(env.parse_action(a))[1] for a in first_actions)
    assert messages[3]["content"] == fmt.next_user_message(reward, env.render(), 2, 8)
    assert messages[-1]["role"] == "assistant"


# -- FrozenLake: the expert plays the optimal policy for the episode's budget -------------------


class _LoggingExpert(ExpertAgent):
    """Records what the expert saw (state, steps taken, turns played) and answered, each turn."""

    def begin_episode(self, env, seed, budget=None):
        super().begin_episode(env, seed, budget)
        self.log = []

    def act(self, env):
        seen = (env.unwrapped.state, env.unwrapped.num_steps, self.turns_played)
        answer = super().act(env)
        self.log.append((*seen, answer))
        return answer


def test_expert_under_a_budget_plays_the_finite_horizon_policy():
    from ragen.envs.frozen_lake import LakeSolver

    env = ragen.envs.make("frozen_lake", size=4, is_slippery=True)
    expert = _LoggingExpert(max_actions_per_turn=1)
    turns = 0
    for seed in range(20):
        result = run_episode(env, expert, seed=seed, max_turns=20, max_actions_per_turn=1, max_actions=20)
        solver = LakeSolver(env)
        for state, steps, played, answer in expert.log:
            assert steps == played  # one move per turn
            assert answer == [env.action_lookup[solver.action(state, 20 - steps)]]
            # and that action is a maximiser of Q_k (k = moves left)
            q = solver.q_values(20 - steps)[:, state]
            assert q[env.parse_action(answer[0]) - 1] >= q.max() - 1e-12
        turns += len(expert.log)
        assert result["turns"] == len(expert.log) <= 20
    assert turns > 100
    # without a budget: the infinite-horizon policy, as before
    env.reset(seed=0)
    assert ExpertAgent().act(env) == [env.action_lookup[solve_lake(env)[env.state]]]


def solve_lake(env):
    from ragen.envs.frozen_lake import solve

    return solve(env)


def _exact_expert_success(env, budget) -> float:
    """The expert's exact success probability under ``budget``: every reachable (state, steps) at
    each turn start is put into the env and the expert asked for its answer."""
    from ragen.envs.frozen_lake import LakeModel

    model = LakeModel.of(env)
    expert = ExpertAgent(budget.max_actions_per_turn)
    expert.begin_episode(env, None, budget)
    raw = env.unwrapped
    dist, won = {(model.start, 0): 1.0}, 0.0
    for turn in range(budget.max_turns):
        nxt: dict = {}
        for (state, steps), prob in dist.items():
            if steps >= budget.max_actions:
                continue
            raw.lake.s, raw.num_steps, expert.turns_played = state, steps, turn
            answer = [raw.parse_action(a) for a in expert.act(env)][: budget.max_actions - steps]
            here = {state: prob}
            for action in answer:
                step_dist: dict = {}
                for s, p in here.items():
                    won += p * model.goal_prob[action - 1, s]
                    for s2 in np.flatnonzero(model.trans[action - 1, s]):
                        step_dist[int(s2)] = step_dist.get(int(s2), 0.0) + p * model.trans[action - 1, s, s2]
                here = step_dist
            for s, p in here.items():
                key = (s, steps + len(answer))
                nxt[key] = nxt.get(key, 0.0) + p
        dist = nxt
    return won


@pytest.mark.parametrize("seed", range(6))
def test_expert_on_two_action_turns_attains_the_turn_optimum(seed):
    """SlipperyFrozenLake's budget (5 turns x 2 actions, 10 in all): the expert's exact success is the
    optimum over turn-structured play, and above one move per turn and the infinite-horizon policy's first 5 moves."""
    from ragen.envs.agents import Budget
    from ragen.envs.frozen_lake import policy_success_probability, success_probability, turn_success_probability

    env = ragen.envs.make("frozen_lake", size=4, is_slippery=True)
    env.reset(seed=2**31 + seed)
    budget = Budget(max_turns=5, max_actions_per_turn=2, max_actions=10)
    exact = _exact_expert_success(env, budget)
    assert exact == pytest.approx(turn_success_probability(env, 5, 2, 10), abs=1e-12)
    assert exact >= success_probability(env, 5) - 1e-12  # one move per turn
    # the infinite-horizon policy one move per turn (not with all 10 moves: seeing the state after every move, the
    # fastest optimal policy beats 5 turns of 2 on seeds 1 and 2, 0.0191 against 0.0170 and 0.1515 against 0.1327)
    assert exact >= policy_success_probability(env, 5) - 1e-12
    assert exact <= success_probability(env, 10) + 1e-12  # closed-loop play over all 10 moves


def test_expert_on_deterministic_lake_reaches_the_goal_within_the_budget_whenever_possible():
    from ragen.envs.frozen_lake import success_probability

    env = ragen.envs.make("frozen_lake", size=4, is_slippery=False)
    expert = ExpertAgent(max_actions_per_turn=2)
    for seed in range(40):
        env.reset(seed=seed)
        reachable = success_probability(env, 6) == 1.0
        result = run_episode(env, expert, seed=seed, max_turns=3, max_actions_per_turn=2, max_actions=6)
        assert result["success"] == reachable, seed


def test_run_episode_applies_the_rollouts_action_caps():
    env = ragen.envs.make("frozen_lake", size=4, is_slippery=False)
    result = run_episode(env, RandomAgent(seed=0, max_actions_per_turn=3), seed=0, max_turns=10,
                         max_actions_per_turn=2, max_actions=5, record=True)
    assert result["steps"] <= 5 and all(len(t["actions"]) <= 2 for t in result["transcript"])


def test_eval_expert_baseline_gets_the_tags_budget():
    from ragen.config import load_config
    from ragen.eval.evaluate import eval_targets, run_baseline

    config = load_config("frozen_lake", ["es.train=[{tag: SlipperyFrozenLake}]", "es.val=[{tag: SlipperyFrozenLake}]"])
    target = eval_targets(config)[0]
    seeds = [2**31 + i for i in range(30)]
    row = run_baseline(config, "expert", seeds, target)
    direct = evaluate_agent("frozen_lake", target.env_config, ExpertAgent(2), seeds, max_turns=5, max_actions_per_turn=2,
                            max_actions=10)
    assert row["success"] == direct["success"] and row["actions_per_episode"] == direct["steps_mean"]
    assert row["actions_per_episode"] > 5  # two moves per turn, not one


def test_an_agent_without_the_budget_parameter_still_plays():
    from ragen.envs.agents import Agent

    class Legacy(Agent):
        def begin_episode(self, env, seed):
            self.started = seed

        def act(self, env):
            return ["Right"]

    agent = Legacy()
    result = run_episode(ragen.envs.make("frozen_lake", is_slippery=False), agent, seed=4, max_turns=3)
    assert agent.started == 4 and result["turns"] <= 3
