"""Env throughput: Sokoban steps/s over many envs, and 6x6 room generation rate.

    python benchmarks/bench_envs.py                 # 1024 envs x 100 random steps, 200 rooms
    python benchmarks/bench_envs.py --envs 256 --rounds 50 --rooms 100

Steps are taken in a plain Python loop over the envs (one ``env.step`` call per env per
round, random action ids), the way the rollout steps them. Envs that finish early are not
stepped again, so the step count is exact. Room generation is timed separately through
``env.reset(seed=...)`` (reverse-play generation plus rendering) on fresh seeds.

If ``gym_sokoban`` is importable in the same interpreter, its ``generate_room`` is timed on
the same room settings for comparison (it is not a ragen dependency; use a throwaway venv).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import numpy as np

import ragen.envs


def bench_generation(rooms: int, dim: tuple[int, int], num_boxes: int, search_depth: int, seed: int) -> dict:
    env = ragen.envs.make("sokoban", dim_room=dim, num_boxes=num_boxes, search_depth=search_depth)
    start = time.perf_counter()
    for i in range(rooms):
        env.reset(seed=seed + i)
    elapsed = time.perf_counter() - start
    return {"rooms": rooms, "seconds": elapsed, "rooms_per_s": rooms / elapsed}


def bench_steps(n_envs: int, rounds: int, seed: int) -> dict:
    envs = [ragen.envs.make("sokoban") for _ in range(n_envs)]
    start = time.perf_counter()
    for i, env in enumerate(envs):
        env.reset(seed=seed + i)
    reset_s = time.perf_counter() - start
    rng = np.random.default_rng(seed)
    actions = rng.integers(1, 5, size=(rounds, n_envs))
    alive = list(range(n_envs))
    steps = 0
    start = time.perf_counter()
    for r in range(rounds):
        still = []
        for i in alive:
            _, _, terminated, truncated, _ = envs[i].step(int(actions[r, i]))
            steps += 1
            if not (terminated or truncated):
                still.append(i)
        alive = still
        if not alive:
            break
    elapsed = time.perf_counter() - start
    return {"envs": n_envs, "steps": steps, "seconds": elapsed, "steps_per_s": steps / elapsed, "reset_seconds": reset_s}


def load_gym_sokoban_generate_room(path: str | None):
    """gym-sokoban's ``generate_room``: from the installed package, or from its ``room_utils.py`` file.

    ``room_utils.py`` needs only numpy, so it can be loaded straight out of the unpacked
    wheel (``pip download --no-deps gym-sokoban``) without installing gym-sokoban or gym.
    """
    if path:
        import importlib.util

        spec = importlib.util.spec_from_file_location("gym_sokoban_room_utils", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.generate_room
    try:
        from gym_sokoban.envs.room_utils import generate_room
    except Exception:  # not installed (or incompatible with this numpy/gym)
        return None
    return generate_room


def bench_gym_sokoban(generate_room, rooms: int, dim: tuple[int, int], num_boxes: int, seed: int) -> dict:
    """Time ``rooms`` successful generations; like gym-sokoban's env, retry a call that raises."""
    import random

    random.seed(seed)
    np.random.seed(seed)
    done = failed = 0
    start = time.perf_counter()
    while done < rooms:
        try:
            generate_room(dim=dim, num_steps=int(1.7 * sum(dim)), num_boxes=num_boxes, second_player=False)
            done += 1
        except Exception:  # RuntimeWarning('Generated Model with score == 0') / RuntimeError: the env retries
            failed += 1
    elapsed = time.perf_counter() - start
    return {"rooms": done, "failed_calls": failed, "seconds": elapsed, "rooms_per_s": done / elapsed}


def ragen_difficulty(rooms: int, dim: tuple[int, int], num_boxes: int, search_depth: int, seed: int) -> dict:
    """Mean and max shortest-solution length (BFS) of ragen's generated rooms."""
    from ragen.envs.sokoban import solve

    env = ragen.envs.make("sokoban", dim_room=dim, num_boxes=num_boxes, search_depth=search_depth)
    lengths = []
    for i in range(rooms):
        env.reset(seed=seed + i)
        lengths.append(len(solve(env)))
    return {"mean": float(np.mean(lengths)), "max": int(max(lengths))}


def gym_sokoban_difficulty(generate_room, rooms: int, dim: tuple[int, int], num_boxes: int, seed: int) -> dict:
    """The same for gym-sokoban's rooms, converted to ragen levels (its codes: 0 wall, 2 target, 3/4 box, 5 player)."""
    import random

    from ragen.envs.sokoban import parse_level, solve

    random.seed(seed)
    np.random.seed(seed)
    lengths = []
    while len(lengths) < rooms:
        try:
            structure, state, _ = generate_room(dim=dim, num_steps=int(1.7 * sum(dim)), num_boxes=num_boxes, second_player=False)
        except Exception:
            continue
        rows = []
        for r in range(dim[0]):
            row = ""
            for c in range(dim[1]):
                target, cell = structure[r, c] == 2, state[r, c]
                if structure[r, c] == 0:
                    row += "#"
                elif cell in (3, 4):
                    row += "\u221a" if target else "X"
                elif cell == 5:
                    row += "S" if target else "P"
                else:
                    row += "O" if target else "_"
            rows.append(row)
        plan = solve(parse_level("\n".join(rows)))
        if plan is not None and plan:
            lengths.append(len(plan))
    return {"mean": float(np.mean(lengths)), "max": int(max(lengths))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--rooms", type=int, default=200)
    parser.add_argument("--search-depth", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gym-sokoban-room-utils", metavar="PATH", help="gym_sokoban/envs/room_utils.py to compare with")
    args = parser.parse_args(argv)
    print("$ python " + " ".join(["benchmarks/bench_envs.py", *(argv if argv is not None else sys.argv[1:])]))
    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}, {platform.system()}")
    gen = bench_generation(args.rooms, (6, 6), 1, args.search_depth, args.seed + 10**6)
    print(
        f"sokoban 6x6, 1 box, search_depth={args.search_depth}: generated {gen['rooms']} rooms in "
        f"{gen['seconds']:.2f} s = {gen['rooms_per_s']:.1f} rooms/s ({1000 / gen['rooms_per_s']:.2f} ms/room)"
    )
    steps = bench_steps(args.envs, args.rounds, args.seed)
    print(
        f"sokoban 6x6 x {steps['envs']} envs (reset in {steps['reset_seconds']:.2f} s): {steps['steps']} random steps in "
        f"{steps['seconds']:.2f} s = {steps['steps_per_s']:,.0f} steps/s"
    )
    hard = ragen_difficulty(args.rooms, (6, 6), 1, args.search_depth, args.seed + 10**6)
    print(f"ragen rooms: shortest solution {hard['mean']:.2f} moves on average (max {hard['max']}) over {args.rooms} rooms")
    generate_room = load_gym_sokoban_generate_room(args.gym_sokoban_room_utils)
    if generate_room is None:
        print("gym_sokoban not importable (pass --gym-sokoban-room-utils PATH): comparison skipped")
    else:
        gym = bench_gym_sokoban(generate_room, args.rooms, (6, 6), 1, args.seed)
        print(
            f"gym-sokoban generate_room 6x6, 1 box (its defaults: DFS reverse play, ttl 300): {gym['rooms']} rooms in "
            f"{gym['seconds']:.2f} s = {gym['rooms_per_s']:.1f} rooms/s ({1000 / gym['rooms_per_s']:.2f} ms/room; "
            f"{gym['failed_calls']} calls raised and were retried)"
        )
        hard = gym_sokoban_difficulty(generate_room, args.rooms, (6, 6), 1, args.seed)
        print(f"gym-sokoban rooms: shortest solution {hard['mean']:.2f} moves on average (max {hard['max']}) over {args.rooms} rooms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
