"""Time Sokoban room generation (and the optimal solver) through ``SokobanEnv.reset``.

    .venv/bin/python benchmarks/bench_sokoban.py             # 1000 6x6 rooms with 1 box
    .venv/bin/python benchmarks/bench_sokoban.py --preset larger --rooms 200
"""

from __future__ import annotations

import argparse
import time

from ragen.envs.sokoban import LARGER_SOKOBAN, SIMPLE_SOKOBAN, SokobanEnv, solve

PRESETS = {"simple": SIMPLE_SOKOBAN, "larger": LARGER_SOKOBAN}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="simple")
    parser.add_argument("--rooms", type=int, default=1000)
    args = parser.parse_args()

    env = SokobanEnv(**PRESETS[args.preset])
    rooms = []
    start = time.perf_counter()
    for seed in range(args.rooms):
        env.reset(seed=seed)
        rooms.append(env.room)
    generate_s = time.perf_counter() - start

    start = time.perf_counter()
    lengths = [len(solve(room)) for room in rooms]
    solve_s = time.perf_counter() - start

    print(f"preset={args.preset} {PRESETS[args.preset]}")
    print(f"generate: {args.rooms / generate_s:,.0f} rooms/s ({1e3 * generate_s / args.rooms:.3f} ms/room)")
    print(f"solve:    {args.rooms / solve_s:,.0f} rooms/s ({1e3 * solve_s / args.rooms:.3f} ms/room), "
          f"optimal length mean {sum(lengths) / len(lengths):.1f}, max {max(lengths)}")


if __name__ == "__main__":
    main()
