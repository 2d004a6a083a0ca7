"""``ragen sft``: ``generate`` (expert or rejection-sampled chat JSONL), ``train`` (SFT run), ``merge`` (LoRA → standalone model).

Registered on the main parser by :func:`add_sft_parser`; nothing heavy is imported until
a subcommand runs. Every user mistake is one line ``ragen: error: …`` and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import itertools
from pathlib import Path


def _fail(message: str) -> int:
    from ragen.cli_common import _fail as fail

    return fail(message)


def _quiet() -> None:
    from ragen.cli_common import _quiet_transformers

    _quiet_transformers()


def cmd_generate(args: argparse.Namespace) -> int:
    from ragen.cli_common import note_lost_env_settings
    from ragen.config import ConfigError, load_config
    from ragen.models.loading import load_tokenizer
    from ragen.sft.generate import (ReplyLengths, demo_target, expert_records, output_problem, rollout_logs,
                                    rollout_records, write_jsonl)

    if args.n < 0 or (args.n == 0 and not args.from_run):
        return _fail(f"--n must be >= 1 (got {args.n}); with --from-run, 0 means every successful episode")
    # Every check comes before --out is touched, and write_jsonl replaces it only once the
    # last record is written: bad input leaves an existing --out file as it was.
    if args.from_run:
        if args.env or args.overrides:
            return _fail("generate --from-run takes the env and agent settings from the run's config.yaml; give no ENV or overrides")
        run = Path(args.from_run)
        problem = output_problem(args.out, [run / "config.yaml", *rollout_logs(run)], run_dir=run)
        if problem:
            return _fail(problem)
        try:
            records = rollout_records(run, args.n)
            first = next(records, None)  # nothing to write: fail without replacing --out
            if first is None:
                return _fail(f"{args.from_run}: no successful, well-formed episode in rollouts/*.jsonl")
            count = write_jsonl(itertools.chain([first], records), args.out)
        except (ConfigError, ValueError, OSError) as exc:
            return _fail(str(exc))
        print(f"[ragen sft] wrote {count} successful rollout episodes of {args.from_run} to {args.out}")
        return 0
    if not args.env:
        return _fail("generate needs an env preset or YAML config (or --from-run RUN_DIR)")
    problem = output_problem(args.out, [args.env] if Path(args.env).suffix and Path(args.env).is_file() else [])
    if problem:
        return _fail(problem)
    try:
        config = load_config(args.env, args.overrides)
        note_lost_env_settings(config)
        env_name = demo_target(config)[0]
        stats: dict = {}
        records = expert_records(config, args.n, keep_failures=args.keep_failures, stats=stats)  # checks the env
        lengths = ReplyLengths(load_tokenizer(config.model), config.rollout.max_new_tokens)
        count = write_jsonl(lengths.watch(records), args.out)
    except (ConfigError, ValueError, OSError) as exc:
        return _fail(str(exc))
    if note := lengths.note():
        print(f"ragen: note: {note}", file=sys.stderr)
    rate = stats["succeeded"] / max(1, stats["played"])
    print(f"[ragen sft] wrote {count} expert episodes of {env_name} to {args.out} "
          f"({stats['played']} played, expert success {rate:.3f} under the agent's turn and action limits)")
    if count < args.n:
        print(f"[ragen sft] note: fewer than --n {args.n}: the expert failed too often within the limits", flush=True)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from ragen.config import ConfigError, run_kind
    from ragen.sft.config import load_sft_config, result_changing_differences

    overrides = list(args.overrides)
    yaml_path = None
    if args.resume:
        if args.data and "=" in args.data:  # ``ragen sft train --resume RUN_DIR key=value``
            overrides.insert(0, args.data)
        elif args.data:
            return _fail("--resume takes the data file from the run's config.yaml; give only key=value overrides")
        yaml_path = str(Path(args.resume) / "config.yaml")
        if not Path(yaml_path).is_file():
            return _fail(f"--resume {args.resume}: not a run directory (no config.yaml)")
        if run_kind(yaml_path) == "rl":
            return _fail(f"--resume {args.resume}: a `ragen train` (RL) run; continue it with `ragen train --resume {args.resume}`")
        overrides.append(f"trainer.output_dir={args.resume}")
    elif not args.data:
        return _fail("sft train needs a DATA file (JSONL from `ragen sft generate`) or --resume RUN_DIR")
    else:
        if "=" in args.data and not Path(args.data).exists():
            return _fail(f"sft train: the first argument is the DATA file, got {args.data!r}")
        overrides.insert(0, f"data.path={args.data}")
    try:
        config = load_sft_config(yaml_path, overrides)
        if args.resume:  # as `ragen train --resume`: overrides that change the steps already run need --force
            saved = load_sft_config(yaml_path, [f"trainer.output_dir={args.resume}"], check=False)
            changed = result_changing_differences(saved, config)
            if changed and not args.force:
                return _fail(f"--resume with a config that changes results ({', '.join(changed)}); pass --force to accept")
    except ConfigError as exc:
        return _fail(str(exc))
    _quiet()
    from ragen.models import ModelLoadError

    if args.print_config:  # check what start-up checks, print the resolved config, run nothing
        from ragen.sft.config import to_yaml
        from ragen.sft.preflight import preflight

        try:
            preflight(config, resume=bool(args.resume), force=args.force)
        except (ModelLoadError, FileExistsError, FileNotFoundError, ValueError) as exc:
            return _fail(str(exc).splitlines()[0])
        print(to_yaml(config), end="")
        return 0
    from ragen.sft.trainer import SFTTrainer

    try:
        trainer = SFTTrainer(config, resume=bool(args.resume), force=args.force)
    except (ModelLoadError, FileExistsError, FileNotFoundError, ValueError) as exc:
        return _fail(str(exc).splitlines()[0])
    summary = trainer.train()
    from ragen.cli_common import INTERRUPTED

    return INTERRUPTED if "interrupted_at_step" in summary else 0


def cmd_merge(args: argparse.Namespace) -> int:
    _quiet()
    from ragen.models import ModelLoadError
    from ragen.sft.merge import merge_adapter

    try:
        info = merge_adapter(args.adapter, args.out)
    except (ModelLoadError, OSError) as exc:
        return _fail(str(exc).splitlines()[0])
    print(f"[ragen sft] merged {info['adapter']} into base {info['base']}: {info['out']}")
    return 0


def add_sft_parser(sub) -> None:
    """Add ``sft generate|train|merge`` to the ``ragen`` subparsers ``sub``."""
    sft = sub.add_parser("sft", help="supervised fine-tuning: expert data, training, LoRA merge")
    sft_sub = sft.add_subparsers(dest="sft_command", required=True)

    gen = sft_sub.add_parser("generate", help="expert (or rejection-sampled) episodes as chat JSONL in the rollout's exact format")
    gen.add_argument("env", nargs="?", help="env preset or YAML config, as for `ragen train` (its agent settings shape the chat)")
    gen.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. agent.max_turn=5 seed=1")
    gen.add_argument("--n", type=int, default=100, help="conversations to write (default 100)")
    gen.add_argument("--out", required=True, help="output JSONL file")
    gen.add_argument("--from-run", metavar="RUN_DIR", help="instead: successful episodes of a ragen train run's rollouts/*.jsonl")
    gen.add_argument("--keep-failures", action="store_true", help="also write the expert's failed episodes")
    gen.set_defaults(func=cmd_generate)

    train = sft_sub.add_parser("train", help="fine-tune on a chat JSONL (loss on assistant tokens only)")
    train.add_argument("data", nargs="?", help="JSONL file from `ragen sft generate`")
    train.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. lora.rank=16 trainer.max_steps=100")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its newest valid checkpoint")
    train.add_argument("--force", action="store_true",
                       help="with --resume: accept overrides that change results (anything but trainer.max_steps, epochs, "
                            "eval_freq, save_freq, ...)")
    train.add_argument("--print-config", action="store_true",
                       help="check the config as a run's start-up does (output dir, device, model, data records; with "
                            "--resume a valid checkpoint), print it as the run's config.yaml would record it, and exit "
                            "without training")
    train.set_defaults(func=cmd_train)

    merge = sft_sub.add_parser("merge", help="merge a LoRA adapter (or a LoRA run dir) into a standalone HF model dir")
    merge.add_argument("adapter", metavar="RUN_DIR_OR_ADAPTER")
    merge.add_argument("--out", required=True, help="output directory (loadable by transformers alone)")
    merge.set_defaults(func=cmd_merge)


__all__ = ["add_sft_parser"]
