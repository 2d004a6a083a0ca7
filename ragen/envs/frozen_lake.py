"""FrozenLake with text observations, built on gymnasium's own ``FrozenLakeEnv`` (RAGEN's FrozenLake)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
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
    hole, ``G`` goal, ``X`` player in a hole, ``√`` player on the goal.

    ## Starting State
    The player on ``S``. The map comes from a generator spawned from ``np_random``
    (``np_random.spawn``), so it does not consume ``np_random``'s stream: the slip draws
    are exactly those of ``gymnasium.make("FrozenLake-v1", desc=MAP)`` reset with the
    same seed. With ``own_slip_draw`` the slips come from a generator seeded by the seed and
    ``reset(options={"group_member": j})`` instead: the envs of a group (one seed, so one map)
    each meet their own slips, still reproducibly (:func:`ragen.envs.base.after_start_rng`).

    ## Rewards
    1 on reaching the goal, else 0.

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
    envs share the slips, as they share the seed).

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

        def validate(self) -> None:
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
            "Valid actions: " + ", ".join(ACTION_LOOKUP.values())
        )
        self.observation_space = _observation_space(self.config.size, self.config.size)
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
            space = _observation_space(len(desc), len(desc[0]))
            if space.max_length > self.observation_space.max_length:
                self.observation_space = space
        self.lake = GymFrozenLake(desc=desc, is_slippery=c.is_slippery, success_rate=c.success_rate)
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
        return self._text(), 1.0 if success else 0.0, bool(terminated), truncated, info

    def _tile_rows(self) -> list[str] | None:
        """The lake's rows of observation symbols, for :meth:`render_rgb` (None before ``reset``)."""
        return None if self.lake is None else self._text().split("\n")

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
        return "\n".join(lines)

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


#: Two action values closer than this are a tie (then the infinite-horizon policy's action is kept).
TIE = 1e-12
#: On slippery ice a turn's plan is searched over all open-loop sequences of up to this many moves (4^k of them).
MAX_OPEN_LOOP = 4
#: Most outcomes of one move: the intended direction and, on slippery ice, the two perpendicular ones.
MAX_OUTCOMES = 3
#: Maps of at most this many cells (8x8) back up through the dense table (``32 n^2`` bytes: 131 kB here): one
#: ``(4, n, n)`` matmul instead of three gathers. On 4x4 maps, the common size, the gathers alone made
#: tests/eval/test_optimality.py's slippery-ice estimate test take 32.2 s instead of 14.6 s (12.4 s before the sparse
#: table); larger maps gather.
DENSE_MAX_CELLS = 64


@dataclass(frozen=True)
class LakeModel:
    """gymnasium's transition table ``P`` of one map as sparse arrays (gym action ids 0..3).

    A move has at most :data:`MAX_OUTCOMES` outcomes, so the table is kept as
    ``succ[k, a, s]`` / ``prob[k, a, s]``: the ``k``-th non-terminal cell that action ``a``
    can move ``s`` to, and its probability (outcomes into the same cell summed, sorted by
    cell, padded with cell 0 at probability 0; ``k`` first, so a backup is three whole-array
    multiply-adds). A dense ``(4, n, n)`` table takes ``32 n^2`` bytes (537 MB on a 64x64
    map) and ``4 n^2`` multiplications per backup, which made the expert take ~20 s on a
    slippery 24x24 map; this takes ``O(n)`` of both. ``goal_prob[a, s]`` is the probability
    of landing on the goal (a hole is lost mass). Terminal states (holes, goal) have no
    outcomes: nothing happens after them. :attr:`trans` is the dense table, built on demand
    (for inspecting small maps).
    """

    succ: np.ndarray
    prob: np.ndarray
    goal_prob: np.ndarray
    goal: np.ndarray
    terminal: np.ndarray
    start: int
    #: Every move has one outcome (not slippery, or ``success_rate`` 1).
    deterministic: bool

    @classmethod
    def of(cls, env: Any) -> "LakeModel":
        lake = _transitions(env)
        flat = lake.desc.ravel()
        n = len(flat)
        goal, terminal = flat == b"G", np.isin(flat, (b"G", b"H"))
        succ, prob = np.zeros((MAX_OUTCOMES, 4, n), dtype=np.intp), np.zeros((MAX_OUTCOMES, 4, n))
        goal_prob = np.zeros((4, n))
        deterministic = True
        for s in np.flatnonzero(~terminal):
            for a in range(4):
                outcomes: dict[int, float] = {}  # every cell reached (holes and goal too)
                live: dict[int, float] = {}  # the non-terminal ones
                for p, s2, _, done in lake.P[int(s)][a]:
                    if p <= 0:
                        continue
                    outcomes[int(s2)] = outcomes.get(int(s2), 0.0) + p
                    if goal[s2]:
                        goal_prob[a, s] += p
                    elif not done:
                        live[int(s2)] = live.get(int(s2), 0.0) + p
                for k, s2 in enumerate(sorted(live)):
                    succ[k, a, s], prob[k, a, s] = s2, live[s2]
                deterministic &= len(outcomes) == 1
        start = int(np.flatnonzero(flat == b"S")[0])
        return cls(succ, prob, goal_prob, goal, terminal, start, bool(deterministic))

    @cached_property
    def trans(self) -> np.ndarray:
        """The dense table ``trans[a, s, s2]``: the probability of moving from ``s`` to the non-terminal
        ``s2`` with action ``a`` (``O(n^2)`` memory: for inspecting small maps; the solvers use ``succ``/``prob``)."""
        n = len(self.goal)
        dense = np.zeros((4, n, n))
        a, s = np.indices((4, n))
        for succ, prob in zip(self.succ, self.prob):
            dense[a, s, succ] += prob
        return dense

    @cached_property
    def _trans_t(self) -> np.ndarray:
        """``trans`` with its last two axes swapped, contiguous: ``(4, s2, s)`` for :meth:`expect`'s small-map matmul."""
        return np.ascontiguousarray(self.trans.transpose(0, 2, 1))

    def expect(self, values: np.ndarray) -> np.ndarray:
        """``out[a, ..., s] = sum_s2 trans[a, s, s2] values[..., s2]`` for ``values`` of shape ``(..., n)``."""
        rows = values.reshape(-1, values.shape[-1])  # (R, n): gathering with [:, cells] is ~2x faster than [..., cells]
        if len(self.goal) <= DENSE_MAX_CELLS:  # (R, n) @ (4, n, n) -> (4, R, n): one small matmul beats three gathers
            return np.matmul(rows, self._trans_t).reshape(4, *values.shape)
        total = rows[:, self.succ[0]] * self.prob[0]  # (R, 4, n)
        for succ, prob in zip(self.succ[1:], self.prob[1:]):
            total += rows[:, succ] * prob
        return np.moveaxis(total, 1, 0).reshape(4, *values.shape)

    def backup(self, values: np.ndarray) -> np.ndarray:
        """``q[a, ..., s] = sum_s2 P(s2 | s, a) V(s2)`` for value vectors (shape ``(..., n)``) with ``V(G) = 1`` and
        ``V(hole) = 0``: ``(4, n)`` for one vector, ``(4, R, n)`` for ``R`` of them."""
        goal_prob = self.goal_prob.reshape(4, *(1,) * (values.ndim - 1), -1)
        return goal_prob + self.expect(np.where(self.terminal, 0.0, values))

    def outcomes(self, action: int, state: int) -> np.ndarray:
        """The non-terminal cells ``action`` (a gym id) can move ``state`` to, in increasing order."""
        return self.succ[:, action, state][self.prob[:, action, state] > 0]

    def likeliest(self, action: int, state: int) -> tuple[float, int]:
        """``(probability, cell)`` of the likeliest non-terminal outcome of ``action`` in ``state`` (the lowest
        cell among equals, as ``trans[action, state].argmax()``; ``(0.0, 0)`` when every outcome is terminal)."""
        k = int(self.prob[:, action, state].argmax())
        p = float(self.prob[k, action, state])
        return p, int(self.succ[k, action, state]) if p > 0 else 0


def _first_best(q: np.ndarray, tie: float = TIE) -> np.ndarray:
    """Per state (column), the first action whose value is within ``tie`` (:data:`TIE`) of the best.

    Not ``q.argmax(axis=0)``: actions that tie exactly (mirror-image moves on a symmetric map) come out a
    rounding error apart, in whichever direction the summation order of the backup happens to give, so a
    plain argmax picked between them by float noise. This picks the first, as exact arithmetic would.
    """
    return np.argmax(q >= q.max(axis=0) - tie, axis=0)


#: Value-iteration sweeps (at most) that warm-start :func:`_solve_infinite`'s policy iteration: enough for a good
#: first policy (so policy iteration needs few evaluations), cheap next to one (a sweep is ~0.1 ms at 32x32).
WARM_SWEEPS = 300
#: Policy-iteration rounds (one policy evaluation each) before :func:`_solve_infinite` gives up; ~5-15 are needed.
MAX_POLICY_ROUNDS = 100
#: Two action values closer than this are a tie in :func:`_solve_infinite`'s last, refined rounds (values and
#: backups then carry rounding errors of a few 1e-16).
PRECISE_TIE = 1e-14


def _solve_infinite(model: LakeModel, tol: float = 1e-12, warm_sweeps: int = WARM_SWEEPS) -> tuple[np.ndarray, np.ndarray]:
    """Undiscounted infinite-horizon values (the highest probability of ever reaching G; 0 on holes and G) and an
    optimal policy (gym ids 0..3), exactly (Bellman residual ~1e-15): policy iteration, warm-started by value iteration.

    Value iteration alone converged slowly on big slippery maps: at ``success_rate`` 0.9 on 32x32 it could stop at
    its cap of 100_000 sweeps (12-17 s) still short of ``tol``, its values off by up to ~1e-6. Here:

    1. The live states, those that can reach G at all (:func:`_goal_reachers`); the others have value 0.
    2. At most ``warm_sweeps`` sweeps of value iteration (fewer once a sweep changes nothing by ``tol``), and from
       those values the policy of :func:`_first_best` and :func:`_rank_towards_goal`, made proper on the live
       states (:func:`_proper_policy`). If a sweep changed nothing at all (deterministic ice), the values are a
       fixed point reached from below, the least one, which is the optimum: done.
    3. Policy iteration: evaluate the policy by one linear solve (:func:`_policy_values`), and where another action
       is better by more than :data:`TIE`, take the first best one (:func:`_first_best`; the current action is kept
       on a tie), kept proper (:func:`_keep_proper`, so every system is non-singular). Exactly, every such change
       raises the values, so no policy comes back; the solve's rounding can fake an improvement between tied
       actions, so a change that gains no more than the tie margin, or comes back to an earlier policy, counts as
       none. Once no change is left, the values are refined to ~1e-16 and the rounds go on with the tie margin
       :data:`PRECISE_TIE` (real improvements of 1e-13..1e-12 occur near value 1; missing them moved values by
       up to 4e-7 at ``success_rate`` 0.99) until none is left.
    4. Among the optimal actions (within :data:`PRECISE_TIE` of the best), the policy that ends the episode in the
       fewest expected moves (:func:`_fastest_policy`, from step 3's last policy; from step 2's on deterministic ice).

    Undiscounted, every action that keeps the success probability is "optimal", including
    ones that loop forever (walking into the border), and optimal policies can differ by orders of magnitude in
    how long they take. The start policies are built backwards from the goal: a state gets an optimal action with
    a positive chance of reaching a state that already has one (the classic proper-policy construction for
    maximal reachability, :func:`_rank_towards_goal`). That alone made the returned policy proper, but not fast:
    with its 1e-9 tie margin it could lose up to 1e-9 of value per move, and on slippery 32x32 maps at
    ``success_rate`` 0.9 it needed ~1e10 expected moves (from the start, the goal within 100_000 moves with
    probability 6e-10 / 1e-3 / 3e-9 on seeds 0-2, against values 0.88 / 0.9998 / 0.97); step 4 gives 1.0e4 /
    3.8e4 / 1.1e4 expected moves and 0.8813 / 0.976 / 0.9656 within 100_000 moves, its value the optimum
    within 1e-12.
    """
    n_states = len(model.goal)
    live, ranking = _goal_reachers(model)
    values = np.zeros(n_states)
    delta = np.inf
    for _ in range(warm_sweeps):
        new = model.backup(values).max(axis=0)  # values are 0 on terminal states, as backup assumes
        new[~live] = 0.0  # nothing more to gain on the goal (its reward was counted on arrival), in a hole, or off live
        delta = np.abs(new - values).max()
        values = new
        if delta < tol:
            break
    q = model.backup(values)
    policy = _proper_policy(model, q, values, live, ranking)
    if delta > 0:
        values, precise, margin = _policy_values(model, policy, live), False, TIE
        seen = {policy.tobytes()}
        for _ in range(MAX_POLICY_ROUNDS):
            q = model.backup(values)
            better = live & (q[policy, np.arange(n_states)] < q.max(axis=0) - margin)  # keep the current action on a tie
            if better.any():
                improved = _keep_proper(model, np.where(better, _first_best(q, margin), policy), policy, live)
                if improved.tobytes() not in seen:
                    gained = _policy_values(model, improved, live, refine=precise)
                    # Exactly, a changed action raises its state's value by more than the margin (the gain is
                    # (I - P)^-1 >= I times the q gap); gaining no more, the change was between tied actions.
                    if (gained - values).max() > margin:
                        policy, values = improved, gained
                        seen.add(policy.tobytes())
                        continue
            if precise:
                break
            values, precise, margin = _policy_values(model, policy, live, refine=True), True, PRECISE_TIE
            seen = {policy.tobytes()}  # the rough rounds may have taken a tied or slightly worse action: revisit them
        else:
            raise RuntimeError(f"frozen_lake solve: policy iteration did not settle in {MAX_POLICY_ROUNDS} rounds")
        q = model.backup(values)  # the settled values'
    policy = np.where(live, policy, _first_best(q))  # off the live states every action has value 0: the first
    return values, _fastest_policy(model, q, live, policy)


def _ranked_policy(model: LakeModel, q: np.ndarray, values: np.ndarray) -> np.ndarray:
    """A proper policy of ``q``/``values`` (the start of the searches of :func:`_solve_infinite`): the first best
    action (:func:`_first_best`), then, where that has no chance of progress, an equally good one that has
    (:func:`_rank_towards_goal`)."""
    policy = _first_best(q)
    _rank_towards_goal(model, q, values, policy)
    return policy


def _goal_reachers(model: LakeModel, policy: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(live, ranking)``: per state, whether it has a positive chance of ever reaching G under ``policy`` (None:
    under some policy), and an action (gym id) to do so: one with a positive chance of moving onto G or to a live
    state found earlier (so these actions reach G with a positive chance from every live state: a proper policy
    on them). A breadth-first search backwards from G over the positive-probability moves."""
    n_states = len(model.goal)
    chosen = np.ones((4, n_states), dtype=bool) if policy is None else np.arange(4)[:, None] == policy
    chosen &= ~model.terminal
    k, a, s = np.nonzero((model.prob > 0) & chosen)
    before: list[list[tuple[int, int]]] = [[] for _ in range(n_states)]  # before[s2]: the (s, a) that can move to s2
    for s2, s1, a1 in zip(model.succ[k, a, s].tolist(), s.tolist(), a.tolist()):
        before[s2].append((s1, a1))
    live, ranking = [False] * n_states, [0] * n_states
    frontier: deque[int] = deque()
    for s1, a1 in np.argwhere(((model.goal_prob > 0) & chosen).T).tolist():  # by state, then action
        if not live[s1]:
            live[s1], ranking[s1] = True, a1
            frontier.append(s1)
    while frontier:
        for s1, a1 in before[frontier.popleft()]:
            if not live[s1]:
                live[s1], ranking[s1] = True, a1
                frontier.append(s1)
    return np.array(live, dtype=bool), np.array(ranking, dtype=np.intp)


def _proper_policy(model: LakeModel, q: np.ndarray, values: np.ndarray, live: np.ndarray, ranking: np.ndarray) -> np.ndarray:
    """The policy :func:`_rank_towards_goal` builds from (not yet exact) ``q``/``values``, made proper on ``live``:
    where it has no chance of reaching G (states it leaves unranked, e.g. with values still below its 1e-9)
    the action of ``ranking`` (:func:`_goal_reachers`). Proper: by induction over the order ``ranking`` found the
    states in, each such state reaches G or an earlier one of them with a positive chance, and the others reach G."""
    policy = _ranked_policy(model, q, values)
    lost = live & ~_goal_reachers(model, policy)[0]
    policy[lost] = ranking[lost]
    return policy


def _keep_proper(model: LakeModel, policy: np.ndarray, previous: np.ndarray, live: np.ndarray) -> np.ndarray:
    """``policy`` (an improvement of the proper ``previous``), with ``previous``'s action back where it cannot reach
    G any more. Never needed in exact arithmetic: let ``U`` be the live states from which the improved policy
    cannot reach G, and ``M > 0`` (``previous`` is proper) the highest value ``v`` of ``previous`` on ``U``. From a
    state of ``U`` with value ``M`` the improved action moves only within ``U`` or to value 0 (a hole, a dead
    state), so its ``q`` is at most ``M``: not better by more than the tie margin, so unchanged, and then (as
    ``v = q`` of ``previous``'s action) it moves only to states of ``U`` with value ``M``. So those states are
    closed under ``previous``, which could not reach G from them: their value would be 0, not ``M``. Rounding
    blurs "value ``M``" along long chains, hence the check. Restoring ``previous`` on ``U`` gives a proper policy
    (from ``U`` its actions reach G, or a state outside ``U``, whose own way to G avoids ``U``), still no worse
    than ``previous`` in every state."""
    lost = live & ~_goal_reachers(model, policy)[0]
    if lost.any():
        policy = np.where(lost, previous, policy)
    return policy


def _policy_values(model: LakeModel, policy: np.ndarray, live: np.ndarray, refine: bool = False) -> np.ndarray:
    """The probability of ever reaching G under ``policy`` (gym ids): the solution of the linear system
    ``(I - P) v = g`` over the ``live`` states (``P``: the policy's moves among them, ``g``: its chance of moving
    onto G; every other state has value 0), by a dense solve (``8 m^2`` bytes for ``m`` live states: 8 MB at 32x32).

    Non-singular when ``policy`` is proper on ``live`` (from every live state it reaches G with a positive chance):
    then within ``m`` moves it leaves the live states (for G, a hole or a dead state) with a positive chance from
    each of them, so every row of ``P^m`` sums to less than 1, ``P``'s spectral radius is below 1 and
    ``(I - P)^-1 = I + P + P^2 + ...`` exists (and is >= 0, so ``v`` is too). An improper policy (a loop with no way
    out, e.g. walking into the border forever) has an eigenvalue 1 there: singular, which is why the policies
    evaluated here are kept proper (:func:`_proper_policy`, :func:`_keep_proper`).

    The solve's error grows with the policy's expected number of moves (``(I - P)^-1``'s row sums): ~1e-12 for
    the ~1e5 of the optimal policies at ``success_rate`` 0.9 on 32x32, but ~1e-7 for the ~1e9 that a few maps
    need at 0.99. With ``refine``, iterative refinement removes it: the residual ``g - (I - P) v`` in extended
    precision (``np.longdouble``: 80-bit on x86; where it is plain double, refining gains less), solved for a
    correction, until a correction is at most 1e-12 (what is left after it is about the solve's relative error,
    ~1e-16 times the expected moves, times that correction): one or two more solves."""
    values = np.zeros(len(model.goal))
    cells, system, goal, moves = _policy_system(model, policy, live)
    if not len(cells):
        return values
    try:
        solved = np.linalg.solve(system, goal)
        for _ in range(5 if refine else 0):
            wide = solved.astype(np.longdouble)
            residual = goal.astype(np.longdouble) - wide
            for at, to, p in moves:
                residual[at] += p * wide[to]  # the rows of one slot are distinct
            correction = np.linalg.solve(system, residual.astype(float))
            solved = solved + correction
            if np.abs(correction).max() <= 1e-12:
                break
    except np.linalg.LinAlgError as err:
        raise RuntimeError("frozen_lake solve: the policy's linear system is singular: the policy is not proper "
                           "(some live state cannot reach the goal under it); this is a bug") from err
    values[cells] = np.clip(solved, 0.0, 1.0)
    return values


def _policy_system(model: LakeModel, policy: np.ndarray, live: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, list]:
    """``(cells, I - P, g, moves)`` of ``policy`` over the ``live`` states (:func:`_policy_values`): ``cells`` the
    live states (row ``i`` is ``cells[i]``), ``P`` the policy's moves among them, ``g`` its chance of moving onto G,
    and ``moves`` per outcome slot the ``(rows, columns, probabilities)`` of ``P`` (probabilities in ``longdouble``,
    for the residuals of iterative refinement)."""
    n_states = len(model.goal)
    cells = np.flatnonzero(live)
    row_of = np.full(n_states, -1)
    row_of[cells] = np.arange(len(cells))
    actions = policy[cells]
    goal = model.goal_prob[actions, cells]
    system = np.eye(len(cells))
    rows = np.arange(len(cells))
    moves = []  # per outcome slot: (rows, columns, probabilities) of the moves among live states
    for succ, prob in zip(model.succ, model.prob):  # one outcome slot at a time: no cell twice in a statement
        to, p = row_of[succ[actions, cells]], prob[actions, cells]
        on = (to >= 0) & (p > 0)  # a move off the live states is lost mass, like a hole
        system[rows[on], to[on]] -= p[on]
        moves.append((rows[on], to[on], p[on].astype(np.longdouble)))
    return cells, system, goal, moves


def _expected_moves(model: LakeModel, policy: np.ndarray, live: np.ndarray) -> np.ndarray:
    """Per state, the expected number of moves ``policy`` (proper on ``live``) makes before the episode ends or it
    leaves the ``live`` states (0 off them): the solution of ``(I - P) t = 1``, the system of :func:`_policy_values`
    with another right-hand side (non-singular for the same reason; the solution is the row sums of
    ``(I - P)^-1``)."""
    moves = np.zeros(len(model.goal))
    cells, system, _, _ = _policy_system(model, policy, live)
    if len(cells):
        try:
            moves[cells] = np.linalg.solve(system, np.ones(len(cells)))
        except np.linalg.LinAlgError as err:
            raise RuntimeError("frozen_lake solve: the policy's linear system is singular: the policy is not proper "
                               "(some live state cannot reach the goal under it); this is a bug") from err
    return moves


#: Two expected move counts within this fraction of each other are a tie in :func:`_fastest_policy` (the solves
#: carry relative errors of ~1e-16 times the expected moves; a gain of one part in 1e9 is of no use anyway).
MOVES_TIE = 1e-9
#: Policy-iteration rounds (one expected-moves solve each) of :func:`_fastest_policy` before it keeps what it has
#: (every round's policy is optimal in value and proper; on 32x32 maps 0-5 rounds were needed).
MAX_MOVES_ROUNDS = 100


def _fastest_policy(model: LakeModel, q: np.ndarray, live: np.ndarray, policy: np.ndarray) -> np.ndarray:
    """Among the optimal actions, those that end the episode soonest: the second criterion of the returned policy.

    Undiscounted, the optimal actions (``q`` within :data:`PRECISE_TIE` of the best) often tie or nearly tie (the
    values of a state's neighbours near 1, walking into a border), and which of them is taken decides how long the
    policy takes: picking among them by any fixed rule (as :func:`_rank_towards_goal` does, which only asks for some
    chance of progress) built policies that needed ~1e10 expected moves on slippery 32x32 maps, each move losing up
    to its tie margin of value. So, over the MDP restricted to those actions, this minimises the expected number of
    moves until the episode ends (G or a hole; a move off the live states counts as an end too: those have value 0,
    so optimal actions of a live state avoid them), a stochastic shortest path: policy iteration from ``policy``
    (proper on ``live``, its actions counted among the optimal ones: :func:`_solve_infinite`'s last), each round
    one solve of :func:`_expected_moves` ``t`` and, where an optimal action's ``1 + sum_s2 P(s2 | s, a) t(s2)`` is
    lower by more than :data:`MOVES_TIE` (relatively), the first such lowest one. Exactly, each round lowers ``t``
    and keeps the policy proper (costs are positive, so an improper policy would have infinite cost), so no policy
    comes back and it ends at the fastest optimal policy; rounding can blur both, hence :func:`_keep_proper` and a
    round that gains nothing or comes back ends it. Last, each live state takes the first action (gym order) within
    :data:`MOVES_TIE` of its fastest (exactly, any action greedy for the optimal ``t`` is optimal, so proper).

    The value lost against ``q``'s values is at most the expected moves times the tie margin (``(I - P)^-1 d``, ``d``
    each state's deficit ``<= PRECISE_TIE``). Measured: up to 4e4 expected moves on 32x32 maps at ``success_rate``
    0.9 (3e5 on one 16x16 map) and 2e7 at 0.99 (the last bits of success probability take that long), the loss
    at most 3e-13.
    """
    n_states = len(model.goal)
    idx = np.arange(n_states)
    optimal = q >= q.max(axis=0) - PRECISE_TIE
    optimal[policy, idx] = True

    def fastest(moves: np.ndarray) -> np.ndarray:
        """Per action and state, whether the action is optimal and within MOVES_TIE of the fewest expected moves."""
        cost = np.where(optimal, 1.0 + model.expect(moves), np.inf)  # moves is 0 off the live states
        return cost <= cost.min(axis=0) * (1.0 + MOVES_TIE)

    moves = _expected_moves(model, policy, live)
    seen = {policy.tobytes()}
    for _ in range(MAX_MOVES_ROUNDS):
        near = fastest(moves)
        better = live & ~near[policy, idx]  # the current action is kept on a tie
        if not better.any():
            break
        improved = _keep_proper(model, np.where(better, np.argmax(near, axis=0), policy), policy, live)
        if improved.tobytes() in seen:
            break
        gained = _expected_moves(model, improved, live)
        if not (gained < moves * (1.0 - MOVES_TIE)).any():  # exactly, every changed state gains more than the tie
            break
        policy, moves = improved, gained
        seen.add(policy.tobytes())
    first = np.where(live, np.argmax(fastest(moves), axis=0), policy)
    return _keep_proper(model, first, policy, live) if (first != policy).any() else policy


def _rank_towards_goal(model: LakeModel, q: np.ndarray, values: np.ndarray, policy: np.ndarray) -> None:
    """Give every state that can reach the goal an optimal action with a chance of reaching an already ranked
    state (the goal first), in place: passes over the states in index order until none changes.

    A state ranked early in a pass already counts for the states after it in the same pass. The checks are
    plain Python over precomputed lists: scanning a dense row of ``n`` cells per check took ~1 s at 24x24.
    """
    n_states = len(model.goal)
    ranked = model.goal.tolist()
    keeps = (q >= values - 1e-9).T.tolist()  # keeps[s][a]: action a keeps s's success probability
    to_goal = (model.goal_prob > 0).T.tolist()
    nexts = [[model.outcomes(a, s).tolist() for a in range(4)] for s in range(n_states)]
    todo = [s for s in range(n_states) if not model.terminal[s] and values[s] > 1e-9]
    changed = True
    while changed:
        changed = False
        for s in todo:
            for a in range(4):
                if keeps[s][a] and (to_goal[s][a] or any(ranked[s2] for s2 in nexts[s][a])):
                    policy[s] = a
                    ranked[s] = True
                    changed = True
                    break
        todo = [s for s in todo if not ranked[s]]


class LakeSolver:
    """Optimal play on one map: the infinite-horizon policy, the finite-horizon one, and turn plans.

    *Finite horizon* (``k`` moves left), by backward induction over (moves remaining, state),
    exact for gymnasium's ``P``::

        V_0(s) = 1[s = G]
        V_k(s) = max_a sum_s2 P(s2 | s, a) V_{k-1}(s2)      (G and holes absorbing: V_k(G) = 1, V_k(H) = 0)
        pi_k(s) = an argmax of the same sum

    ``V_k(s)`` is the highest probability of reaching the goal within ``k`` moves from ``s``
    that any policy achieves (which may depend on the moves left, unlike the infinite-horizon
    policy: with a few moves left it takes risks the unlimited policy never takes). Ties
    keep the infinite-horizon action, so with zero chance left the policy still heads
    safely for the goal, and with many moves left it coincides with :func:`solve`'s; other
    ties go to the first tied action in gym order (Left, Down, Right, Up; :func:`_first_best`).

    *Turns of several moves* (slippery ice, the agent sees the state only at the start of
    each turn and answers up to ``m`` moves at once): the best value with ``j`` turns and
    ``n`` moves left is, over open-loop sequences ``w`` of ``1..min(m, n)`` moves,

        U(j, n)(s) = max_w [ P(reach G during w | s) + sum_s2 P(end the turn on s2 | s, w) U(j-1, n-|w|)(s2) ]

    with ``U(0, n) = U(j, 0) = V_0``, and ``U(j, n) = V_n`` once ``j >= n`` (one move per turn
    is then possible, and nothing does better than closed-loop play). :meth:`turn_plan` is
    the maximising ``w`` (longest first among ties). Open-loop sequences are searched up to
    :data:`MAX_OPEN_LOOP` moves.
    """

    def __init__(self, env: Any):
        self.model = LakeModel.of(env)
        self.infinite_values, policy = _solve_infinite(self.model)
        self.infinite_policy = policy  # gym ids 0..3
        v0 = self.model.goal.astype(float)
        self._values = [v0]  # _values[k] = V_k
        self._actions = [policy.copy()]  # _actions[k][s] = pi_k(s), gym ids; row 0: the infinite-horizon action
        self._turn: dict[tuple[int, int, int], np.ndarray] = {}
        self._sequences: dict[int, list[tuple[int, ...]]] = {}

    # -- one move per decision -------------------------------------------------------------

    def _extend(self, horizon: int) -> None:
        while len(self._values) <= horizon:
            q = self.model.backup(self._values[-1])
            best = q.max(axis=0)
            keep = self.infinite_policy
            tied = q[keep, np.arange(q.shape[1])] >= best - TIE
            self._actions.append(np.where(tied, keep, _first_best(q)))
            values = best.copy()
            values[self.model.terminal] = 0.0
            values[self.model.goal] = 1.0
            self._values.append(values)

    def values(self, moves_left: int) -> np.ndarray:
        """``V_k`` for ``k = moves_left`` (a copy): per state, the best success probability within ``k`` moves."""
        k = max(0, int(moves_left))
        self._extend(k)
        return self._values[k].copy()

    def q_values(self, moves_left: int) -> np.ndarray:
        """``Q_k[a, s] = sum_s2 P(s2 | s, a) V_{k-1}(s2)`` (gym action ids ``a``), ``k = moves_left >= 1``."""
        return self.model.backup(self.values(int(moves_left) - 1))

    def action(self, state: int, moves_left: int | None = None) -> int:
        """The optimal action id (1..4) in ``state`` with ``moves_left`` moves left (None: infinite horizon)."""
        if moves_left is None:
            return int(self.infinite_policy[state]) + 1
        k = max(0, int(moves_left))
        self._extend(k)
        return int(self._actions[k][state]) + 1

    def path(self, state: int, moves_left: int | None = None, max_len: int = 1000) -> list[int]:
        """The moves the policy makes from ``state`` following each move's most likely outcome
        (the whole plan on deterministic ice); stops on a hole, the goal, a repeated state or no moves left."""
        model, out, seen = self.model, [], set()
        left = max_len if moves_left is None else min(int(moves_left), max_len)
        while left > 0 and not model.terminal[state] and state not in seen:
            seen.add(state)
            action = self.action(state, None if moves_left is None else left)
            out.append(action)
            likeliest, cell = model.likeliest(action - 1, state)
            if model.goal_prob[action - 1, state] >= likeliest:
                break  # most likely lands on the goal
            state = cell
            left -= 1
        return out

    # -- turns of several moves (open loop within a turn) ----------------------------------

    def _sequences_of(self, length: int) -> list[tuple[int, ...]]:
        """All sequences of ``length`` gym actions, first action slowest: ``(0, 0), (0, 1), ..., (3, 3)``."""
        if length not in self._sequences:
            rest = self._sequences_of(length - 1) if length > 1 else [()]
            self._sequences[length] = [(a,) + r for a in range(4) for r in rest]
        return self._sequences[length]

    def _sequence_scores(self, length: int, after: np.ndarray) -> np.ndarray:
        """``P(reach G during w | s) + sum_s2 P(end w on s2 | s) after(s2)`` for every sequence ``w`` of
        :meth:`_sequences_of` ``(length)``, shape ``(4**length, n_states)``.

        Built from the last move backwards, one sparse backup per move (a sequence ``(a,) + w`` scores
        ``backup`` of ``w``'s scores at ``a``), so it never forms an ``n x n`` matrix per sequence: those took
        ``4**length * 8 n^2`` bytes (680 MB for 4-move turns on a 24x24 map).
        """
        scores = np.asarray(after, dtype=float)[None]  # the empty sequence; backup zeroes the terminal states
        for _ in range(length):
            scores = self.model.backup(scores).reshape(-1, scores.shape[-1])  # (4, R, n): row a * R + r
        return scores

    def _turn_scores(self, turns_left: int, moves_left: int, per_turn: int) -> tuple[list[tuple[int, ...]], np.ndarray]:
        """Every candidate sequence of this turn and its value per start state, ``(len(seqs), n_states)``."""
        seqs_all, scores = [], []
        for length in range(min(per_turn, moves_left, MAX_OPEN_LOOP), 0, -1):
            after = self.turn_values(turns_left - 1, moves_left - length, per_turn)
            seqs_all += self._sequences_of(length)
            scores.append(self._sequence_scores(length, after))
        return seqs_all, np.concatenate(scores)

    def turn_values(self, turns_left: int, moves_left: int, per_turn: int) -> np.ndarray:
        """``U(j, n)``: per state, the best success probability with ``j`` turns of up to ``per_turn``
        moves each and ``n`` moves in all, seeing the state only at turn starts (class docstring)."""
        j, m = max(0, int(turns_left)), max(1, int(per_turn))
        n = min(max(0, int(moves_left)), j * m)
        if j >= n:
            return self.values(n)
        key = (j, n, m)
        if key not in self._turn:
            values = self._turn_scores(j, n, m)[1].max(axis=0)
            values[self.model.terminal] = 0.0
            values[self.model.goal] = 1.0
            self._turn[key] = values
        return self._turn[key].copy()

    def turn_plan(self, state: int, turns_left: int, moves_left: int, per_turn: int) -> list[int]:
        """This turn's optimal answer (action ids 1..4) from ``state``: one move when one move per turn
        is affordable (``turns_left >= moves_left``), else the best open-loop sequence of ``U``."""
        j, m = max(1, int(turns_left)), max(1, int(per_turn))
        n = min(max(1, int(moves_left)), j * m)
        if m == 1 or j >= n:
            return [self.action(state, n)]
        seqs, scores = self._turn_scores(j, n, m)
        column = scores[:, state]
        tied = np.flatnonzero(column >= column.max() - TIE)
        longest = max(len(seqs[i]) for i in tied)
        tied = [int(i) for i in tied if len(seqs[i]) == longest]  # ties: use every slot the turn allows...
        first = self.action(state, n) - 1  # ...and prefer opening with the closed-loop action
        pick = next((i for i in tied if seqs[i][0] == first), tied[0])
        return [a + 1 for a in seqs[pick]]


def solve(env: Any) -> dict[int, int]:
    """An optimal policy ``{state: action_id}`` (ids 1..4) for every non-terminal state.

    Policy iteration over gymnasium's transition table ``P`` (:func:`_solve_infinite`), undiscounted: it maximises
    the probability of *ever* reaching the goal (infinite horizon; ``max_steps`` is ignored).
    Among equally good actions (within 1e-14) it takes those that end the episode in the fewest expected moves
    (:func:`_fastest_policy`), and among equally fast ones (within a relative 1e-9) the first in gym order (Left,
    Down, Right, Up). So the policy really attains that probability (up to ~1e-14 per expected move: within
    1e-12 on slippery 32x32 maps at ``success_rate`` 0.9), and no optimal policy ends the episode in fewer expected
    moves (it never loops forever against a border; from the start of a slippery 32x32 map at 0.9, seed 0, ~1.0e4
    expected moves: the goal within 100_000 moves with probability 0.8813 of its 0.88135). Under a move cap this
    policy is not optimal (it never trades success probability for speed): see :func:`solve_finite`.
    """
    model = LakeModel.of(env)
    _, policy = _solve_infinite(model)
    return {s: int(policy[s]) + 1 for s in range(len(model.goal)) if not model.terminal[s]}


def solve_finite(env: Any, horizon: int) -> dict[int, dict[int, int]]:
    """The optimal policy within ``horizon`` moves: ``{k: {state: action_id}}`` for ``k = 1..horizon``
    moves left, by backward induction (:class:`LakeSolver`):
    ``V_k(s) = max_a sum_s2 P(s2 | s, a) V_{k-1}(s2)``, ``V_0 = 1[goal]``."""
    solver = LakeSolver(env)
    live = np.flatnonzero(~solver.model.terminal)
    return {k: {int(s): solver.action(int(s), k) for s in live} for k in range(1, int(horizon) + 1)}


def success_probability(env: Any, horizon: int | None = None) -> float:
    """The best probability of reaching the goal from the start.

    ``horizon=None``: undiscounted, infinite horizon (the value of :func:`solve`'s policy).
    ``horizon=N``: within ``N`` moves (e.g. the env's ``max_steps``, or an episode's move
    budget), the finite-horizon optimum ``V_N(start)`` of backward induction,
    ``V_k(s) = max_a sum_s2 P(s2 | s, a) V_{k-1}(s2)``, ``V_0 = 1[goal]`` (see
    :class:`LakeSolver`). It is >= :func:`policy_success_probability` of the infinite-horizon
    policy within the same ``N``, usually strictly on slippery ice.
    """
    solver = LakeSolver(env)
    start = solver.model.start
    if horizon is None:
        return float(solver.infinite_values[start])
    return float(solver.values(int(horizon))[start])


def turn_success_probability(env: Any, turns: int, actions_per_turn: int, max_actions: int | None = None) -> float:
    """The best success probability with ``turns`` turns of up to ``actions_per_turn`` moves each (at
    most ``max_actions`` in all), when the state is seen only at the start of each turn (``U`` of
    :class:`LakeSolver`). Equal to ``success_probability(env, turns)`` with one action per turn."""
    solver = LakeSolver(env)
    moves = turns * actions_per_turn if max_actions is None else min(max_actions, turns * actions_per_turn)
    return float(solver.turn_values(turns, moves, actions_per_turn)[solver.model.start])


def policy_success_probability(env: Any, horizon: int, policy: dict[int, int] | None = None) -> float:
    """Exact probability that a stationary ``policy`` (default :func:`solve`'s) reaches the goal
    within ``horizon`` moves, by propagating the state distribution ``horizon`` steps."""
    model = LakeModel.of(env)
    if policy is None:
        _, gym_policy = _solve_infinite(model)
    else:
        gym_policy = np.zeros(len(model.goal), dtype=int)
        for s, a in policy.items():
            gym_policy[s] = a - 1
    n_states = len(model.goal)
    idx = np.arange(n_states)
    succ, prob = model.succ[:, gym_policy, idx], model.prob[:, gym_policy, idx]  # (MAX_OUTCOMES, n): the policy's moves
    goal = model.goal_prob[gym_policy, idx]
    dist = np.zeros(n_states)
    dist[model.start] = 1.0
    reached = 0.0
    for _ in range(int(horizon)):
        reached += float(dist @ goal)
        dist = np.bincount(succ.ravel(), weights=(dist * prob).ravel(), minlength=n_states)
    return float(reached)
