"""Two-armed bandit whose arms are named: the names hint at the payoff (RAGEN's Bandit)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gymnasium import spaces

from ragen.envs.base import ENV_METRIC_PREFIX, TextEnv, after_start_rng, build_config, group_member
from ragen.envs.registry import register
from ragen.envs.render import check_render_mode

# Arm names. A "low" arm is a safe occupation that always pays a little; a "high" arm is a
# risky one that pays a lot, rarely, and more on average. The test lists share no name with
# the train lists, so a policy that learned the *meaning* (risk) and not the names generalises.
NAMES = {
    "train": {
        "low": ["Teacher", "Librarian", "Accountant", "Gardener", "Baker", "Nurse", "Clerk", "Tailor"],
        "high": ["Gambler", "Explorer", "Stuntman", "Pirate", "Daredevil", "Smuggler", "Adventurer", "Speculator"],
    },
    # The training lists and 24 more occupations per side, for SFT data in which memorising names
    # does not pay: a demonstration can only be fitted by judging what a name means (docs/sft.md).
    # Still no test name, nor a close synonym of one (chosen by hand; tests check the disjointness).
    "train_wide": {
        "low": ["Teacher", "Librarian", "Accountant", "Gardener", "Baker", "Nurse", "Clerk", "Tailor",
                "Bookkeeper", "Receptionist", "Secretary", "Archivist", "Florist", "Typist", "Statistician",
                "Civil Servant", "Office Worker", "Data Analyst", "Waiter", "Potter", "Weaver", "Translator",
                "Bus Driver", "Insurance Agent", "Payroll Officer", "Hairdresser", "Cook", "Auditor", "Farmer",
                "Tutor", "Proofreader", "Museum Guide"],
        "high": ["Gambler", "Explorer", "Stuntman", "Pirate", "Daredevil", "Smuggler", "Adventurer", "Speculator",
                 "Poker Player", "Mountaineer", "Stock Trader", "Lion Tamer", "Storm Chaser", "Test Pilot",
                 "Cave Diver", "Bullfighter", "Bomb Disposal Expert", "Crypto Trader", "Tightrope Walker",
                 "Venture Capitalist", "Spy", "War Correspondent", "Rodeo Rider", "Escape Artist",
                 "Big Wave Surfer", "Card Shark", "Firefighter", "Astronaut", "Snake Charmer",
                 "Alligator Wrestler", "Wildcatter", "Day Trader"],
    },
    "test": {
        "low": ["Postman", "Cashier", "Janitor", "Plumber", "Dentist", "Pharmacist"],
        "high": ["Skydiver", "Treasure Hunter", "Bounty Hunter", "Mercenary", "Racer", "Volcanologist"],
    },
}

#: How ``reset`` orders the two arms: "drawn" from the seeded generator (RAGEN's Bandit); "seed_parity" (the high
#: arm second exactly on odd seeds: a position-balanced set of consecutive validation seeds); "group_balanced" (the
#: drawn order for even group members, the other order for odd ones: within every group each listed position names
#: each arm equally often, so a group's advantages can reward a name but never a position).
ARM_ORDERS = ("drawn", "seed_parity", "group_balanced")

_CHARSET = frozenset("".join(chr(c) for c in range(32, 127)) + "\n")


@register("bandit")
class BanditEnv(TextEnv):
    """Two-armed bandit, one pull per episode.

    ## Description
    Two arms are named per seed, one drawn from a list of low-risk names and one from a
    list of high-risk names, shown in random order. The low arm pays ``low_payoff``
    (0.1) for sure; the high arm pays ``high_payoff`` (1.0) with probability
    ``high_prob`` (0.25), else 0, so it is better on average (0.25 > 0.1). As in RAGEN,
    the agent must infer from the names alone which arm is which.

    ## Action Space
    ``Discrete(2, start=1)``: 1 pulls the first listed arm, 2 the second. In text the
    agent answers with the arm's name (``parse_action``).

    ## Observation Space
    ``Text``: a sentence listing both arms.

    ## Starting State
    Arm names and their order are drawn from ``np_random`` at ``reset(seed=...)``. With
    ``arm_order="seed_parity"`` the order is instead set by the seed: the high arm is listed
    second exactly when the seed is odd (the names and the payoff draw stay those of the seed). With
    ``arm_order="group_balanced"`` the members of a group (``reset(options={"group_member": j})``) alternate
    the two orders: even members see the drawn order, odd members the other one.

    ## Rewards
    The arm's payoff. The payoff draw uses the same seeded generator, so the same seed
    and action always give the same reward. With ``own_payoff_draw`` it uses a generator
    seeded by the seed and ``reset(options={"group_member": j})`` instead: the envs of a
    group (one seed, the same arms) then each get their own draw, still reproducibly.

    ## Episode End
    After one pull (terminated).

    ## Information
    ``success`` (the arm with the higher expected payoff was pulled: the high arm unless a
    config makes ``high_prob * high_payoff`` < ``low_payoff``), ``action_is_valid``, ``action_is_effective``
    (always True for a valid pull), ``high_arm`` (its name), ``metric/second_listed`` (1.0 when the pulled arm is
    the one listed second, else 0.0; logged as ``info_second_listed``).

    ## Arguments
    ``name_set`` ("train" | "train_wide" | "test"; ``train_wide`` is ``train`` plus 24 names per
    side, for SFT data), ``low_payoff``, ``high_payoff``, ``high_prob``, ``arm_order`` ("drawn" |
    "seed_parity"; the built-in ``Bandit`` and ``BanditTest`` validation tags use "seed_parity", so that
    on consecutive seeds half the episodes list the high arm first and a policy that answers by position
    scores exactly 0.5 on an even count; "group_balanced" trains on both orders within each group, so that
    answering by position earns a group no advantage: the main job's preset uses it), ``own_payoff_draw``
    (False; True gives each member of a group its own payoff draw, so a group's advantages compare the
    arms over several draws instead of one: the main job's preset uses it, docs/main_job.md).
    """

    description = "Two named arms, one pull: infer from the names which arm pays more on average."
    #: A policy that answers a position whatever the names gives a second-listed share of 0 or 1 (a habit).
    habit_metrics = ("second_listed",)
    instructions = (
        "Bandit game: pull one of two arms to maximize your reward. "
        "Each arm's reward distribution is related to its name."
    )
    action_space = spaces.Discrete(2, start=1)
    observation_space = spaces.Text(min_length=0, max_length=512, charset=_CHARSET)

    @dataclass
    class Config:
        name_set: str = "train"
        low_payoff: float = 0.1
        high_payoff: float = 1.0
        high_prob: float = 0.25
        arm_order: str = "drawn"
        own_payoff_draw: bool = False

        def validate(self) -> None:
            if self.name_set not in NAMES:
                raise ValueError(f"bandit: name_set must be one of {sorted(NAMES)}, got {self.name_set!r}")
            if self.arm_order not in ARM_ORDERS:
                raise ValueError(f"bandit: arm_order must be one of {list(ARM_ORDERS)}, got {self.arm_order!r}")
            if not 0.0 <= self.high_prob <= 1.0:
                raise ValueError(f"bandit: high_prob must be in [0, 1], got {self.high_prob}")
            for key in ("low_payoff", "high_payoff"):
                if not math.isfinite(getattr(self, key)):
                    raise ValueError(f"bandit: {key} must be a finite number, got {getattr(self, key)}")

    def __init__(self, render_mode: str | None = None, **cfg: Any):
        self.config = build_config(self.Config, cfg, "bandit")
        self.render_mode = check_render_mode("bandit", render_mode, self.metadata["render_modes"])
        self.action_lookup = {1: "", 2: ""}
        self.high_action = 0
        self._payoff_rng = None
        self._done = True

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        names = NAMES[self.config.name_set]
        low = names["low"][self.np_random.integers(len(names["low"]))]
        high = names["high"][self.np_random.integers(len(names["high"]))]
        self.high_action = int(self.np_random.integers(1, 3))  # drawn either way: later draws stay the seed's
        if self.config.arm_order == "seed_parity":
            if seed is None:
                raise ValueError("bandit: arm_order='seed_parity' needs reset(seed=...)")
            self.high_action = 2 if seed % 2 else 1
        elif self.config.arm_order == "group_balanced" and group_member(options, "bandit") % 2:
            self.high_action = 3 - self.high_action
        self.action_lookup = {self.high_action: high, 3 - self.high_action: low}
        self._payoff_rng = after_start_rng(self, seed, options, self.config.own_payoff_draw, "bandit")
        self._done = False
        return self.render(), {"high_arm": high}

    @property
    def best_action(self) -> int:
        """The arm with the higher expected payoff; the high arm on a tie (it is the one named risky)."""
        c = self.config
        return self.high_action if c.high_prob * c.high_payoff >= c.low_payoff else 3 - self.high_action

    def step(self, action):
        if self._done:
            raise ValueError("bandit: episode is over; call reset()")
        action = self.check_action(action)
        won = bool(self._payoff_rng.random() < self.config.high_prob)
        if action == self.high_action:
            reward = self.config.high_payoff if won else 0.0
        else:
            reward = self.config.low_payoff
        self._done = True
        info = {
            "success": action == self.best_action,
            "action_is_valid": True,
            "action_is_effective": True,
            "high_arm": self.action_lookup[self.high_action],
            # 1.0 when the answer named the second-listed arm: a policy that ignores the names and always answers one
            # position shows up as 0 or 1 here (the high arm's place is random; docs/main_job.md, "The trap: answering by position")
            ENV_METRIC_PREFIX + "second_listed": float(action == 2),
        }
        return self.render(), float(reward), True, False, info

    def render(self) -> str:
        if self._done and not self.action_lookup[1]:
            return ""
        first, second = self.action_lookup[1], self.action_lookup[2]
        # Both names appear in the example, so copying it favours neither arm (RAGEN's phrasing).
        return (
            f"The arms are {first} and {second}. Which arm do you pull? "
            f"Reply with its name only: <answer>{first}</answer> or <answer>{second}</answer>."
        )
