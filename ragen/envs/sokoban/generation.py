"""Random solvable rooms by reverse play, following gym-sokoban's ``generate_room``.

1. Carve a connected floor out of a walled grid with a random walk that stamps small masks.
2. Put the player and the targets on random floor cells; every box starts on its target.
3. Play backwards: the player walks and may *pull* the box behind it. A breadth-first search
   over ``(player, boxes)`` states explores every position within ``search_depth`` moves and
   keeps the best-scoring one. Each pull is undone by a push, so the result is solvable.

The score is gym-sokoban's: ``pulls * sum of box-to-own-target Manhattan distances``, and 0
while any box sits on a target. A try whose best score is 0 (no box could be moved off the
targets) is discarded.

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


def generate_room(
    rng: np.random.Generator,
    dim_room: tuple[int, int],
    num_boxes: int,
    search_depth: int,
    max_tries: int,
) -> Room:
    """A random solvable room with every box off the targets; ``ValueError`` after ``max_tries`` failed tries."""
    height, width = dim_room
    walk_steps = int(1.7 * (height + width))
    for _ in range(max_tries):
        floor = carve_floor(rng, dim_room, walk_steps)
        if len(floor) <= num_boxes:
            continue
        picks = rng.choice(len(floor), size=num_boxes + 1, replace=False).tolist()
        player, targets = floor[picks[0]], [floor[i] for i in picks[1:]]
        found = reverse_play(set(floor), player, targets, width, search_depth)
        if found is not None:
            end_player, boxes = found
            return _to_room(dim_room, floor, targets, boxes, end_player)
    raise ValueError(
        f"sokoban: could not generate a {height}x{width} room with {num_boxes} box(es) in {max_tries} tries; "
        "use a larger dim_room, fewer boxes, a larger search_depth or more max_generation_tries"
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

    ``boxes[i]`` is the box that started on ``targets[i]``.
    """
    offsets = (-width, width, -1, 1)
    target_set = frozenset(targets)
    target_rc = [divmod(t, width) for t in targets]
    seen = {(player, target_set)}
    frontier = [(player, tuple(targets), 0)]
    best, best_score = None, 0
    for _ in range(search_depth):
        next_frontier = []
        for player, boxes, pulls in frontier:
            occupied = frozenset(boxes)
            for offset in offsets:
                dest = player + offset
                if dest not in floor or dest in occupied:
                    continue
                successors = [(dest, boxes, occupied, pulls)]
                if player - offset in occupied:
                    pulled = tuple(player if b == player - offset else b for b in boxes)
                    successors.append((dest, pulled, frozenset(pulled), pulls + 1))
                for new_player, new_boxes, new_occupied, new_pulls in successors:
                    if (new_player, new_occupied) in seen:
                        continue
                    seen.add((new_player, new_occupied))
                    next_frontier.append((new_player, new_boxes, new_pulls))
                    if new_pulls == pulls:
                        continue  # a plain walk does not change the score
                    score = _score(new_boxes, new_pulls, target_set, target_rc, width)
                    if score > best_score:
                        best, best_score = (new_player, new_boxes), score
        frontier = next_frontier
        if not frontier or len(seen) >= MAX_REVERSE_STATES:
            break
    return best


def _score(boxes: tuple[int, ...], pulls: int, target_set: frozenset[int], target_rc: list, width: int) -> int:
    """gym-sokoban's room score: pulls times total box displacement, 0 if any box is on a target."""
    displacement = 0
    for box, (t_row, t_col) in zip(boxes, target_rc):
        if box in target_set:
            return 0
        row, col = divmod(box, width)
        displacement += abs(row - t_row) + abs(col - t_col)
    return pulls * displacement


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
