"""The algorithm keys that keep apart what verl, REINFORCE++ and GiGPO keep apart: the in-reward KL's estimator and
GiGPO's own step discount, each reaching the code that uses it."""

from __future__ import annotations

import pytest

import ragen.train.batch as batch_module
import ragen.train.actor_update as update_module
from ragen.agent.trajectory import Trajectory, Turn
from ragen.cli import main
from ragen.config import ConfigError, load_config
from ragen.train.batch import collate

SMALL = ["model=tiny", "trainer.total_steps=1", "rollout.env_groups=2", "rollout.group_size=2",
         "rollout.max_new_tokens=6", "trainer.val_episodes=2", "trainer.progress_bar=false",
         "trainer.val_before_train=false", "trainer.save_final=false", "trainer.plot=false"]


def test_defaults_follow_verl_and_the_gigpo_paper():
    alg = load_config("bandit").algorithm
    assert alg.kl_type == "k3" and alg.kl_in_reward_type == "k1"
    assert alg.gamma == 1.0 and alg.gigpo_gamma == 0.95


@pytest.mark.parametrize("override", ["algorithm.kl_in_reward_type=k4", "algorithm.gigpo_gamma=1.5",
                                      "algorithm.filter_mode=top_q"])
def test_bad_values_name_the_key(override):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config("bandit", [override])


def test_step_returns_are_discounted_by_the_step_gamma():
    traj = Trajectory(env_name="sokoban", group_id=0, seed=0)
    traj.input_ids = [1, 2, 3, 4, 5, 6, 7]
    traj.loss_mask = [0, 1, 1, 0, 1, 1, 0]
    traj.turn_spans = [(1, 3), (4, 6)]
    traj.turns = [Turn("a", ["a"], True, 0.0, 0.0), Turn("b", ["b"], True, 1.0, 0.0)]
    returns = collate([traj], pad_id=0, step_gamma=0.5).step_returns[0]  # (T,) on each turn's targets
    assert returns.tolist() == pytest.approx([0.5, 0.5, 0.0, 1.0, 1.0, 0.0])


def test_the_in_reward_kl_uses_its_own_estimator_and_gigpo_its_own_gamma(monkeypatch, tmp_path):
    kl_types, step_gammas = [], []
    real_kl, real_collate = update_module.kl_penalty, update_module.collate

    def spy_kl(logprobs, ref, kl_type):
        kl_types.append(kl_type)
        return real_kl(logprobs, ref, kl_type)

    def spy_collate(trajectories, pad_id, step_gamma=1.0):
        step_gammas.append(step_gamma)
        return real_collate(trajectories, pad_id, step_gamma=step_gamma)

    monkeypatch.setattr(update_module, "kl_penalty", spy_kl)
    monkeypatch.setattr(update_module, "collate", spy_collate)
    assert main(["train", "bandit", f"trainer.output_dir={tmp_path}", *SMALL, "algorithm.use_kl_in_reward=true",
                 "algorithm.kl_type=k3", "algorithm.use_kl_loss=false", "algorithm.adv_estimator=gigpo", "algorithm.gigpo_gamma=0.7"]) == 0
    assert kl_types == ["k1"]  # the in-reward penalty, once per step: not the loss's k3
    assert step_gammas == [0.7]
    assert batch_module.collate is real_collate
