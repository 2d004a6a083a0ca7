"""SFT data: expert demonstrations, or successful rollouts of a trained policy, as chat JSONL.

Each record is one episode in exactly the chat the agent sees at rollout
(:func:`ragen.agent.conversation.record_conversation` builds it with
:class:`ragen.agent.context.PromptFormat`, the same wording as :class:`ragen.agent.Rollout`),
one JSON object per line, in the ``messages`` format the ``datasets`` library and most SFT
tools read::

    {"messages": [{"role": "system", ...}, {"role": "user", ...}, {"role": "assistant", ...}, ...],
     "env": "sokoban", "env_config": {...}, "seed": 17, "source": "expert", "success": true,
     "reward": 10.7, "actions": [["Up", "Left"], ...], "plans": [["Up", "Left", "Down"], ...],
     "agent": {...the run config's agent section...}}

``actions`` are the actions answered each turn, ``plans`` the solver's whole plan at that
turn (empty for rollout data), ``agent`` the settings the chat was built with (the SFT
trainer reads ``response_prefix`` from it).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

import ragen.envs
from ragen.agent.parser import parse_response
from ragen.agent import AgentConfig
from ragen.config import RunConfig, load_config
from ragen.agent.conversation import record_conversation
from ragen.envs.agents import Agent, Budget, ExpertAgent
from ragen.envs.contract import EnvContractError
from ragen.files import atomic_open
from ragen.sft.rationale import explain

#: Seeds of generated data are drawn below this bound, like training seeds: validation seeds
#: (``ragen.agent.env_sets.VAL_SEED_BASE`` and up) never appear in SFT data.
SEED_BOUND = 2**31


class PlanningExpert(ExpertAgent):
    """:class:`ExpertAgent` that remembers the solver's whole plan of every turn (``last_plan``
    feeds the rationale, ``plans`` the record). :func:`record_conversation` gives it the
    episode's budget, so FrozenLake's plans are optimal for the moves left."""

    def __init__(self, max_actions_per_turn: int | None = None):
        super().__init__(max_actions_per_turn)
        self.plans: list[list[str]] = []

    def begin_episode(self, env: Any, seed: int | None, budget: Budget | None = None) -> None:
        super().begin_episode(env, seed, budget)
        self.plans = []

    def act(self, env: Any) -> list[str]:
        actions = super().act(env)
        self.plans.append(self.last_plan)
        return actions


class ReplayAgent(Agent):
    """Answers each turn with logged actions and carries that turn's logged ``<think>`` text."""

    name = "replay"

    def __init__(self, turns: list[tuple[str, list[str]]]):
        self.turns = list(turns)  # (think, actions) per turn
        self.index = 0
        self.current_think = ""

    def begin_episode(self, env: Any, seed: int | None, budget: Budget | None = None) -> None:
        self.index = 0

    def act(self, env: Any) -> list[str]:
        if self.index >= len(self.turns):  # the log ran out: an answer that ends the replay as invalid
            self.current_think = ""
            return []
        self.current_think, actions = self.turns[self.index]
        self.index += 1
        return list(actions)


def demo_target(config: RunConfig) -> tuple[str, dict, AgentConfig]:
    """(env name, env config, agent settings) that demonstrations are played with: the run's
    training env exactly as ``ragen train`` would roll it out, i.e. its one ``es.train`` tag
    (with the tag's horizon and instructions) or, without tags, ``env`` and ``agent``."""
    from ragen.agent.env_sets import train_sets

    sets = train_sets(config)
    if len(sets) != 1:
        raise ValueError(f"SFT data comes from one env: es.train lists {len(sets)} tags "
                         f"({', '.join(s.name for s in sets)}); keep one (es.train=[{{tag: NAME}}])")
    tag, settings = sets[0].tag, sets[0].settings
    if settings.context_mode != "full":
        raise ValueError("SFT data is whole-episode chats (agent.context_mode=full); per-turn window "
                         "demonstrations for agent.context_mode=window are not implemented")
    return tag.env, dict(tag.config), settings


def agent_settings(config: RunConfig) -> AgentConfig:
    """The rollout's agent settings for ``config`` (as :class:`ragen.train.trainer.StarPOTrainer` builds them)."""
    return demo_target(config)[2]


def turn_actions(messages: list[dict], settings: AgentConfig) -> list[list[str]]:
    """The actions of every assistant turn, parsed back with the rollout's parser."""
    out = []
    for message in messages:
        if message["role"] == "assistant":
            parsed = parse_response(message["content"], enable_think=settings.enable_think,
                                    max_actions=settings.max_actions_per_turn, action_sep=settings.action_sep)
            out.append(parsed.actions)
    return out


def make_record(config: RunConfig, seed: int, episode: dict[str, Any], source: str, plans: list[list[str]]) -> dict[str, Any]:
    """One JSONL record (see the module docstring) from a :func:`record_conversation` result."""
    env_name, env_config, settings = demo_target(config)
    return {
        "messages": episode["messages"],
        "env": env_name,
        "env_config": env_config,
        "seed": int(seed),
        "source": source,
        "success": bool(episode["success"]),
        "reward": float(episode["reward"]),
        "actions": turn_actions(episode["messages"], settings),
        "plans": [list(p) for p in plans],
        "agent": asdict(settings),
    }


def expert_records(config: RunConfig, n: int, *, keep_failures: bool = False, max_episodes: int | None = None,
                   stats: dict | None = None) -> Iterator[dict]:
    """Up to ``n`` expert episodes on distinct seeds drawn from ``config.seed``.

    Failed episodes (the solver ran out of turns or actions, or slipped into a hole) are
    skipped unless ``keep_failures``; at most ``max_episodes`` (default ``20 n``) are played.
    ``stats``, if given, is updated with ``played`` and ``succeeded`` episode counts.
    The env and agent settings are checked by this call (``ValueError``), before any episode.
    """
    stats = stats if stats is not None else {}
    stats.update(played=0, succeeded=0)
    env_name, env_config, settings = demo_target(config)
    env = ragen.envs.make(env_name, **env_config)
    return _expert_episodes(config, env, settings, n, keep_failures, max_episodes, stats)


def _expert_episodes(config: RunConfig, env: Any, settings: AgentConfig, n: int, keep_failures: bool,
                     max_episodes: int | None, stats: dict) -> Iterator[dict]:
    expert = PlanningExpert(max_actions_per_turn=settings.max_actions_per_turn)

    def think(env_: Any, actions: list[str]) -> str:
        return explain(env_, expert.last_plan, actions, moves_left=expert.last_moves_left)

    rng = np.random.default_rng(config.seed)
    seen: set[int] = set()
    kept, played = 0, 0
    limit = max_episodes if max_episodes is not None else 20 * n
    while kept < n and played < limit:
        seed = int(rng.integers(0, SEED_BOUND))
        if seed in seen:
            continue
        seen.add(seed)
        played += 1
        try:
            episode = record_conversation(env, expert, seed=seed, settings=settings, think=think)
        except EnvContractError as exc:  # the env broke the contract: its sentence, with the seed
            raise EnvContractError(f"seed {seed}: {exc}") from exc
        except ValueError:  # the env or the expert refusing (an unsupported env, a bad id): already one clear line
            raise
        except Exception as exc:  # anything else a user env raises: one line naming the seed (the CLI prints it)
            raise ValueError(f"{type(env.unwrapped).__name__} seed {seed}: the expert's episode raised {exc!r}") from exc
        stats["played"] = played
        stats["succeeded"] = stats["succeeded"] + int(episode["success"])
        if episode["success"] or keep_failures:
            kept += 1
            yield make_record(config, seed, episode, "expert", expert.plans)


def run_config(run_dir: str | Path) -> RunConfig:
    """The resolved config a ``ragen train`` run dir was trained with."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: not a run directory (no config.yaml)")
    return load_config(str(path))


def rollout_logs(run_dir: str | Path) -> list[Path]:
    """The rollout logs (``rollouts/*.jsonl``) of a ``ragen train`` run dir, in step order."""
    return sorted(p for p in (Path(run_dir) / "rollouts").glob("*.jsonl") if p.is_file())


def rollout_records(run_dir: str | Path, n: int = 0) -> Iterator[dict]:
    """Rejection sampling: the successful, fully well-formed episodes logged in ``run_dir/rollouts/*.jsonl``.

    Each logged episode is replayed in its env from its seed with the logged actions and
    ``<think>`` texts, so the chat is rebuilt exactly as the rollout wrote it (replies in
    the canonical ``<think>…</think><answer>a1 || a2</answer>`` spelling). An episode is
    kept only if the replay succeeds again and every turn parsed; duplicates (same seed,
    same replies, e.g. within a group) are kept once. ``n > 0`` caps the count.

    The run dir, its config and its env are checked by this call (``FileNotFoundError``,
    ``ConfigError``, ``ValueError``); a log line that is not a rollout record raises
    ``ValueError`` naming the file and line when the iteration reaches it.
    """
    config = run_config(run_dir)
    env_name, env_config, settings = demo_target(config)
    env = ragen.envs.make(env_name, **env_config)
    logs = rollout_logs(run_dir)
    if not logs:
        raise FileNotFoundError(f"{run_dir}: no rollouts/*.jsonl (set trainer.log_rollouts_freq / log_rollouts_n when training)")
    return _replayed_rollouts(config, env, settings, logs, n)


def _rollout_problem(logged: Any) -> str | None:
    """What makes ``logged`` unusable as a rollout log record (the keys this module reads), or None."""
    if not isinstance(logged, dict):
        return f"not a JSON object (got {json_kind(logged)})"
    turns = logged.get("turns")
    if not isinstance(turns, list):
        return f"'turns' must be a list (got {json_kind(turns)})"
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return f"turns[{k}] is not an object (got {json_kind(turn)})"
        if not isinstance(turn.get("response"), str):
            return f"turns[{k}].response must be a string (got {json_kind(turn.get('response'))})"
        if "format_valid" not in turn:
            return f"turns[{k}] has no 'format_valid'"
    seed = logged.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        return f"'seed' must be an integer (got {json_kind(seed)})"
    return None


def _replayed_rollouts(config: RunConfig, env: Any, settings: AgentConfig, logs: list[Path], n: int) -> Iterator[dict]:
    seen: set[tuple] = set()
    kept = 0
    for log in logs:
        for number, logged in iter_jsonl(log):
            problem = _rollout_problem(logged)
            if problem:
                raise ValueError(f"{log}:{number}: not a rollout record: {problem}")
            if not logged.get("success") or logged.get("error") or not all(t["format_valid"] for t in logged["turns"]):
                continue
            turns = []
            for t in logged["turns"]:
                parsed = parse_response(t["response"], enable_think=settings.enable_think,
                                        max_actions=settings.max_actions_per_turn, action_sep=settings.action_sep)
                turns.append((parsed.think or "", parsed.actions))
            key = (logged["seed"], tuple((think, tuple(actions)) for think, actions in turns))
            if key in seen:
                continue
            agent = ReplayAgent(turns)
            episode = record_conversation(env, agent, seed=logged["seed"], settings=settings,
                                          think=lambda env_, actions: agent.current_think)
            replies = sum(m["role"] == "assistant" for m in episode["messages"])
            if not episode["success"] or replies != len(turns):
                continue
            seen.add(key)
            kept += 1
            yield make_record(config, logged["seed"], episode, f"rollout:{log.parent.parent.name}/{log.stem}", [])
            if n and kept >= n:
                return


def output_problem(out: str | Path, inputs: Iterable[str | Path] = (), run_dir: str | Path | None = None) -> str | None:
    """Why ``--out`` must not be written (a directory, one of the ``inputs``, a run's rollout log), or None."""
    out = Path(out)
    if out.is_dir():
        return f"--out {out} is a directory; give a file name"
    for item in inputs:
        item = Path(item)
        same = out.resolve() == item.resolve()
        if not same and out.exists() and item.exists():
            same = out.samefile(item)
        if same:
            return f"--out {out} is an input of this command ({item}); write to another file"
    if run_dir is not None and out.suffix == ".jsonl" and out.resolve().parent == (Path(run_dir) / "rollouts").resolve():
        return f"--out {out} is in {run_dir}/rollouts, where it would be read as a rollout log; write to another directory"
    return None


def write_jsonl(records: Iterable[dict], path: str | Path) -> int:
    """Write ``records`` one JSON object per line (UTF-8); return how many were written.

    Atomic: the lines go to a temp file next to ``path``, which replaces ``path`` only after
    the last record, so an error (or Ctrl-C) while the records are produced leaves an existing
    ``path`` untouched.
    """
    count = 0
    with atomic_open(path) as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count


class ReplyLengths:
    """Token counts of the assistant replies of records passing through :meth:`watch`, against a rollout's
    ``max_new_tokens``: a demonstrated reply longer than that teaches what an RL run with the same config cuts off.

    A reply is counted as the model writes it (:meth:`~ragen.agent.context.ChatTokens.encode_reply`, after the
    ``response_prefix`` the rollout puts before the model's turn), without the end token: the rollout stops at
    ``</answer>``, so a reply of exactly ``max_new_tokens`` tokens fits.
    """

    def __init__(self, tokenizer, max_new_tokens: int):
        from ragen.agent.context import ChatTokens

        self.chat, self.max_new_tokens = ChatTokens(tokenizer), max_new_tokens
        self.replies, self.over, self.longest = 0, 0, 0

    def watch(self, records: Iterable[dict]) -> Iterator[dict]:
        for record in records:
            prefix = (record.get("agent") or {}).get("response_prefix") or ""
            for message in record["messages"]:
                if message["role"] == "assistant":
                    n = len(self.chat.encode_reply(message["content"][len(prefix):]))
                    self.replies, self.longest = self.replies + 1, max(self.longest, n)
                    self.over += n > self.max_new_tokens
            yield record

    def note(self) -> str | None:
        """One line when some reply is over the budget, else None."""
        if not self.over:
            return None
        return (f"{self.over} of {self.replies} replies are longer than rollout.max_new_tokens={self.max_new_tokens} "
                f"tokens (longest {self.longest}): an RL run with this config would cut them off; "
                "raise rollout.max_new_tokens there (and here, to silence this)")


def json_kind(value: Any) -> str:
    """``value``'s JSON type for an error message: "an object", "a list", "a string", "a number", "true", "null"."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` of every non-blank line; ``ValueError`` naming the file and line if one is not UTF-8 JSON."""
    with Path(path).open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{path}:{number}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
            except (ValueError, RecursionError) as exc:  # a >4300-digit integer, nesting deeper than the parser goes
                raise ValueError(f"{path}:{number}: not usable JSON ({type(exc).__name__}: {str(exc)[:120]})") from None


def read_jsonl(path: str | Path) -> list[dict]:
    """Every record of a JSONL file (blank lines skipped); ``ValueError`` naming the line if one is not a JSON object."""
    records = []
    for number, value in iter_jsonl(path):
        if not isinstance(value, dict):
            raise ValueError(f"{path}:{number}: not a JSON object (got {json_kind(value)})")
        records.append(value)
    return records


__all__ = ["PlanningExpert", "ReplayAgent", "ReplyLengths", "expert_records", "rollout_records", "rollout_logs", "make_record", "write_jsonl",
           "read_jsonl", "iter_jsonl", "json_kind", "output_problem", "agent_settings", "demo_target", "turn_actions", "run_config", "SEED_BOUND"]
