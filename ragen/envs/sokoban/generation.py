"""Random solvable rooms by reverse play, following gym-sokoban's ``generate_room``.

1. Carve a connected floor out of a walled grid with a random walk that stamps small masks.
2. Put the player and the targets on random floor cells; every box starts on its target.
3. Play backwards: the player walks and may *pull* the box behind it. A breadth-first search
   over ``(player, boxes)`` states explores every position within ``search_depth`` moves and
   keeps the best-scoring one. Each pull is undone by a push, so the result is solvable.

The score is gym-sokoban's: ``pulls * sum of box-to-own-target Manhattan distances``, and 0
while any box sits on a target. A try whose best score is 0 (no box could be moved off the
targets) is discarded. So is a try whose boxes cannot all be pulled off their targets within
``search_depth`` moves (:func:`min_pull_moves`, a lower bound), before the search: it could only
have found nothing, and the search draws nothing from the generator, so the rooms are the same.

Cells are flat indices ``row * width + col`` inside this module, so a move is one addition.
"""

from __future__ import annotations

import numpy as np

from ragen.envs.sokoban.room import Room

#: Floor masks stamped around the walker, as (row, col) offsets (gym-sokoban's five 3x3 masks).
MASKS = (
    ((0, -1), (0, 0), (0, 1)),
    ((-1, 0), (0, 0), (1, 0)),
    ((0, -1), (0, 0), (1, 0)),
    ((0, -1), (0, 0), (1, -1), (1, 0)),
    ((0, 0), (0, 1), (1, 0)),
)
WALK_DIRECTIONS = ((1, 0), (0, 1), (-1, 0), (0, -1))
P_CHANGE_DIRECTION = 0.35
#: Cap on reverse-play states per try, so big rooms with many boxes stay fast (gym-sokoban: 300000).
MAX_REVERSE_STATES = 100_000
#: Work cap of :func:`min_pull_moves`' search over orders of boxes (states expanded times boxes); past it, the
#: cheaper bounds stand alone (about 10 ms of work: eight boxes rarely reach it).
MAX_BOUND_WORK = 20_000


def generate_room(
    rng: np.random.Generator,
    dim_room: tuple[int, int],
    num_boxes: int,
    search_depth: int,
    max_tries: int,
) -> Room:
    """A random solvable room with every box off the targets; ``ValueError`` after ``max_tries`` failed tries.

    A try whose boxes cannot all be pulled off their targets within ``search_depth`` moves (:func:`min_pull_moves`)
    is dropped without the reverse-play search, which could only have found nothing: the random draws, and so every
    room generated, are the same as with the search.
    """
    height, width = dim_room
    walk_steps = int(1.7 * (height + width))
    too_far = 0
    for _ in range(max_tries):
        floor = carve_floor(rng, dim_room, walk_steps)
        if len(floor) <= num_boxes:
            continue
        picks = rng.choice(len(floor), size=num_boxes + 1, replace=False).tolist()
        player, targets = floor[picks[0]], [floor[i] for i in picks[1:]]
        floor_set = set(floor)
        if min_pull_moves(floor_set, player, targets, width, search_depth) > search_depth:
            too_far += 1
            continue
        found = reverse_play(floor_set, player, targets, width, search_depth)
        if found is not None:
            end_player, boxes = found
            return _to_room(dim_room, floor, targets, boxes, end_player)
    raise ValueError(
        f"sokoban: could not generate a {height}x{width} room with {num_boxes} box(es) in {max_tries} tries "
        f"(in {too_far} of them the boxes could not all be pulled off their targets within "
        f"search_depth={search_depth} moves); use fewer boxes (num_boxes={num_boxes}), a larger search_depth, "
        f"another dim_room or more max_generation_tries (now {max_tries})"
    )


def carve_floor(rng: np.random.Generator, dim_room: tuple[int, int], num_steps: int) -> list[int]:
    """Sorted flat indices of the floor carved by a random walk inside the wall border."""
    height, width = dim_room
    change = (rng.random(num_steps) < P_CHANGE_DIRECTION).tolist()
    directions = rng.integers(len(WALK_DIRECTIONS), size=num_steps + 1).tolist()
    masks = rng.integers(len(MASKS), size=num_steps).tolist()
    row, col = (int(x) for x in rng.integers(1, (height - 1, width - 1)))
    d_row, d_col = WALK_DIRECTIONS[directions[0]]
    floor = set()
    for step in range(num_steps):
        if change[step]:
            d_row, d_col = WALK_DIRECTIONS[directions[step + 1]]
        row = min(max(row + d_row, 1), height - 2)
        col = min(max(col + d_col, 1), width - 2)
        for m_row, m_col in MASKS[masks[step]]:
            r, c = row + m_row, col + m_col
            if 0 < r < height - 1 and 0 < c < width - 1:
                floor.add(r * width + c)
    return sorted(floor)


def reverse_play(
    floor: set[int], player: int, targets: list[int], width: int, search_depth: int
) -> tuple[int, tuple[int, ...]] | None:
    """Best ``(player, boxes)`` reachable by at most ``search_depth`` reverse moves, or None if its score is 0.

    ``boxes[i]`` is the box that started on ``targets[i]``. States are deduplicated on (player, set of boxes): the
    first one reached in breadth-first order (moves tried Up, Down, Left, Right; a plain step before its pull) is
    kept, the first state of the best score wins, and the search stops after the level where it has seen
    :data:`MAX_REVERSE_STATES` states. A set of boxes is a bitmask of cells here, mapped to the player cells seen
    with it.
    """
    offsets = (-width, width, -1, 1)
    is_floor = bytearray(max(floor) + 2 * width + 2)  # every cell a move can name
    for cell in floor:
        is_floor[cell] = 1
    target_mask = _mask(targets)
    target_rc = [divmod(t, width) for t in targets]
    seen = {target_mask: {player}}  # box mask -> player cells
    num_seen = 1
    frontier = [(player, tuple(targets), target_mask, 0)]
    best, best_score = None, 0
    for _ in range(search_depth):
        next_frontier = []
        append = next_frontier.append
        for player, boxes, occupied, pulls in frontier:
            players = seen[occupied]
            for offset in offsets:
                dest = player + offset
                if not is_floor[dest] or occupied >> dest & 1:
                    continue
                if dest not in players:
                    players.add(dest)
                    num_seen += 1
                    append((dest, boxes, occupied, pulls))
                source = player - offset
                if not occupied >> source & 1:
                    continue
                pulled_mask = occupied ^ (1 << source | 1 << player)
                pulled_players = seen.get(pulled_mask)
                if pulled_players is None:
                    seen[pulled_mask] = {dest}
                elif dest in pulled_players:
                    continue
                else:
                    pulled_players.add(dest)
                num_seen += 1
                pulled = tuple(player if b == source else b for b in boxes)
                append((dest, pulled, pulled_mask, pulls + 1))
                if pulled_mask & target_mask:
                    continue  # a box on a target scores 0
                score = (pulls + 1) * _displacement(pulled, target_rc, width)
                if score > best_score:
                    best, best_score = (dest, pulled), score
        frontier = next_frontier
        if not frontier or num_seen >= MAX_REVERSE_STATES:
            break
    return best


def _mask(cells) -> int:
    mask = 0
    for cell in cells:
        mask |= 1 << cell
    return mask


def _displacement(boxes: tuple[int, ...], target_rc: list, width: int) -> int:
    """Total Manhattan distance of each box from its own target."""
    total = 0
    for box, (t_row, t_col) in zip(boxes, target_rc):
        row, col = divmod(box, width)
        total += abs(row - t_row) + abs(col - t_col)
    return total


def min_pull_moves(floor: set[int], player: int, targets: list[int], width: int, limit: int) -> int:
    """A lower bound on the reverse moves before every box has been pulled off its target at least once.

    A room scores 0 while any box is on a target, so :func:`reverse_play` finds nothing when this exceeds its
    ``search_depth``. A box's first pull is from its target ``t``: the player stands on ``t + d`` and steps to
    ``t + 2d`` (both floor), one move. Before, between and after those pulls the player walks, at least the floor
    distance with the boxes ignored. Three bounds, each at most the moves of the best order of first pulls: the
    farthest single pull; one move per box plus a minimum spanning tree over the start and the boxes (the walk
    between two consecutive first pulls is at least their edge); and, while that takes at most
    :data:`MAX_BOUND_WORK` steps, the cheapest order itself (a search over subsets of boxes, small for a handful of
    them). Any answer above ``limit`` is reported as ``limit + 1``.
    """
    too_far = limit + 1
    if len(targets) > limit:
        return too_far
    offsets = (-width, width, -1, 1)
    pulls = []  # per target: its (stand, land) cell pairs
    for t in targets:
        options = [(t + d, t + 2 * d) for d in offsets if t + d in floor and t + 2 * d in floor]
        if not options:
            return too_far  # the box can never move: a corner or a corridor's end
        pulls.append(options)
    start = _floor_distances(floor, player, offsets)
    first = [min(start.get(stand, too_far) for stand, _ in options) for options in pulls]
    if max(first) + 1 > limit:
        return too_far
    lands = {land: _floor_distances(floor, land, offsets) for options in pulls for _, land in options}
    n = len(pulls)
    # edge[i][j]: the shortest walk from a landing cell of box i to a standing cell of box j, either way round.
    edge = [[0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            edge[i][j] = edge[j][i] = min(
                min(lands[land].get(stand, too_far) for _, land in pulls[a] for stand, _ in pulls[b])
                for a, b in ((i, j), (j, i))
            )
    # Prim's minimum spanning tree over the start (its edges: ``first``) and the n boxes.
    tree, reach, left = 0, list(first), set(range(n))
    while left:
        nearest = min(left, key=reach.__getitem__)
        tree += reach[nearest]
        left.discard(nearest)
        for j in left:
            reach[j] = min(reach[j], edge[nearest][j])
    if tree + n > limit:
        return too_far
    bound = max(max(first) + 1, tree + n)
    # Cheapest cost of each (boxes pulled so far, cell the player landed on), one more box per layer, costs <= limit.
    layer: dict[tuple[int, int], int] = {}
    for i, options in enumerate(pulls):
        for stand, land in options:
            cost = start.get(stand, too_far) + 1
            if cost < layer.get((1 << i, land), too_far):
                layer[1 << i, land] = cost
    work = 0
    for _ in range(n - 1):
        next_layer: dict[tuple[int, int], int] = {}
        for (done, at), cost in layer.items():
            work += n
            if work > MAX_BOUND_WORK:
                return bound
            from_here = lands[at]
            for i, options in enumerate(pulls):
                if done >> i & 1:
                    continue
                for stand, land in options:
                    new_cost = cost + from_here.get(stand, too_far) + 1
                    key = (done | 1 << i, land)
                    if new_cost < next_layer.get(key, too_far):
                        next_layer[key] = new_cost
        layer = next_layer
        if not layer:
            return too_far
    return min(layer.values())


def _floor_distances(floor: set[int], source: int, offsets: tuple[int, ...]) -> dict[int, int]:
    """Steps from ``source`` to every floor cell it reaches (boxes ignored)."""
    distances = {source: 0}
    queue = [source]
    for cell in queue:
        step = distances[cell] + 1
        for offset in offsets:
            nxt = cell + offset
            if nxt in floor and nxt not in distances:
                distances[nxt] = step
                queue.append(nxt)
    return distances


def _to_room(
    dim_room: tuple[int, int], floor: list[int], targets: list[int], boxes: tuple[int, ...], player: int
) -> Room:
    """Convert flat-index pieces back to a :class:`Room`."""
    height, width = dim_room
    floor_set = set(floor)
    return Room(
        shape=(height, width),
        walls=frozenset(divmod(i, width) for i in range(height * width) if i not in floor_set),
        targets=frozenset(divmod(t, width) for t in targets),
        boxes=frozenset(divmod(b, width) for b in boxes),
        player=divmod(player, width),
    )
