"""FrozenLake with text observations, built on gymnasium's own ``FrozenLakeEnv`` (RAGEN's FrozenLake)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gymnasium import spaces
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv as GymFrozenLake
from gymnasium.envs.toy_text.frozen_lake import is_valid
from gymnasium.utils import seeding

from ragen.envs.base import TextEnv, after_start_rng, build_config
from ragen.envs.registry import register
from ragen.envs.render import TILE_SIZE, Glyph, Tile, TiledRender

#: Our action ids -> gymnasium's (0 Left, 1 Down, 2 Right, 3 Up).
ACTION_LOOKUP = {1: "Left", 2: "Down", 3: "Right", 4: "Up"}
TO_GYM_ACTION = {1: 0, 2: 1, 3: 2, 4: 3}

SYMBOL_LEGEND = "P: player, _: frozen ice, O: hole, G: goal, X: player fell into a hole, √: player on the goal"
_CHARSET = frozenset("P_OGX√\n")
#: What :attr:`FrozenLakeEnv.Config.describe_neighbours` names each cell next to the player.
NEIGHBOUR_WORDS = {"S": "ice", "F": "ice", "H": "hole", "G": "goal"}
#: The extra characters of the neighbours line (``"Left: edge, Down: hole, ..."``).
_NEIGHBOUR_CHARSET = frozenset("".join(ACTION_LOOKUP.values()) + "".join(NEIGHBOUR_WORDS.values()) + "edge:, ")

# RGB tiles (``render_mode="rgb_array"``), one per observation symbol, drawn with numpy: gymnasium's
# own rgb_array rendering needs pygame, which is not a dependency. The viewer's HTML grid uses the same colours.
_ICE = (208, 235, 255)
_HOLE = Glyph("disc", (27, 31, 59), size=0.42)
_GOAL = Glyph("diamond", (252, 196, 25), size=0.44)
TILES = {
    "_": Tile(_ICE),
    "O": Tile(_ICE, (_HOLE,)),
    "G": Tile(_ICE, (_GOAL,)),
    "P": Tile(_ICE, (Glyph("disc", (232, 89, 12), size=0.28),)),
    "X": Tile(_ICE, (_HOLE, Glyph("cross", (224, 49, 49), size=0.3, width=0.07))),
    "√": Tile(_ICE, (_GOAL, Glyph("disc", (47, 158, 68), size=0.2))),
}


#: Maps :func:`random_map` draws before giving up (each try is one board and one path search).
MAP_TRIES = 10_000
#: The largest ``size``. The env alone would go further, but a 32x32 map is already a 1055-character observation,
#: and the expert's infinite-horizon solve (:func:`_solve_infinite`: dense linear solves over up to ``size**2``
#: cells, cubic in them) grows fast with the map. Measured on 2 CPU cores at 32x32: ``reset`` under 0.1 s (0.7 s
#: to give up at ``p=0.05``); the expert's first answer (``ExpertAgent().act``, which builds the
#: :class:`LakeSolver`) 0.07-0.15 s on deterministic ice, 0.4-0.7 s on slippery ice with ``success_rate``
#: 0.1..1/3, 0.5-0.85 s at 0.9 (~1 s at 0.99). Value iteration alone took 12-17 s at 0.9 and stopped unconverged
#: at its 100_000-sweep cap. A bigger value is far more likely a typo than a wish:
#: ``size=10**6`` made ``reset`` try to allocate a 7 TiB board, and 2000 had not finished after 30 s.
MAX_SIZE = 32


def random_map(size: int, p: float, seed: int) -> list[str]:
    """gymnasium's ``generate_random_map(size, p, seed)``, the same maps draw for draw, but bounded.

    Each try draws a ``size x size`` board of frozen (probability ``p``) and hole tiles from the seeded
    generator, puts the start top-left and the goal bottom-right, and keeps it if a path joins them
    (gymnasium's ``is_valid``). gymnasium tries forever, so a small ``p`` hung ``reset``; after
    :data:`MAP_TRIES` boards this raises ``ValueError`` instead.
    """
    rng, _ = seeding.np_random(seed)
    for _ in range(MAP_TRIES):
        board = rng.choice(["F", "H"], (size, size), p=[p, 1 - p])
        board[0][0], board[-1][-1] = "S", "G"
        if is_valid(board, size):
            return ["".join(row) for row in board]
    raise ValueError(f"frozen_lake: no {size}x{size} map with a path from start to goal in {MAP_TRIES} tries "
                     f"at p={p} (the frozen-tile probability); raise p")


@register("frozen_lake")
class FrozenLakeEnv(TiledRender, TextEnv):
    """Cross a frozen lake from the start to the goal without falling into a hole.

    ## Description
    Gymnasium's ``FrozenLake`` (its transition table ``P`` and its ``step`` do all the
    dynamics; this class only adds the text layer, the map generation and the time
    limit). Each ``reset`` draws a ``size`` x ``size`` map with
    ``gymnasium.envs.toy_text.frozen_lake.generate_random_map`` (start top-left, goal
    bottom-right, a path between them guaranteed); ``reset(options={"map": ROWS})``
    plays a given map instead (rows of ``S``/``F``/``H``/``G``, one ``S`` and one ``G``).

    ## Action Space
    ``Discrete(4, start=1)``: 1 Left, 2 Down, 3 Right, 4 Up (gymnasium's 0..3 plus one).
    With ``is_slippery`` the player moves in the intended direction with probability
    ``success_rate`` and in each perpendicular direction with ``(1 - success_rate) / 2``.

    ## Rendering
    ``render()`` returns the observation text (``render_mode`` None, ``"text"`` or ``"ansi"``),
    or with ``render_mode="rgb_array"`` a ``(size * tile_size, size * tile_size, 3)`` uint8
    image of the text grid: light-blue ice, navy holes, a yellow goal diamond, an orange
    player, a red cross in a hole, a green disc on the goal (:data:`TILES`; ``tile_size`` 32 by
    default). Drawn with numpy (:mod:`ragen.envs.render`), not gymnasium's pygame renderer. The
    observation returned by ``reset``/``step`` is text in every mode.

    ## Observation Space
    ``Text``: one row per line, ``P`` player, ``_`` frozen (the start cell too), ``O``
    hole, ``G`` goal, ``X`` player in a hole, ``√`` player on the goal. With ``describe_neighbours``
    one more line names the cell each action leads to, in words: ``Left: edge, Down: hole, Right: ice,
    Up: edge`` (``edge`` off the map; ``goal``). The grid alone asks the model to find ``P`` and count
    columns; the line states the one thing a closed-loop move needs (``ragen/configs/frozenlake_neighbours.yaml``).

    ## Starting State
    The player on ``S``. The map comes from a generator spawned from ``np_random``
    (``np_random.spawn``), so it does not consume ``np_random``'s stream: the slip draws
    are exactly those of ``gymnasium.make("FrozenLake-v1", desc=MAP)`` reset with the
    same seed. With ``own_slip_draw`` the slips come from a generator seeded by the seed and
    ``reset(options={"group_member": j})`` instead: the envs of a group (one seed, so one map)
    each meet their own slips, still reproducibly (:func:`ragen.envs.base.after_start_rng`).

    ## Rewards
    1 on reaching the goal, else 0. With ``progress_reward`` ``c > 0`` each move also earns
    ``c * (d(s) - d(s'))``, where ``d`` is the Manhattan distance to the goal: potential-based shaping
    (Ng, Harada & Russell 1999, with potential ``-c * d``), so an episode's shaped rewards sum to
    ``c * (d(start) - d(end))`` and the best policy is the same as without them. It gives a policy that
    never reaches the goal a signal for how far it got (``ragen/configs/frozenlake_neighbours.yaml``).

    ## Episode End
    Terminated on a hole or the goal; truncated after ``max_steps`` steps. Stepping after
    either raises ``ValueError``.

    ## Information
    ``success`` (on the goal), ``action_is_valid`` (always True: invalid ids raise),
    ``action_is_effective`` (the position changed), ``prob`` (gymnasium's transition
    probability of the move taken).

    ## Arguments
    ``size`` (2..32, :data:`MAX_SIZE`), ``p`` (frozen probability of a generated cell, in (0, 1]),
    ``is_slippery``, ``success_rate`` (in (0, 1]), ``max_steps``, ``own_slip_draw`` (False: a group's
    envs share the slips, as they share the seed), ``describe_neighbours`` (False: the grid only),
    ``progress_reward`` (0: the goal's reward only).

    See :func:`solve` (the infinite-horizon optimal policy, by policy iteration), :func:`solve_finite` and
    :class:`LakeSolver` (optimal within a move budget, by backward induction) and :func:`success_probability`.
    """

    description = "FrozenLake: walk over slippery ice from the start to the goal without falling into a hole."
    action_lookup = dict(ACTION_LOOKUP)
    action_space = spaces.Discrete(4, start=1)
    metadata = {"render_modes": ["text", "ansi", "rgb_array"], "render_fps": 4}
    tiles = TILES

    @dataclass
    class Config:
        size: int = 4
        p: float = 0.8
        is_slippery: bool = True
        success_rate: float = 1.0 / 3.0
        max_steps: int = 100
        own_slip_draw: bool = False
        describe_neighbours: bool = False
        progress_reward: float = 0.0

        def validate(self) -> None:
            if not 0.0 <= self.progress_reward < float("inf"):
                raise ValueError(f"frozen_lake: progress_reward must be a finite number >= 0, got {self.progress_reward}")
            if not 2 <= self.size <= MAX_SIZE:
                raise ValueError(f"frozen_lake: size must be in 2..{MAX_SIZE}, got {self.size}")
            if not 0.0 < self.p <= 1.0:
                raise ValueError(f"frozen_lake: p (frozen probability) must be in (0, 1], got {self.p}")
            if not 0.0 < self.success_rate <= 1.0:
                raise ValueError(f"frozen_lake: success_rate must be in (0, 1], got {self.success_rate}")
            if self.max_steps <= 0:
                raise ValueError(f"frozen_lake: max_steps must be positive, got {self.max_steps}")

    def __init__(self, render_mode: str | None = None, tile_size: int = TILE_SIZE, **cfg: Any):
        self.config = build_config(self.Config, cfg, "frozen_lake")
        self._init_render("frozen_lake", render_mode, tile_size)
        self.instructions = (
            "You are playing FrozenLake: walk from the start to the goal G without falling into a hole O. "
            + ("The ice is slippery: you may move perpendicular to the direction you chose.\n" if self.config.is_slippery else "\n")
            + f"The meaning of each symbol in the state is:\n{SYMBOL_LEGEND}\n"
            + ("The line under the map says where each action leads: ice, a hole, the goal, or the edge of the map.\n"
               if self.config.describe_neighbours else "")
            + "Valid actions: " + ", ".join(ACTION_LOOKUP.values())
        )
        self.observation_space = self._space(self.config.size, self.config.size)
        self.lake: GymFrozenLake | None = None
        self.num_steps = 0
        self._done = True

    @property
    def desc(self) -> list[str]:
        """The current map as rows of ``S``/``F``/``H``/``G``."""
        return ["".join(ch.decode() for ch in row) for row in self.lake.desc]

    @property
    def state(self) -> int:
        """gymnasium's state index ``row * ncol + col`` of the player."""
        return int(self.lake.s)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Start on a generated map, or on ``options["map"]`` (a list of rows or a newline-separated string)."""
        super().reset(seed=seed)
        given = (options or {}).get("map")
        c = self.config
        if given is None:
            # A child generator: the map is a function of the seed, and np_random's own stream is untouched.
            map_seed = int(self.np_random.spawn(1)[0].integers(2**32))
            desc = random_map(c.size, c.p, map_seed)
        else:
            desc = parse_map(given)
            space = self._space(len(desc), len(desc[0]))
            if space.max_length > self.observation_space.max_length:
                self.observation_space = space
        self.lake = GymFrozenLake(desc=desc, is_slippery=c.is_slippery, success_rate=c.success_rate)
        self._goal = divmod("".join(desc).index("G"), len(desc[0]))  # (row, col), for progress_reward
        # gymnasium's step draws the slips from lake.np_random: the seeded generator (the same draws as gymnasium's
        # env), or with own_slip_draw one per (seed, group member)
        self.lake.np_random = after_start_rng(self, seed, options, c.own_slip_draw, "frozen_lake")
        self.lake.reset()
        self.num_steps = 0
        self._done = False
        return self._text(), {"success": False}

    def step(self, action):
        action = self.check_action(action)
        if self._done:
            raise ValueError("frozen_lake: episode is over; call reset()")
        before = self.lake.s
        state, reward, terminated, _, gym_info = self.lake.step(TO_GYM_ACTION[action])
        self.num_steps += 1
        success = self._cell(state) == "G"
        truncated = not terminated and self.num_steps >= self.config.max_steps
        self._done = terminated or truncated
        info = {
            "success": success,
            "action_is_valid": True,
            "action_is_effective": int(state) != int(before),
            "prob": float(gym_info["prob"]),
        }
        reward = 1.0 if success else 0.0
        if self.config.progress_reward:
            reward += self.config.progress_reward * (self._goal_distance(before) - self._goal_distance(state))
        return self._text(), reward, bool(terminated), truncated, info

    def _goal_distance(self, state: int) -> int:
        """Manhattan distance from gymnasium state ``state`` to the goal cell."""
        (r, c), (gr, gc) = divmod(int(state), self.lake.ncol), self._goal
        return abs(r - gr) + abs(c - gc)

    def _tile_rows(self) -> list[str] | None:
        """The lake's rows of observation symbols, for :meth:`render_rgb` (None before ``reset``)."""
        return None if self.lake is None else self._text().split("\n")[: self.lake.nrow]

    def _text(self) -> str:
        """The current observation text (empty before the first ``reset``)."""
        if self.lake is None:
            return ""
        ncol = self.lake.ncol
        player = divmod(int(self.lake.s), ncol)
        lines = []
        for r, row in enumerate(self.desc):
            cells = []
            for col, ch in enumerate(row):
                if (r, col) == player:
                    cells.append({"H": "X", "G": "√"}.get(ch, "P"))
                else:
                    cells.append({"S": "_", "F": "_", "H": "O", "G": "G"}[ch])
            lines.append("".join(cells))
        if self.config.describe_neighbours:
            lines.append(self._neighbours(*player))
        return "\n".join(lines)

    def _neighbours(self, row: int, col: int) -> str:
        """``"Left: edge, Down: hole, Right: ice, Up: goal"``: where each action leads from ``(row, col)``."""
        desc = self.desc
        steps = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}
        words = []
        for name, (dr, dc) in steps.items():
            r, c = row + dr, col + dc
            inside = 0 <= r < len(desc) and 0 <= c < len(desc[0])
            words.append(f"{name}: {NEIGHBOUR_WORDS[desc[r][c]] if inside else 'edge'}")
        return ", ".join(words)

    def _space(self, nrow: int, ncol: int) -> spaces.Text:
        if not self.config.describe_neighbours:
            return _observation_space(nrow, ncol)
        longest = ", ".join(f"{name}: edge" for name in ACTION_LOOKUP.values())
        return spaces.Text(min_length=1, max_length=nrow * (ncol + 1) + len(longest), charset=_CHARSET | _NEIGHBOUR_CHARSET)

    def _cell(self, state: int) -> str:
        r, col = divmod(int(state), self.lake.ncol)
        return self.lake.desc[r, col].decode()


def parse_map(given: Any) -> list[str]:
    """Validate a map (rows or a newline-separated string); raise ``ValueError`` naming the problem."""
    if isinstance(given, str):
        rows = [line.strip() for line in given.strip().splitlines() if line.strip()]
    elif isinstance(given, (list, tuple)) and all(isinstance(r, str) for r in given):
        rows = [str(r) for r in given]
    else:
        raise ValueError(f"frozen_lake map: must be a list of row strings, got {given!r}")
    if not rows or not rows[0]:
        raise ValueError(f"frozen_lake map: must be non-empty, got {given!r}")
    lengths = sorted({len(r) for r in rows})
    if len(lengths) > 1:
        raise ValueError(f"frozen_lake map: ragged rows (lengths {lengths}); all rows need the same length")
    if len(rows) > MAX_SIZE or lengths[0] > MAX_SIZE:  # the bound on `size`, for the same reasons (the solver's dense solves)
        raise ValueError(f"frozen_lake map: at most {MAX_SIZE}x{MAX_SIZE}, got {len(rows)}x{lengths[0]}")
    bad = sorted(set("".join(rows)) - set("SFHG"))
    if bad:
        raise ValueError(f"frozen_lake map: unknown characters {bad}; only S, F, H and G are allowed")
    text = "".join(rows)
    for ch in "SG":
        if text.count(ch) != 1:
            raise ValueError(f"frozen_lake map: needs exactly one {ch!r}, found {text.count(ch)}")
    return rows


def _observation_space(nrow: int, ncol: int) -> spaces.Text:
    return spaces.Text(min_length=1, max_length=nrow * (ncol + 1), charset=_CHARSET)


def _transitions(env: Any) -> Any:
    """gymnasium's lake (with its ``P`` table) of a reset ragen FrozenLake env or of a gymnasium FrozenLake env."""
    lake = getattr(env, "lake", None)
    if lake is None:
        lake = getattr(env, "unwrapped", env)
    if not hasattr(lake, "P"):
        raise ValueError(f"frozen_lake solve: expected a reset FrozenLake env, got {env!r}")
    return lake
