"""Add your own env in 30 lines: guess a secret number, told "higher" or "lower" after each guess.

Nothing in ragen is edited: the env registers itself under ``"guess_number"`` on import.

    python examples/custom_env.py play --seed 0          # play it yourself, as the model sees it
    python examples/custom_env.py train model=tiny trainer.total_steps=1   # train on it

See docs/envs.md for the walk-through.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from gymnasium import spaces

import ragen.envs


@ragen.envs.register("guess_number")
class GuessNumberEnv(ragen.envs.TextEnv):
    description = "Guess a secret number in 1..max_number; each wrong guess is answered 'higher' or 'lower'."
    observation_space = spaces.Text(max_length=200, charset=frozenset(map(chr, range(32, 127))))

    @dataclass
    class Config:
        max_number: int = 16
        max_guesses: int = 6

    def __init__(self, render_mode: str | None = None, **cfg):
        self.config = ragen.envs.build_config(self.Config, cfg, "guess_number")  # names unknown keys
        n = self.config.max_number
        self.action_lookup = {i: str(i) for i in range(1, n + 1)}  # parse_action("7") -> 7
        self.action_space = spaces.Discrete(n, start=1)
        self.instructions = f"Guess my secret integer between 1 and {n}. Answer with one number, like <answer>{n // 2}</answer>."
        self.message, self.done = "", True

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)  # seeds self.np_random
        self.secret = int(self.np_random.integers(1, self.config.max_number + 1))
        self.low, self.high, self.guesses, self.done = 1, self.config.max_number, 0, False
        self.message = f"I picked a number between 1 and {self.config.max_number}. You have {self.config.max_guesses} guesses."
        return self.message, {}

    def step(self, action):
        guess = self.check_action(action)  # ValueError for ids outside action_lookup
        if self.done:
            raise ValueError("guess_number: episode is over; call reset()")
        self.guesses += 1
        success = guess == self.secret
        if guess < self.secret:
            self.low, hint = max(self.low, guess + 1), "higher"
        else:
            self.high, hint = min(self.high, guess - 1), "lower"
        self.message = "Correct!" if success else f"{guess} is wrong: my number is {hint}."
        truncated = not success and self.guesses >= self.config.max_guesses
        self.done = success or truncated
        info = {"success": success, "action_is_valid": True, "action_is_effective": True}
        return self.message, 1.0 if success else 0.0, success, truncated, info

    def render(self):
        return self.message

    def expert_actions(self):  # optional: lets ExpertAgent (and SFT data) use binary search
        return [str((self.low + self.high) // 2)]


if __name__ == "__main__":
    from ragen.cli import main

    command, *rest = sys.argv[1:] or ["play"]
    if command == "play":
        sys.exit(main(["play", "guess_number", "agent.max_turn=6", *rest]))
    sys.exit(main(["train", "guess_number", "agent.max_turn=6", "agent.enable_think=false", *rest]))
