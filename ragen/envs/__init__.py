"""Text environments with gymnasium's API, and the registry that names them.

>>> import ragen.envs
>>> env = ragen.envs.make("bandit")
>>> obs, info = env.reset(seed=0)
"""

from ragen.envs.base import TextEnv, build_config
from ragen.envs.registry import env_config_fields, make, register, registered

# Built-in envs register themselves on import.
from ragen.envs import bandit as _bandit  # noqa: E402,F401
from ragen.envs import sokoban as _sokoban  # noqa: E402,F401
from ragen.envs import frozen_lake as _frozen_lake  # noqa: E402,F401
from ragen.envs import countdown as _countdown  # noqa: E402,F401
from ragen.envs import sudoku as _sudoku  # noqa: E402,F401
from ragen.envs import game2048 as _game2048  # noqa: E402,F401
from ragen.envs import math_qa as _math_qa  # noqa: E402,F401
from ragen.envs import textarena_adapter as _textarena  # noqa: E402,F401  (imports textarena only when made)

__all__ = ["TextEnv", "build_config", "make", "register", "registered", "env_config_fields"]
