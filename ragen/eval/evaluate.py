"""``ragen eval``: a model (or run dir, or API model) on the held-out validation seeds, next to baselines.

The episodes are exactly those of training validation: envs reset with seeds
``VAL_SEED_BASE + i`` for ``i < trainer.val_episodes``, played by the same
:class:`~ragen.agent.Rollout` with the same prompts, parser and agent settings. Reported:

* ``success`` -- greedy decoding (``do_sample=False``): the headline number;
* ``pass@k`` -- ``n`` sampled episodes per seed at ``rollout.temperature``; per seed with
  ``c`` successes, ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021, unbiased), averaged
  over seeds. With ``n == k`` this is the share of seeds with at least one success;
* ``reward_mean``, ``valid_action_rate`` (share of turns whose answer parsed into valid
  actions), ``response_length`` (tokens per turn) -- for both decodings;
* baselines on the same seeds and turn budget: the random agent and the expert (oracle)
  agent of :mod:`ragen.envs.agents`; an env without an expert is skipped with a note;
* ``optimality`` (FrozenLake only, where the optimum is exact): the greedy episodes scored move by
  move against the optimal policy, giving an unbiased estimate of the greedy policy's success
  probability with a much smaller standard error than ``success`` (:mod:`ragen.eval.optimality`).

See ``docs/eval.md``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Any

import ragen.envs
from ragen.config import RunConfig
from ragen.eval.intervals import wilson

#: Model specs starting with this prefix are served by an OpenAI-compatible chat API.
OPENAI_PREFIX = "openai:"
STOP = ("</answer>",)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from ``n`` samples with ``c`` correct (Chen et al. 2021)."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class EvalTarget:
    """One validation set of the config, as training validation plays it: an env tag with its
    env, env config, agent settings (horizon, instructions) and episode count."""

    tag: str
    env: str
    env_config: dict
    settings: Any  # ragen.agent.AgentConfig
    episodes: int


def eval_targets(config: RunConfig) -> list[EvalTarget]:
    """The config's validation sets (``es.val``, else its training tags, else ``env``), like ``StarPOTrainer.validate``."""
    from ragen.agent.env_sets import val_sets

    return [EvalTarget(s.name, s.tag.env, dict(s.tag.config), s.settings, s.count) for s in val_sets(config)]


def validation_seeds(n: int) -> list[int]:
    """The held-out seeds training validation uses (see ``StarPOTrainer.validate``)."""
    from ragen.agent.env_sets import VAL_SEED_BASE

    return [VAL_SEED_BASE + i for i in range(n)]


# -- model side ------------------------------------------------------------------------------


def make_backend(config: RunConfig):
    """``(backend, tokenizer)`` for ``config.model``: an HF model / run dir, or ``openai:NAME``.

    Raises ``ModelLoadError`` (not a model) or ``OpenAIConfigError`` (no API key).
    """
    spec = config.model
    if spec.startswith(OPENAI_PREFIX):
        from ragen.models.openai_backend import OpenAIChatBackend

        backend = OpenAIChatBackend(spec[len(OPENAI_PREFIX) :])
        return backend, backend.tokenizer
    from ragen.engines import build_engine
    from ragen.models import load_model
    from ragen.models.device import resolve_device

    model, tokenizer = load_model(spec, seed=config.seed)
    model.to(resolve_device(config.trainer.device))
    backend = build_engine(model, tokenizer, config)
    return backend, tokenizer


def _summarise(trajectories) -> dict[str, float]:
    from ragen.eval.metrics import episode_metrics

    raw = episode_metrics(trajectories, "m")
    out = {key.split("/", 1)[1]: value for key, value in raw.items()}
    if "format_valid" in out:
        out["valid_action_rate"] = out["format_valid"]
    return out


def run_model(config: RunConfig, backend, tokenizer, seeds: list[int], *, k: int, n: int,
              target: EvalTarget | None = None) -> dict[str, Any]:
    """Greedy episodes on ``seeds``, then ``n`` sampled episodes per seed for pass@k (``k = 0`` skips them)."""
    from ragen.agent import Rollout
    from ragen.engines import SamplingParams

    target = target or eval_targets(config)[0]
    r, agent = config.rollout, target.settings
    index = {s: i for i, s in enumerate(seeds)}

    def play(do_sample: bool, episode_seeds: list[int]):
        sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                  top_k=r.top_k, do_sample=do_sample, stop=STOP)
        envs = [ragen.envs.make(target.env, **target.env_config) for _ in episode_seeds]
        group_ids = [index[s] for s in episode_seeds]  # one group per seed
        return Rollout(backend, tokenizer, agent, sampling, max_in_flight=r.max_episodes_in_flight).run(
            envs, episode_seeds, group_ids, target.env, tags=[target.tag] * len(envs))

    greedy = play(False, seeds)
    by_seed = {t.seed: (None if t.error else int(bool(t.success))) for t in greedy}
    # per held-out seed, in seed order: 1 / 0, or None where the env raised (what ``--compare`` pairs)
    result: dict[str, Any] = {"greedy": _summarise(greedy), "greedy_success_by_seed": [by_seed.get(s) for s in seeds]}
    if target.env == "frozen_lake":
        from ragen.eval.optimality import lake_optimality

        result["optimality"] = lake_optimality(greedy, target.env_config, agent)
    if k > 0:
        import torch

        sampled_seeds = [s for s in seeds for _ in range(n)]
        # The samples are drawn from torch's generator seeded with the config's `seed` (the caller's state is put
        # back): the same config samples the same episodes, whatever ran before in the process (another tag's).
        with torch.random.fork_rng():
            torch.manual_seed(config.seed)
            sampled = play(True, sampled_seeds)
        per_seed: dict[int, list[bool]] = {s: [] for s in seeds}
        for traj in sampled:
            if not traj.error:
                per_seed[traj.seed].append(bool(traj.success))
        scores = [pass_at_k(len(v), sum(v), k) for v in per_seed.values() if len(v) >= k]
        summary = _summarise(sampled)
        summary.update({"k": k, "n": n, "pass_at_k": statistics.fmean(scores) if scores else float("nan"),
                        "seeds_scored": len(scores)})
        result["sampled"] = summary
        result["sampled_examples"] = [t.to_json() for t in sampled[: min(3, len(sampled))]]
    result["greedy_examples"] = [t.to_json() for t in greedy[: min(3, len(greedy))]]
    return result


# -- baselines -------------------------------------------------------------------------------


def run_baseline(config: RunConfig, name: str, seeds: list[int], target: EvalTarget | None = None) -> dict[str, Any]:
    """The ``random`` or ``expert`` agent on ``seeds`` with the model's turn and action budget; ``{"skipped": why}`` if it cannot."""
    from ragen.envs.agents import ExpertAgent, RandomAgent, run_episode

    target = target or eval_targets(config)[0]
    settings = target.settings
    per_turn = settings.max_actions_per_turn
    agent = RandomAgent(seed=config.seed, max_actions_per_turn=per_turn) if name == "random" else ExpertAgent(per_turn)
    env = ragen.envs.make(target.env, **target.env_config)
    # The rollout's limits: turns, actions per answer, actions per episode (0 = none). The
    # expert gets them as its budget (FrozenLake's plays the optimal policy for the moves left).
    limits = {"max_turns": settings.max_turn, "max_actions_per_turn": per_turn,
              "max_actions": settings.max_actions_per_traj or None}
    try:
        results = [run_episode(env, agent, seed=s, **limits) for s in seeds]
    except ValueError as exc:
        return {"skipped": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a baseline must never sink the model's evaluation
        return {"skipped": f"{name} agent raised {exc!r}"}
    turns = sum(res["turns"] for res in results)
    rewards = [res["reward"] for res in results]
    successes = sum(bool(res["success"]) for res in results)
    low, high = wilson(successes, len(results))
    return {
        "episodes": float(len(results)),
        "success": successes / len(results),
        "success_ci_low": low,
        "success_ci_high": high,
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "valid_action_rate": 1.0 - sum(res["invalid_turns"] for res in results) / max(1, turns),
        "turns_per_episode": turns / len(results),
        "actions_per_episode": statistics.fmean(res["steps"] for res in results),
    }


# -- the whole evaluation ----------------------------------------------------------------------


def evaluate(config: RunConfig, *, k: int = 4, n: int | None = None, baselines: bool = True,
             backend=None, tokenizer=None) -> dict[str, Any]:
    """Evaluate ``config.model`` on the config's validation sets; returns the JSON-ready report (see ``docs/eval.md``).

    One validation set (the usual case): that set's report. Several (``es.val`` lists tags):
    ``{"model", "tags": {tag: report}}``.
    """
    n = k if n is None else n
    if k < 0 or (k > 0 and n < k):
        raise ValueError(f"--k must be >= 0 and --n >= --k (got k={k}, n={n})")
    targets = eval_targets(config)
    if backend is None:
        backend, tokenizer = make_backend(config)
    reports = {t.tag: evaluate_target(config, t, backend, tokenizer, k=k, n=n, baselines=baselines) for t in targets}
    if len(reports) == 1:
        return next(iter(reports.values()))
    return {"model": config.model, "tags": reports}


def evaluate_target(config: RunConfig, target: EvalTarget, backend, tokenizer, *, k: int, n: int,
                    baselines: bool) -> dict[str, Any]:
    """One validation set's report: the model greedy (and sampled for pass@k), then the baselines."""
    notes: list[str] = []
    if config.model.startswith(OPENAI_PREFIX) and target.settings.response_prefix:
        notes.append(f"agent.response_prefix {target.settings.response_prefix!r} not used: a chat API cannot be prefilled")
        target = replace(target, settings=replace(target.settings, response_prefix=""))
    seeds = validation_seeds(target.episodes)
    model = run_model(config, backend, tokenizer, seeds, k=k, n=n, target=target)
    greedy, sampled = model["greedy"], model.get("sampled", {})
    report: dict[str, Any] = {
        "model": config.model,
        "tag": target.tag,
        "env": target.env,
        "env_config": dict(target.env_config),
        "episodes": len(seeds),
        "seeds": {"first": seeds[0], "count": len(seeds)},
        "temperature": config.rollout.temperature,
        "k": k,
        "n": n if k > 0 else 0,
        # headline numbers
        "success": greedy.get("success"),
        "pass_at_k": sampled.get("pass_at_k"),
        "reward_mean": greedy.get("reward_mean"),
        "valid_action_rate": greedy.get("valid_action_rate"),
        "response_length": greedy.get("response_length"),
        "greedy": greedy,
        "greedy_success_by_seed": model.get("greedy_success_by_seed", []),
        "sampled": sampled or None,
        "optimality": model.get("optimality"),
        "baselines": {},
        "notes": notes,
        "examples": {"greedy": model["greedy_examples"], "sampled": model.get("sampled_examples", [])},
    }
    if k > 0:
        report[f"pass@{k}"] = sampled.get("pass_at_k")
    if greedy.get("env_errors"):
        notes.append(f"{int(greedy['env_errors'])} greedy episode(s) ended with an env error and are left out")
    if sampled.get("env_errors"):
        notes.append(f"{int(sampled['env_errors'])} sampled episode(s) ended with an env error and are left out; "
                     f"pass@{k} is over the {sampled['seeds_scored']} of {len(seeds)} seeds with at least {k} samples left")
    if greedy.get("context_full"):
        notes.append(f"{greedy['context_full']:.1%} of greedy episodes ended early at the model's context (counted as "
                     "played: a success only if the env reported one before)")
    if baselines:
        for name in ("random", "expert"):
            row = run_baseline(config, name, seeds, target)
            report["baselines"][name] = row
            if "skipped" in row:
                notes.append(f"{name} baseline skipped: {row['skipped']}")
    return report


def _undefined(value: Any) -> bool:
    """NaN, or null in a report read back from ``--json``: shown as ``-``."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _cell(value: Any, digits: int = 3) -> str:
    if _undefined(value):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _percent(value: Any) -> str:
    """A share as ``12.5 %``, or ``-`` where it is undefined."""
    return "-" if _undefined(value) else f"{100 * value:.1f} %"


def format_table(report: dict[str, Any]) -> str:
    """A plain-text table: the model greedy and sampled, then the baselines, same seeds (one per validation set)."""
    if "tags" in report:
        return "\n\n".join(format_table(sub) for sub in report["tags"].values())
    k = report["k"]
    pass_col = f"pass@{k}" if k else "pass@k"
    header = (f"{'agent':<24}{'success':>9}{'95% CI':>12}{pass_col:>9}{'reward':>9}{'valid':>8}{'resp_len':>10}"
              f"{'turns':>7}")
    lines = [
        f"ragen eval: model={report['model']}  env={report['env']}"
        + (f" (tag {report['tag']})" if report.get("tag", report["env"]) != report["env"] else "") + "  "
        f"{report['episodes']} held-out seeds ({report['seeds']['first']}..+{report['episodes'] - 1})",
        header,
        "-" * len(header),
    ]

    def row(label: str, m: dict[str, Any], pk: Any = None) -> str:
        low, high = m.get("success_ci_low"), m.get("success_ci_high")
        ci = "-" if _undefined(low) or _undefined(high) else f"{low:.2f}-{high:.2f}"
        return (f"{label:<24}{_cell(m.get('success')):>9}{ci:>12}{_cell(pk):>9}{_cell(m.get('reward_mean')):>9}"
                f"{_cell(m.get('valid_action_rate'), 2):>8}{_cell(m.get('response_length'), 1):>10}"
                f"{_cell(m.get('turns_per_episode'), 1):>7}")

    lines.append(row("model, greedy", report["greedy"]))
    if report.get("sampled"):
        s = report["sampled"]
        lines.append(row(f"model, T={report['temperature']:g} x{s['n']}", s, s.get("pass_at_k")))
    for name, m in report["baselines"].items():
        label = f"{name} agent" + (" (oracle)" if name == "expert" else "")
        lines.append(f"{label:<24}{'skipped':>9}" if "skipped" in m else row(label, m))
    opt = report.get("optimality")
    if opt:
        lines.append(f"{'model, greedy, value':<24}{_cell(opt['value_estimate']):>9} +- {_cell(opt['value_estimate_se'])}"
                     f" = {_percent(opt['ratio_to_optimum'])} of the optimum {_cell(opt['optimum'])}"
                     f" (success {_cell(opt['success'])} +- {_cell(opt['success_se'])};"
                     f" optimal moves {_percent(opt['optimal_move_rate'])})")
    lines.append("")
    if report.get("sampled"):
        lines.append("success: greedy decoding, with its 95 % Wilson interval; model sampled row: success = mean over "
                     f"samples, {pass_col} = Chen et al. unbiased estimator; valid = format-valid turn rate.")
    else:  # --k 0: no sampled row, no pass@k
        lines.append("success: greedy decoding, with its 95 % Wilson interval; valid = format-valid turn rate.")
    if opt:
        lines.append("value: the greedy policy's success probability estimated from its moves' regret against "
                     "the exact optimum (performance-difference identity, ragen/eval/optimality.py), +- one standard error.")
    lines.extend(f"note: {note}" for note in report["notes"])
    return "\n".join(lines)


__all__ = ["evaluate", "evaluate_target", "eval_targets", "EvalTarget", "format_table", "pass_at_k", "validation_seeds", "run_baseline", "run_model", "make_backend", "OPENAI_PREFIX"]
