"""The ``ragen`` command: ``ragen train ENV_OR_YAML [key=value ...]``, ``ragen envs``."""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

# Nothing may wait on a network that is not there: keep Hugging Face libraries offline
# unless the user explicitly says otherwise.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from ragen.cli_common import (INTERRUPTED, USAGE_ERROR, _fail, _quiet_transformers, _rank0,  # noqa: E402,F401
                              note_lost_env_settings)
from ragen.runtime import keep_freed_memory  # noqa: E402 (after the environment defaults above)

def note_val_tags_keep_their_envs(config, overrides: list[str]) -> None:
    """One stderr line (rank 0 only) when ``env.*`` overrides typed for a run leave validation's ``es.val`` tags as
    they are (each tag plays its own env config: the bandit preset's ``Bandit``/``BanditTest``)."""
    from ragen.config import single_env_key

    if not config.es.val or config.es.train or not _rank0():
        return
    keys = [key for key in map(single_env_key, overrides) if key and key.startswith("env")]
    if keys:
        import ragen.envs

        try:  # an env config start-up refuses gets its error alone, not a note first
            ragen.envs.make(config.env.name, **config.env.config).close()
        except Exception:
            return
        tags = ", ".join(entry.tag for entry in config.es.val)
        print(f"ragen: note: {', '.join(keys)} set the training envs only: validation plays es.val's tags ({tags}), "
              "each with its own env config (change one with es.tags.TAG.config.KEY=VALUE; docs/env_tags.md)",
              file=sys.stderr)


def run_era_overrides(config_yaml: str) -> list[str]:
    """Overrides that keep a resumed run on the behaviour it was trained with when its ``config.yaml`` predates a
    key whose default changed it: ``algorithm.disable_dropout`` defaults to true, but a run written
    before it trained with the model's own dropout on."""
    from omegaconf import OmegaConf

    from ragen.config import load_yaml_mapping

    saved = load_yaml_mapping(config_yaml)
    return [] if OmegaConf.select(saved, "algorithm.disable_dropout") is not None else ["algorithm.disable_dropout=false"]


def cmd_train(args: argparse.Namespace) -> int:
    from ragen.config import ConfigError, load_config, result_changing_differences, run_kind

    overrides = list(args.overrides)
    preset = args.preset
    if args.resume:
        # ``ragen train --resume RUN_DIR [key=value ...]``: the positional may be an override.
        if preset and "=" in preset:
            overrides.insert(0, preset)
        elif preset:
            return _fail(f"--resume takes the run's own config.yaml; drop {preset!r} (give only key=value overrides)")
        run_dir = Path(args.resume)
        saved = run_dir / "config.yaml"
        if not saved.is_file():
            return _fail(f"--resume {run_dir}: not a run directory (no config.yaml)")
        if not saved.read_bytes().strip():  # read as the defaults, it would resume another model's run
            return _fail(f"--resume {run_dir}: its config.yaml is empty (the run dir is damaged)")
        preset = str(saved)
        if run_kind(saved) == "sft":
            return _fail(f"--resume {run_dir}: a `ragen sft train` run; continue it with `ragen sft train --resume {run_dir}`")
        typed = list(overrides)  # what the user wrote, for the notes below
        overrides.append(f"trainer.output_dir={run_dir}")
    elif not preset:
        return _fail("train needs an env preset or a YAML config (or --resume RUN_DIR)")
    else:
        typed = list(overrides)
    try:
        before = []  # settings a resumed run had without its config.yaml naming them (it predates the key)
        if args.resume:
            before = run_era_overrides(preset)
            overrides = before + overrides
        config = load_config(preset, overrides)
        if args.resume:
            changed = result_changing_differences(load_config(preset, before), config)
            if changed and not args.force:
                return _fail(f"--resume with a config that changes results ({', '.join(changed)}); pass --force to accept")
    except ConfigError as exc:
        return _fail(str(exc))
    note_lost_env_settings(config)
    note_val_tags_keep_their_envs(config, typed)
    _quiet_transformers()
    from ragen.models import ModelLoadError

    if args.print_config:  # check what start-up checks, print the resolved config, run nothing
        from ragen.config import to_yaml
        from ragen.train.preflight import preflight

        try:
            preflight(config, resume=bool(args.resume))
        except (ConfigError, ModelLoadError, FileExistsError, FileNotFoundError, ValueError) as exc:
            return _fail(str(exc))
        if _rank0():  # under torchrun, once (every rank still checks, and says what fails)
            print(to_yaml(config), end="")
        return 0
    from ragen.train.distributed import close_distributed
    from ragen.train.trainer import StarPOTrainer

    try:  # under torchrun every way out leaves the process group cleanly, a refused start-up included
        try:
            trainer = StarPOTrainer(config, resume=bool(args.resume))
        except (ConfigError, ModelLoadError, FileExistsError, FileNotFoundError) as exc:
            return _fail(str(exc))
        except ValueError as exc:  # env/algorithm config rejected by its owner: the message names the key
            return _fail(str(exc))
        summary = trainer.train()
    finally:
        close_distributed()
    return INTERRUPTED if "interrupted_at_step" in summary else 0


def cmd_envs(args: argparse.Namespace) -> int:
    import ragen.envs

    for name, factory in sorted(ragen.envs.registered().items()):
        print(f"{name:12s} {getattr(factory, 'description', '')}")
        for key, default in ragen.envs.env_config_fields(name).items():
            print(f"{'':12s}   {key} = {default!r}")
    return 0


def cmd_play(args: argparse.Namespace) -> int:
    from ragen.agent.play import main_play

    # Options may follow the env's key=value overrides: ``ragen play sokoban num_boxes=2 --seed 3``.
    extra = argparse.ArgumentParser(prog="ragen play", add_help=False)
    extra.add_argument("--seed", type=int, default=None)
    known, overrides = extra.parse_known_args(args.overrides)
    unknown = [item for item in overrides if item.startswith("-")]
    if unknown:
        return _fail(f"play: unrecognized option {unknown[0]!r}")
    seed = known.seed if known.seed is not None else args.seed
    if seed is not None and seed < 0:
        return _fail(f"--seed must be >= 0 (got {seed})")
    try:
        main_play(args.env, overrides, seed)
    except ValueError as exc:
        return _fail(str(exc))
    return 0


def cmd_view(args: argparse.Namespace) -> int:
    from ragen.viz.viewer import build_site, serve

    if args.serve and not 0 <= args.port <= 65535:
        return _fail(f"--port must be in 0..65535 (got {args.port})")
    try:
        index = build_site(args.run_dir, args.out)
    except OSError as exc:  # no run dir, or --out under a file / an existing file
        return _fail(str(exc))
    print(index)
    if args.serve:
        try:
            serve(index.parent, args.port)
        except OSError as exc:  # e.g. the port is in use
            return _fail(f"cannot serve on port {args.port}: {exc.strerror or exc}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    try:
        from ragen.viz.plots import plot_runs

        paths = plot_runs(args.run_dirs, args.out)
    except ImportError as exc:
        return _fail(f"plotting needs matplotlib ({exc}); pip install matplotlib")
    except (OSError, ValueError) as exc:  # no metrics, or --out under a file
        return _fail(str(exc))
    for path in paths:
        print(path)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from ragen.config import ConfigError, load_config, reject_env_overrides_eval_ignores, run_kind

    preset = args.env
    if preset is None:
        return _fail("eval needs ENV_OR_YAML after the model: the env preset, YAML config or `ragen train` run dir whose "
                     f"validation envs to play (e.g. `ragen eval {args.model} bandit`)")
    if Path(preset).is_dir() and (Path(preset) / "config.yaml").is_file():  # a run dir: its own config
        preset = str(Path(preset) / "config.yaml")
        if not Path(preset).read_bytes().strip():
            return _fail(f"{preset} is empty (the run dir is damaged); give the env or YAML config instead")
        if run_kind(preset) == "sft":
            return _fail(f"{args.env} is a `ragen sft train` run: its config names no env; give the env to evaluate "
                         f"on (e.g. `ragen eval {args.env} bandit`)")
    try:
        config = load_config(preset, args.overrides)
        reject_env_overrides_eval_ignores(config, args.overrides)
    except ConfigError as exc:
        return _fail(str(exc))
    note_lost_env_settings(config)
    config.model = args.model  # set directly: a path or openai:NAME is not re-parsed as YAML
    if args.k < 0:
        return _fail(f"--k must be >= 0 (got {args.k}; 0 = greedy decoding only)")
    if args.n is not None and args.k == 0:
        return _fail(f"--n {args.n} samples per seed for pass@k, but --k 0 samples nothing; give --k >= 1 or drop --n")
    if args.n is not None and args.n < args.k:
        return _fail(f"--n must be >= --k: pass@k draws k of the n samples per seed (got --k {args.k}, --n {args.n})")
    if args.json and (Path(args.json).is_dir() or any(p.is_file() for p in Path(args.json).absolute().parents)):
        return _fail(f"--json {args.json}: a directory, or under a file; give a file path")  # found before the eval runs
    _quiet_transformers()
    from ragen.eval.evaluate import evaluate, format_table
    from ragen.models import ModelLoadError
    from ragen.models.openai_backend import OpenAIError

    try:
        report = evaluate(config, k=args.k, n=args.n, baselines=not args.no_baselines)
    except (ModelLoadError, OpenAIError, ValueError) as exc:
        return _fail(str(exc).splitlines()[0] if str(exc) else repr(exc))
    except OSError as exc:  # e.g. a directory with a config.json but no loadable weights
        return _fail(f"model={args.model!r} could not be loaded: {exc}".splitlines()[0])
    if args.json:  # written before anything is printed: a reader of stdout that goes away (`| head`) loses nothing
        from ragen.files import strict_dumps, write_text_atomic

        out = Path(args.json)
        write_text_atomic(out, strict_dumps(report, indent=2) + "\n")  # NaN -> null
    print(format_table(report))
    if args.json:
        print(f"[ragen] wrote {out}")
    if args.compare:
        from ragen.eval.compare import compare_reports, format_comparison

        other_config = copy.deepcopy(config)
        other_config.model = args.compare
        try:
            other = evaluate(other_config, k=0, baselines=False)
        except (ModelLoadError, OpenAIError, ValueError) as exc:
            return _fail(f"--compare {args.compare}: " + (str(exc).splitlines()[0] if str(exc) else repr(exc)))
        except OSError as exc:
            return _fail(f"--compare {args.compare!r} could not be loaded: {exc}".splitlines()[0])
        print()
        print(format_table(other))
        print()
        print(format_comparison(args.model, args.compare, compare_reports(report, other)))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from ragen.config_reference import reference_markdown

    print(reference_markdown())
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from ragen.config import ConfigError, load_config
    from ragen.eval.sweep import format_table, parse_seeds, sweep

    try:
        seeds = parse_seeds(args.seeds)
        load_config(args.preset, [*args.overrides, "seed=0"])  # a bad key fails here, not once per seed
        results = sweep(args.preset, seeds, Path(args.out), list(args.overrides))
    except (ConfigError, ValueError, OSError) as exc:  # FileExistsError included: an unfinished run in the way
        return _fail(str(exc))
    if not results:
        return _fail("no seed's run finished")
    table = format_table(results)
    print(table)
    if args.table:
        Path(args.table).write_text(table + "\n")
    return 0 if len(results) == len(seeds) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ragen", description="Train LLM agents with multi-turn RL (StarPO).")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a policy with StarPO on an env preset or a YAML config")
    train.add_argument("preset", nargs="?", help="a preset (ragen/configs/), a registered env name (`ragen envs`) or a YAML config path")
    train.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. trainer.total_steps=20 model=tiny")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its newest valid checkpoint")
    train.add_argument("--force", action="store_true", help="with --resume: accept overrides that change results")
    train.add_argument("--print-config", action="store_true",
                       help="check the config as a run's start-up does (envs built, model found, output dir free or, with "
                            "--resume, a valid checkpoint), print it as the run's config.yaml would record it (an empty "
                            "trainer.output_dir is named runs/NAME-TIME only when a run starts), and exit without training")
    train.set_defaults(func=cmd_train)
    envs = sub.add_parser("envs", help="list registered envs and their config knobs")
    envs.set_defaults(func=cmd_envs)
    play = sub.add_parser("play", help="play an env in the terminal, seeing exactly the text the model sees")
    play.add_argument("env", help="registered env name (see `ragen envs`)")
    play.add_argument("overrides", nargs=argparse.REMAINDER, help="env config key=value (YAML values), or agent.KEY=value")
    play.add_argument("--seed", type=int, default=None, help="seed of the episode (default: random)")
    play.set_defaults(func=cmd_play)
    view = sub.add_parser("view", help="write a static HTML viewer of a run's steps and trajectories")
    view.add_argument("run_dir", help="run directory (with metrics.jsonl and rollouts/)")
    view.add_argument("--out", default=None, help="output directory (default: RUN_DIR/viewer)")
    view.add_argument("--serve", action="store_true", help="then serve it on http://127.0.0.1:PORT")
    view.add_argument("--port", type=int, default=8000, help="port for --serve (default 8000)")
    view.set_defaults(func=cmd_view)
    plot = sub.add_parser("plot", help="plot training curves of one or more runs into a PNG")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories to compare")
    plot.add_argument("--out", default=None, help="PNG file or directory (default: RUN_DIR/curves.png, ./curves.png)")
    plot.set_defaults(func=cmd_plot)
    evaluate = sub.add_parser("eval", help="evaluate a model or run dir on the held-out validation seeds, with baselines")
    evaluate.add_argument("model", help="smollm2-135m, tiny, an HF model dir, a run dir, or openai:MODEL")
    evaluate.add_argument("env", metavar="ENV_OR_YAML", nargs="?", default=None,
                          help="env preset, YAML config, or a run dir (uses its config.yaml)")
    evaluate.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. trainer.val_episodes=128")
    evaluate.add_argument("--k", type=int, default=4, help="pass@k: k (0 = greedy only; default 4)")
    evaluate.add_argument("--n", type=int, default=None, help="samples per seed for pass@k (default k; n > k: unbiased estimator)")
    evaluate.add_argument("--json", metavar="OUT", default=None, help="also write the full report as JSON to OUT")
    evaluate.add_argument("--no-baselines", action="store_true", help="skip the random and expert agents")
    evaluate.add_argument("--compare", metavar="OTHER_MODEL", default=None,
                          help="also evaluate OTHER_MODEL (greedy) on the same seeds and print the paired difference "
                               "of success rates with its 95%% interval")
    evaluate.set_defaults(func=cmd_eval)
    config_cmd = sub.add_parser("config", help="print the configuration reference (every key, type, default, meaning)")
    config_cmd.add_argument("--list", action="store_true", help="every key of ragen train and ragen sft train, as Markdown")
    config_cmd.set_defaults(func=cmd_config)
    sweep = sub.add_parser("sweep", help="train a preset on several seeds and print each seed's validation gain")
    sweep.add_argument("preset", help="a preset (ragen/configs/) or a YAML config path")
    sweep.add_argument("overrides", nargs="*", help="dotted key=value overrides for every seed's run")
    sweep.add_argument("--seeds", default="0-7", help="seeds: 0-7, 0,2,5 or 0-3,8 (default 0-7)")
    sweep.add_argument("--out", required=True, help="sweep directory: one run dir per seed (OUT/seed_S), kept and reused")
    sweep.add_argument("--table", default=None, help="also write the table (Markdown) to this file")
    sweep.set_defaults(func=cmd_sweep)
    from ragen.sft.cli import add_sft_parser

    add_sft_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse stops filling a positional ``overrides`` list at the first option, so
    # ``ragen sft generate bandit --n 8 --out f.jsonl agent.max_turn=2`` leaves the override
    # over: key=value words after options are overrides too, in the order given.
    stray = [item for item in extra if item.startswith("-") or "=" not in item]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    keep_freed_memory()  # only with RAGEN_MALLOC=keep: large tensors reuse freed pages (ragen/runtime.py)
    try:
        return args.func(args)
    except BrokenPipeError:
        if not _stdout_reader_gone():  # another pipe or socket inside the command broke: a real error, not ours to hide
            raise
        # stdout's reader went away (`ragen envs | head -1`): stop quietly, as POSIX tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes at exit
        return 128 + 13  # what a shell reports for a process ended by SIGPIPE


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end was closed (poll reports an error on the write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no poll here, or stdout has no file descriptor
        return False


if __name__ == "__main__":
    sys.exit(main())
