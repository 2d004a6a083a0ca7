"""Env tags: presets and user tags, mixed training batches, per-tag advantages, filters and metrics."""

import json
from collections import Counter

import pytest
import torch

from ragen.algos import AdvantageInputs, get_adv_estimator
from ragen.cli import main
from ragen.config import ConfigError, load_config
from ragen.envs.tags import PRESET_TAGS, resolve_tag
from ragen.agent.env_sets import train_sets, val_sets
from ragen.train.per_tag import per_tag_advantages, per_tag_filter
from ragen.agent.env_sets import VAL_SEED_BASE
from ragen.train.trainer import StarPOTrainer

# -- tags and config --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESET_TAGS))
def test_every_preset_tag_builds_its_env(name):
    tag = resolve_tag(name)
    env = tag.make_env()
    observation, _ = env.reset(seed=0)
    assert isinstance(observation, str) and observation
    assert tag.max_turn >= 1 and tag.max_actions_per_traj >= 1


def test_required_presets_exist():
    assert {"SimpleSokoban", "LargerSokoban", "CoordSokoban", "FrozenLake", "SlipperyFrozenLake",
            "Bandit", "BanditTest", "Countdown"} <= set(PRESET_TAGS)
    assert resolve_tag("FrozenLake").make_env().config.is_slippery is False
    assert resolve_tag("SlipperyFrozenLake").make_env().config.is_slippery is True
    assert resolve_tag("BanditTest").config["name_set"] == "test"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["es.train=[{tag: NoSuchTag, groups: 1}]"], "unknown env tag 'NoSuchTag'"),
        (["es.val=[{tag: Typo, episodes: 2}]"], "unknown env tag 'Typo'"),
        (["es.tags={Mine: {env: sokoban, config: {dim_room: [2, 2]}}}"], "env tag 'Mine': sokoban: dim_room"),
        (["es.tags={Mine: {env: bandit, config: {arms: 3}}}"], "env tag 'Mine': bandit: unknown config key 'arms'"),
        (["es.tags={Mine: {env: nope}}"], "env tag 'Mine': unknown env 'nope'"),
        (["es.tags={Mine: {config: {}}}"], "env tag 'Mine': 'env'"),
        (["es.tags={Mine: {env: bandit, max_turn: 0}}"], "env tag 'Mine': max_turn must be an int >= 1"),
        (["es.tags={Mine: {env: bandit, colour: red}}"], "es.tags.Mine.colour"),
        (["es.train=[{tag: Bandit, groups: 0}]"], "es.train[0].groups"),
        (["es.val=[{tag: Bandit, episodes: -1}]"], "es.val[0].episodes"),
        # a wrong type inside a list item: OmegaConf names only 'episodes', so the override is named too
        (["es.val=[{tag: Bandit, episodes: x}]"], "override 'es.val=[{tag: Bandit, episodes: x}]': config key 'episodes'"),
        (["es.train=[{tag: Bandit, groups: 1}, {tag: Bandit, groups: 2}]"], "env tag 'Bandit' is listed twice"),
        (["agent.think_reward=0.1", "agent.enable_think=false"], "agent.think_reward"),
    ],
)
def test_bad_tags_exit_2_naming_the_tag(overrides, message, capsys, tmp_path):
    with pytest.raises(ConfigError, match=None):
        load_config("bandit", overrides)
    assert main(["train", "bandit", "model=tiny", f"trainer.output_dir={tmp_path}", *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_val_entries_without_a_count_use_trainer_val_episodes():
    config = load_config(None, ["es.val=[{tag: Bandit}, {tag: BanditTest, episodes: 3}]", "trainer.val_episodes=5"])
    assert [(s.tag.name, s.count) for s in val_sets(config)] == [("Bandit", 5), ("BanditTest", 3)]
    preset = load_config("bandit", ["trainer.val_episodes=2"])  # the main job's preset follows the override
    assert [(s.tag.name, s.count) for s in val_sets(preset)] == [("Bandit", 2), ("BanditTest", 2)]


def test_user_tag_overrides_a_preset_and_inherits_the_agent_section():
    config = load_config(None, [
        "es.tags={Bandit: {env: bandit, config: {high_prob: 0.5}, instructions: Pick one.}}",
        "es.train=[{tag: Bandit, groups: 2}, {tag: SimpleSokoban, groups: 1}]",
        "agent.format_penalty=-0.5",
    ])
    mine, soko = train_sets(config)
    assert mine.tag.config == {"high_prob": 0.5} and mine.settings.instructions == "Pick one."
    assert mine.settings.max_turn == 1 and mine.settings.format_penalty == -0.5  # agent section fills the gaps
    assert (soko.settings.max_turn, soko.settings.max_actions_per_turn, soko.settings.max_actions_per_traj) == (5, 2, 10)
    # No es.val: every training tag is validated with trainer.val_episodes episodes.
    assert [(s.name, s.count) for s in val_sets(config)] == [("Bandit", 64), ("SimpleSokoban", 64)]


def test_single_env_config_is_the_one_tag_case():
    config = load_config("sokoban", ["rollout.env_groups=3", "trainer.val_episodes=5"])
    [train], [val] = train_sets(config), val_sets(config)
    assert (train.name, train.tag.env, train.count, val.count) == ("sokoban", "sokoban", 3, 5)
    assert train.settings.max_turn == config.agent.max_turn and train.tag.config == config.env.config


MIXED = "es.train=[{tag: Bandit, groups: 2}]"


@pytest.mark.parametrize(
    "override, key, fix",
    [
        ("env.config.own_payoff_draw=false", "env.config.own_payoff_draw", "es.tags.TAG.config.own_payoff_draw=VALUE"),
        ("env.name=sokoban", "env.name", "es.tags.TAG={env: ENV"),
        ("env={name: sokoban}", "env", "es.tags.TAG={env: ENV"),
        ("rollout.env_groups=3", "rollout.env_groups", "es.train=[{tag: TAG, groups: N}]"),
        ("rollout={env_groups: 3}", "rollout.env_groups", "es.train=[{tag: TAG, groups: N}]"),
        ("rollout.env_groups=0", "rollout.env_groups", "not used"),  # not "must be >= 1": the key is not read at all
    ],
)
def test_a_typed_key_es_train_never_reads_exits_2(override, key, fix, capsys, tmp_path):
    if not override.endswith("=0"):
        load_config("bandit", [override])  # without es.train the same override is used, so accepted
    for overrides in ([MIXED, override], [override, MIXED]):  # the order on the command line does not matter
        with pytest.raises(ConfigError, match="not used when es.train is set"):
            load_config("bandit", overrides)
    assert main(["train", "bandit", "model=tiny", f"trainer.output_dir={tmp_path}", MIXED, override]) == 2
    err = capsys.readouterr().err
    assert f"config key {key!r}: not used" in err and fix in err and "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "config.yaml").exists()


def test_the_fix_the_error_names_works_and_keeps_the_preset_tags_other_settings():
    config = load_config("bandit", [MIXED, "es.tags.Bandit.config.own_payoff_draw=true"])
    [train] = train_sets(config)
    assert train.tag.config == {"name_set": "train", "arm_order": "seed_parity", "own_payoff_draw": True}
    assert (train.settings.max_turn, train.settings.max_actions_per_turn) == (1, 1)
    assert train.tag.make_env().config.own_payoff_draw is True
    # es.val's Bandit is the same (extended) tag; BanditTest is untouched.
    assert [s.tag.config.get("own_payoff_draw") for s in val_sets(config)] == [True, None]
    # Other fields of an extending tag replace the preset's; a tag that names its env replaces the preset whole.
    longer = load_config(None, ["es.train=[{tag: FrozenLake, groups: 1}]", "es.tags.FrozenLake.max_turn=7"])
    assert train_sets(longer)[0].settings.max_turn == 7 and train_sets(longer)[0].tag.config["is_slippery"] is False
    quiet = load_config(None, ["es.train=[{tag: Bandit, groups: 1}]", "es.tags.Bandit.system_prompt=''"])
    assert train_sets(quiet)[0].settings.system_prompt == ""  # "" = no system message, as on any tag
    whole = load_config(None, ["es.train=[{tag: Bandit, groups: 1}]", "es.tags.Bandit={env: bandit}"])
    assert train_sets(whole)[0].tag.config == {}
    # A new tag still has to name its env.
    with pytest.raises(ConfigError, match="only a tag named like a preset may leave it out"):
        load_config(None, ["es.train=[{tag: Mine, groups: 1}]", "es.tags.Mine.config.high_prob=0.5"])


def test_env_settings_a_file_loses_to_es_train_are_noted_and_the_run_goes_on(capsys, tmp_path):
    from ragen.config import lost_env_settings, to_yaml

    # The main job's preset sets env.config.arm_order and own_payoff_draw; the command line's es.train trains on
    # the Bandit tag, which keeps its own arm order and does not set the draw: both are lost, and said so.
    config = load_config("bandit", [MIXED])
    assert lost_env_settings(config) == ["env.config.own_payoff_draw", "env.config.arm_order"]
    # Nothing is lost when the tag sets the same values, nor with the presets' own defaults.
    assert lost_env_settings(load_config("bandit", [MIXED, "es.tags.Bandit.config.own_payoff_draw=true",
                                                    "es.tags.Bandit.config.arm_order=group_balanced"])) == []
    assert lost_env_settings(load_config("sokoban", ["es.train=[{tag: SimpleSokoban, groups: 4}]"])) == []  # its 4 groups
    assert lost_env_settings(load_config("frozen_lake", ["es.train=[{tag: SlipperyFrozenLake, groups: 1}]"])) == []
    assert lost_env_settings(load_config("bandit")) == []  # no es.train: env is the training env
    # The envs' resolved configs are compared: a key at the env's default is not lost; one the tag does not keep is.
    yaml = tmp_path / "mine.yaml"
    yaml.write_text("env: {name: sokoban, config: {search_depth: 30, num_boxes: 2}}\n"
                    "rollout: {env_groups: 32}\nes: {train: [{tag: SimpleSokoban}]}\n")
    assert lost_env_settings(load_config(str(yaml))) == ["env.config.num_boxes", "rollout.env_groups"]
    assert lost_env_settings(load_config(str(yaml), ["es.train=[{tag: SimpleSokoban, groups: 32}]"])) == [
        "env.config.num_boxes"]  # 32 groups either way
    # Such a run's saved config.yaml: `ragen train --resume` notes it and goes on to look for a checkpoint.
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(config))
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("ragen: note: env.config.own_payoff_draw, env.config.arm_order not used: es.train is set")
    assert "no valid checkpoint" in err[1] and len(err) == 2


def test_env_overrides_that_validation_tags_do_not_take_are_noted(capsys):
    from ragen.cli import main

    assert main(["train", "bandit", "model=tiny", "env.config.high_prob=0.5", "--print-config"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == ["ragen: note: env.config.high_prob set the training envs only: validation plays es.val's tags "
                   "(Bandit, BanditTest), each with its own env config (change one with es.tags.TAG.config.KEY=VALUE; "
                   "docs/env_tags.md)"]
    for quiet in (["model=tiny"], ["model=tiny", "env.config.high_prob=0.5", "es.val=[]"]):  # nothing to note
        assert main(["train", "bandit", *quiet, "--print-config"]) == 0
        assert capsys.readouterr().err == ""


# -- advantages and filtering never mix tags ---------------------------------------------------


def _inputs(scores, group_ids):
    B, T = len(scores), 3
    token_rewards = torch.zeros(B, T)
    token_rewards[:, -1] = torch.tensor(scores)
    return AdvantageInputs(token_rewards=token_rewards, response_mask=torch.ones(B, T), group_ids=torch.tensor(group_ids))


@pytest.mark.parametrize("estimator", ["brpo", "grpo", "rloo", "reinforce_pp"])
def test_advantages_are_computed_within_each_tag(estimator):
    fn = get_adv_estimator(estimator)
    # Tag A's returns are ~0-1 (Bandit-like), tag B's ~10 (Sokoban-like); rows interleaved.
    scores = [0.0, 10.0, 1.0, 12.0, 0.5, 11.0]
    groups = [0, 1, 0, 1, 0, 1]
    tags = ["A", "B", "A", "B", "A", "B"]
    out = per_tag_advantages(fn, _inputs(scores, groups), tags)
    for tag, rows in (("A", [0, 2, 4]), ("B", [1, 3, 5])):
        alone = fn(_inputs([scores[i] for i in rows], [groups[i] for i in rows]))
        torch.testing.assert_close(out.advantages[rows], alone.advantages)
    if estimator in ("brpo", "reinforce_pp"):  # batch-level: mixing the tags would have changed every value
        mixed = fn(_inputs(scores, groups)).advantages
        assert not torch.allclose(mixed, out.advantages)


def test_brpo_per_tag_by_hand():
    out = per_tag_advantages(get_adv_estimator("brpo"), _inputs([0.0, 10.0, 2.0, 14.0], [0, 1, 2, 3]), ["A", "B", "A", "B"])
    # A: mean 1, unbiased std sqrt(2); B: mean 12, std sqrt(8): both give ±1/sqrt(2).
    expected = torch.tensor([-1, -1, 1, 1]) / 2**0.5
    torch.testing.assert_close(out.advantages[:, 0], expected, atol=1e-5, rtol=1e-5)


def test_filter_keeps_a_share_of_each_tag():
    # Tag B's in-group stds (~5) dwarf tag A's (~0.5): a batch-wide top-k would keep only B.
    scores = torch.tensor([0.0, 1.0, 0.0, 0.2, 0.0, 10.0, 0.0, 8.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    tags = ["A"] * 4 + ["B"] * 4
    keep, metrics = per_tag_filter(scores, groups, tags, keep_ratio=0.5, mode="top_k")
    assert keep.tolist() == [True, True, False, False, True, True, False, False]
    assert metrics["filter/kept_groups"] == 2 and metrics["filter/kept_ratio"] == 0.5
    assert "filter/A/std_before" in metrics and "filter/B/std_after" in metrics


# -- the trainer ------------------------------------------------------------------------------


def test_mixed_rollout_counts_per_tag_and_unique_groups(tmp_path):
    config = load_config(None, [
        "model=tiny", f"trainer.output_dir={tmp_path}", "rollout.group_size=2", "rollout.max_new_tokens=4",
        "es.train=[{tag: SimpleSokoban, groups: 2}, {tag: Bandit, groups: 3}]",
        "es.val=[{tag: BanditTest, episodes: 3}, {tag: FrozenLake, episodes: 2}]",
    ])
    trainer = StarPOTrainer(config)
    trajs = trainer.rollout(1)
    assert Counter(t.tag for t in trajs) == {"SimpleSokoban": 4, "Bandit": 6}
    assert Counter(t.env_name for t in trajs) == {"sokoban": 4, "bandit": 6}
    groups_by_tag = {tag: {t.group_id for t in trajs if t.tag == tag} for tag in ("SimpleSokoban", "Bandit")}
    assert len(groups_by_tag["SimpleSokoban"]) == 2 and len(groups_by_tag["Bandit"]) == 3
    assert not groups_by_tag["SimpleSokoban"] & groups_by_tag["Bandit"]
    for gid in set().union(*groups_by_tag.values()):  # a group shares one seed
        assert len({t.seed for t in trajs if t.group_id == gid}) == 1
    assert all(len(t.turns) == 1 for t in trajs if t.tag == "Bandit")
    assert all(1 <= len(t.turns) <= 5 for t in trajs if t.tag == "SimpleSokoban")
    val = trainer.validate()
    assert val["val/BanditTest/episodes"] == 3 and val["val/FrozenLake/episodes"] == 2 and val["val/episodes"] == 5
    assert all(t.seed < VAL_SEED_BASE for t in trajs)  # training seeds never reach the validation range


def test_two_step_mixed_run_logs_per_tag_metrics(tmp_path):
    run_yaml = tmp_path / "mix.yaml"
    run_yaml.write_text(
        "env: {name: bandit}\n"
        "agent: {max_turn: 1, think_reward: 0.5, prediction_reward: 0.25}\n"
        "es:\n"
        "  tags:\n"
        "    RiskyBandit: {env: bandit, config: {high_prob: 0.9}, instructions: 'Pick the better arm.'}\n"
        "  train:\n"
        "    - {tag: Bandit, groups: 2}\n"
        "    - {tag: RiskyBandit, groups: 1}\n"
        "  val:\n"
        "    - {tag: Bandit, episodes: 2}\n"
        "    - {tag: BanditTest, episodes: 3}\n"
    )
    out = tmp_path / "run"
    assert main(["train", str(run_yaml), "model=tiny", "trainer.total_steps=2", "trainer.val_freq=1",
                 "rollout.group_size=2", "rollout.max_new_tokens=6", f"trainer.output_dir={out}",
                 "trainer.progress_bar=false", "trainer.save_final=false", "trainer.plot=false"]) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]
    per_tag = ["success", "reward_mean", "reward_std", "valid_action_rate", "effective_action_rate",
               "actions_per_episode", "response_length"]
    for line in lines:  # validated before training, at step 1 (val_freq) and at the end
        for tag, n in (("Bandit", 2), ("BanditTest", 3)):
            assert line[f"val/{tag}/episodes"] == n
            assert all(f"val/{tag}/{key}" in line for key in per_tag)
        assert "val/RiskyBandit/episodes" not in line
    for line in lines[1:]:
        assert line["train/Bandit/episodes"] == 4 and line["train/RiskyBandit/episodes"] == 2
        assert all(f"train/{tag}/{key}" in line for tag in ("Bandit", "RiskyBandit") for key in per_tag + ["pass@2"])
        assert "train/reward_think" in line and "train/reward_prediction" in line
    summary = json.loads((out / "summary.json").read_text())
    assert "val/BanditTest/success" in summary["val_after"]


@pytest.mark.parametrize("preset, env_cls", [("sokoban_study", "SokobanEnv"), ("frozenlake_study", "FrozenLakeEnv"), ("frozenlake_rl", "FrozenLakeEnv"),
                                             ("frozenlake_slippery_study", "FrozenLakeEnv"),
                                             ("frozenlake_neighbours", "FrozenLakeEnv")])
def test_study_presets_keep_the_envs_own_instructions(preset, env_cls):
    """The study presets copy their env's instructions and add an example answer: the copy must not drift."""
    config = load_config(preset)
    (train,) = train_sets(config)
    env = train.tag.make_env()
    assert type(env.unwrapped).__name__ == env_cls
    lines = lambda text: [line.rstrip() for line in text.splitlines()]  # noqa: E731 (the env has a trailing space)
    own, copied = lines(env.unwrapped.instructions), lines(train.settings.instructions)
    assert copied[: len(own)] == own, (own, copied)
    assert "Example answer: <answer>" in train.settings.instructions
    assert [s.name for s in val_sets(config)] == [train.name]
