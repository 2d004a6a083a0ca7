"""Rendered env frames for the viewer: re-create a trajectory's env and replay its actions.

A saved trajectory (``RUN_DIR/rollouts/step_*.jsonl``, written by the trainer from
``Trajectory.to_json``) records the env name, the env tag, the seed, the initial observation
and, per turn, the parsed action strings, whether the answer was valid and the observation
after the turn. The env's constructor config and the episode's action budget
(``max_actions_per_traj``) come from the tag, resolved from ``RUN_DIR/config.yaml`` the way
the trainer resolves it (``es.tags``, the single ``env`` section, or a preset tag).

The env is rebuilt with ``render_mode="rgb_array"``, reset with the recorded seed, and each
valid turn's actions are stepped exactly as the rollout stepped them. Envs draw all their
randomness from the seeded generator, so slippery FrozenLake slips the same way again. A
frame is shown only after the replayed *text* observation equals the recorded one; at the
first difference (or an error) replay stops and the page shows a note instead of a wrong
picture. Only envs that declare ``"rgb_array"`` in ``metadata["render_modes"]`` get frames
(Sokoban and FrozenLake); for the others :func:`replay_frames` returns ``None``.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ragen.envs.base import GROUP_MEMBER_OPTION


class ReplayError(Exception):
    """Why a trajectory's frames cannot be shown; the message is displayed (escaped) on the page."""


@dataclass
class Frames:
    """PNG data URIs: ``initial`` (None if not shown) and one per turn (None from the first failure on)."""

    initial: str | None = None
    turns: list[str | None] = field(default_factory=list)
    #: Why frames stop, "" when every frame was verified and shown.
    note: str = ""
    #: Where the note belongs: 0 = the initial observation, k = turn k (1-based); None without a note.
    note_at: int | None = None


@dataclass
class EnvSpec:
    env: str
    config: dict[str, Any]
    #: Action budget of the episode (0 = none), as the rollout applied it.
    max_actions_per_traj: int = 0


def read_run_config(run_dir: Path) -> dict | None:
    """``RUN_DIR/config.yaml`` as plain data; None when it is missing or unreadable."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    try:
        import yaml

        data = yaml.safe_load(path.read_text(encoding="utf-8", errors="replace"))
    except Exception:
        return None
    return data if isinstance(data, dict) else None


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def resolve_spec(run_config: dict | None, traj: dict) -> EnvSpec:
    """The env, its config and its action budget for ``traj``, as the trainer built them."""
    from ragen.envs.tags import PRESET_TAGS, extend_preset

    env_name = traj.get("env")
    if not isinstance(env_name, str):
        raise ReplayError("the trajectory names no env")
    tag = traj.get("tag") or env_name
    if not isinstance(tag, str):
        raise ReplayError("the trajectory's env tag is not a string")
    if run_config is None:
        # No config.yaml (a partial copy of the run): try the env's defaults; verification guards the result.
        run_config = {"env": {"name": env_name, "config": {}}}
    es = _dict(run_config.get("es"))
    user_tags = _dict(es.get("tags"))
    env_section = _dict(run_config.get("env"))
    single = {"env": env_section.get("name"), "config": env_section.get("config")}
    if tag in user_tags:
        raw = _dict(user_tags[tag])
        if not raw.get("env") and tag in PRESET_TAGS and isinstance(raw.get("config") or {}, dict):
            # a tag without env extends the preset of its name (ragen.envs.tags.resolve_tag)
            raw = extend_preset(tag, raw)
    elif not es.get("train") and tag == env_section.get("name"):
        raw = single
    elif tag in PRESET_TAGS:
        raw = PRESET_TAGS[tag]
    elif tag == env_section.get("name"):
        raw = single
    else:
        raise ReplayError(f"env tag {tag!r} is not defined in config.yaml")
    if raw.get("env") != env_name:
        raise ReplayError(f"env tag {tag!r} is env {raw.get('env')!r} in config.yaml, but the trajectory says {env_name!r}")
    config = raw.get("config") or {}
    if not isinstance(config, dict):
        raise ReplayError(f"env tag {tag!r}: its config is not a mapping")
    budget = raw.get("max_actions_per_traj")
    if budget is None:
        budget = _dict(run_config.get("agent")).get("max_actions_per_traj", 0)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ReplayError(f"env tag {tag!r}: max_actions_per_traj {budget!r} is not an int >= 0")
    return EnvSpec(env_name, dict(config), budget)


def renders_frames(env_name: Any) -> bool:
    """Whether ``env_name`` is a registered env with an ``rgb_array`` render mode."""
    if not isinstance(env_name, str):
        return False
    import ragen.envs

    cls = ragen.envs.registered().get(env_name)
    modes = getattr(cls, "metadata", {}).get("render_modes", ()) if cls is not None else ()
    return "rgb_array" in modes


def png_data_uri(frame) -> str:
    from ragen.envs.render import encode_png

    return "data:image/png;base64," + base64.b64encode(encode_png(frame)).decode("ascii")


def replay_frames(traj: dict, run_config: dict | None) -> Frames | None:
    """Frames for ``traj``; None for envs without ``rgb_array`` rendering (the page shows no frames)."""
    if not renders_frames(traj.get("env")):
        return None
    frames = Frames()
    turns = traj.get("turns") if isinstance(traj.get("turns"), list) else []
    try:
        _replay(traj, turns, run_config, frames)
    except ReplayError as exc:
        frames.note = str(exc)
    except Exception as exc:  # an env or config problem: report it, never break the page
        frames.note = f"replay failed: {type(exc).__name__}: {exc}"
    if frames.note and frames.note_at is None:
        frames.note_at = 0 if frames.initial is None else len(frames.turns) + 1
    frames.turns += [None] * (len(turns) - len(frames.turns))
    return frames


def _replay(traj: dict, turns: list, run_config: dict | None, frames: Frames) -> None:
    import ragen.envs

    spec = resolve_spec(run_config, traj)
    seed = traj.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ReplayError(f"seed {seed!r} is not a non-negative int")
    member = traj.get("group_member", 0)  # absent in runs logged before it was recorded (all such envs ignore it)
    if isinstance(member, bool) or not isinstance(member, int) or member < 0:
        raise ReplayError(f"group_member {member!r} is not a non-negative int")
    env = ragen.envs.make(spec.env, render_mode="rgb_array", **spec.config)
    base = env.unwrapped
    observation, _ = env.reset(seed=seed, options={GROUP_MEMBER_OPTION: member})
    if observation != traj.get("initial_observation"):
        raise ReplayError(
            f"replaying {spec.env} with seed {seed} and the run's config gave a different initial observation; "
            "no frames are shown"
        )
    frames.initial = png_data_uri(env.render())
    actions_left = spec.max_actions_per_traj or None
    done = False
    for k, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict) or "observation" not in turn:
            raise ReplayError(f"turn {k} has no recorded observation; no frames from here on")
        if done:
            raise ReplayError(f"the replayed episode had already ended before turn {k}; no frames from here on")
        valid = turn.get("format_valid")
        if valid is True:
            actions = turn.get("actions")
            if not isinstance(actions, list) or not all(isinstance(a, str) for a in actions):
                raise ReplayError(f"turn {k}: the recorded actions are not a list of strings; no frames from here on")
            ids = [base.parse_action(a) for a in actions]
            if None in ids:
                raise ReplayError(f"turn {k}: a recorded action does not parse; no frames from here on")
            if actions_left is not None:
                ids = ids[:actions_left]
            for action_id in ids:
                observation, _, terminated, truncated, _ = env.step(action_id)
                if actions_left is not None:
                    actions_left -= 1
                if terminated or truncated:
                    done = True
                    break
        elif valid is not False:
            raise ReplayError(f"turn {k}: format_valid is not recorded; no frames from here on")
        if actions_left is not None and actions_left <= 0:
            done = True
        if observation != turn.get("observation"):
            raise ReplayError(
                f"turn {k}: the replayed observation differs from the recorded one; no frames from here on"
            )
        frames.turns.append(png_data_uri(env.render()))
