"""Infinite-horizon optimal play on a lake: policy iteration (warm-started by value iteration), proper policies
(ones that reach the goal or a hole), and the fastest of the optimal policies."""

from __future__ import annotations

from collections import deque

import numpy as np

from ragen.envs.frozen_lake.model import TIE, LakeModel, _first_best


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
