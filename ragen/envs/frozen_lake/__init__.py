"""FrozenLake (RAGEN's): the env with its text map (``env.py``), and the exact solver the expert agent and the
optimality metrics use: the lake as a Markov chain (``model.py``), infinite-horizon policy iteration
(``policy_iteration.py``) and finite-horizon play and success probabilities (``solver.py``)."""

from ragen.envs.frozen_lake.env import ACTION_LOOKUP, MAP_TRIES, MAX_SIZE, TILES, FrozenLakeEnv, parse_map, random_map
from ragen.envs.frozen_lake.model import TIE, LakeModel
from ragen.envs.frozen_lake.solver import (LakeSolver, policy_success_probability, solve, solve_finite,
                                           success_probability, turn_success_probability)

__all__ = ["ACTION_LOOKUP", "MAP_TRIES", "MAX_SIZE", "TILES", "FrozenLakeEnv", "parse_map", "random_map", "TIE",
           "LakeModel", "LakeSolver", "policy_success_probability", "solve", "solve_finite", "success_probability",
           "turn_success_probability"]
