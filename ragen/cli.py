"""The ``ragen`` command: ``ragen train ENV_OR_YAML [key=value ...]``, ``ragen envs``."""

from __future__ import annotations

import argparse
import os
import sys

# Nothing may wait on a network that is not there: keep Hugging Face libraries offline
# unless the user explicitly says otherwise.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

USAGE_ERROR = 2


def _fail(message: str) -> int:
    print(f"ragen: error: {message}", file=sys.stderr)
    return USAGE_ERROR


def cmd_train(args: argparse.Namespace) -> int:
    from ragen.config import ConfigError, load_config

    try:
        config = load_config(args.preset, args.overrides)
    except ConfigError as exc:
        return _fail(str(exc))
    _quiet_transformers()
    from ragen.models import ModelLoadError
    from ragen.train.trainer import StarPOTrainer

    try:
        trainer = StarPOTrainer(config)
    except (ConfigError, ModelLoadError, FileExistsError, FileNotFoundError) as exc:
        return _fail(str(exc))
    except ValueError as exc:  # env/algorithm config rejected by its owner: the message names the key
        return _fail(str(exc))
    trainer.train()
    return 0


def cmd_envs(args: argparse.Namespace) -> int:
    import ragen.envs

    for name, factory in sorted(ragen.envs.registered().items()):
        print(f"{name:12s} {getattr(factory, 'description', '')}")
        for key, default in ragen.envs.env_config_fields(name).items():
            print(f"{'':12s}   {key} = {default!r}")
    return 0


def cmd_play(args: argparse.Namespace) -> int:
    from ragen.envs.play import main_play

    try:
        main_play(args.env, args.overrides, args.seed)
    except ValueError as exc:
        return _fail(str(exc))
    return 0


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ragen", description="Train LLM agents with multi-turn RL (StarPO).")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a policy with StarPO on an env preset or a YAML config")
    train.add_argument("preset", help="env preset name (see ragen/configs/) or a YAML config path")
    train.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. trainer.total_steps=20 model=tiny")
    train.set_defaults(func=cmd_train)
    envs = sub.add_parser("envs", help="list registered envs and their config knobs")
    envs.set_defaults(func=cmd_envs)
    play = sub.add_parser("play", help="play an env in the terminal, seeing exactly the text the model sees")
    play.add_argument("env", help="registered env name (see `ragen envs`)")
    play.add_argument("overrides", nargs="*", help="env config key=value (YAML values), or agent.KEY=value")
    play.add_argument("--seed", type=int, default=None, help="seed of the episode (default: random)")
    play.set_defaults(func=cmd_play)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
