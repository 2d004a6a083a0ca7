"""Checks of a whole run config beyond its types: value ranges, keys that contradict each other, env settings the
env sets would ignore. Each failure raises :class:`ragen.errors.ConfigError` naming the key."""

from __future__ import annotations

from dataclasses import asdict, is_dataclass
from typing import Any

from omegaconf import OmegaConf

from ragen.errors import ConfigError
from ragen.models.device import check_device_spec
from ragen.models.precision import PRECISIONS
from ragen.config_io import checkpointing_setting
from ragen.config_schema import RolloutConfig, RunConfig
from ragen.engines.base import ENGINES


def single_env_key(item: str) -> str | None:
    """The key a ``key=value`` override sets that only the single-env case reads (``env`` and everything
    in it, ``rollout.env_groups``), also inside a dict value (``rollout={env_groups: 3}``); else None."""
    key = item.split("=", 1)[0].strip()
    if key == "env" or key.startswith("env."):
        return key
    tree = OmegaConf.from_dotlist([item])
    return "rollout.env_groups" if OmegaConf.select(tree, "rollout.env_groups") is not None else None


def _reject_overrides_es_train_ignores(config: RunConfig, overrides: list[str] | tuple[str, ...]) -> None:
    """A ``key=value`` override the run would not use is an error, not a silent no-op.

    With ``es.train`` set the training envs are its tags, so ``env.*`` and ``rollout.env_groups``
    are never read; typed on the command line they are a mistake the user must hear about. The
    same settings coming from a YAML file are only noted (:func:`lost_env_settings`): a preset's
    ``env`` section under a command-line ``es.train``, or a run's saved ``config.yaml``, is not
    something the user just typed, and resuming such a run must keep working.
    """
    if not config.es.train:
        return
    for item in overrides:
        key = single_env_key(item)
        if key is None:
            continue
        if key == "rollout.env_groups":
            fix = "give each es.train entry its groups (es.train=[{tag: TAG, groups: N}])"
        elif key.startswith("env.config."):
            fix = (f"set it on the tag instead: es.tags.TAG.config.{key[len('env.config.'):]}=VALUE, TAG as listed in "
                   "es.train (a preset tag keeps its other settings)")
        else:
            fix = "train on a tag instead (es.tags.TAG={env: ENV, config: {...}}; docs/env_tags.md)"
        raise ConfigError(f"config key {key!r}: not used when es.train is set (its tags are the training envs); {fix}")


def reject_env_overrides_eval_ignores(config: RunConfig, overrides: list[str] | tuple[str, ...]) -> None:
    """For ``ragen eval``: an ``env.*`` override is an error when ``es.val`` tags are what is evaluated.

    Eval plays the ``es.val`` tags (each with its own env config) when there are any, so ``env.*``
    typed on the command line would change nothing. (With ``es.train`` set, :func:`load_config`
    has already refused it.)
    """
    if not config.es.val:
        return
    for item in overrides:
        key = single_env_key(item)
        if key is None or not key.startswith("env"):
            continue
        tags = ", ".join(entry.tag for entry in config.es.val)
        setting = f"es.tags.TAG.config.{key[len('env.config.'):]}=VALUE" if key.startswith("env.config.") else "es.tags.TAG=..."
        raise ConfigError(f"config key {key!r}: not used by eval when es.val is set (its tags, {tags}, are the envs "
                          f"evaluated); set it on a tag ({setting}), or pass 'es.val=[]' to evaluate env itself")


def lost_env_settings(config: RunConfig) -> list[str]:
    """Settings from the single-env keys that ``es.train`` leaves unused and that differ from what it trains on.

    ``env.config.KEY`` when no training env of ``env.name`` ends up with that value (the envs' resolved
    configs are compared, so a key at the env's default, or at the tag's value, loses nothing), and
    ``rollout.env_groups`` when it is away from its default and from the groups ``es.train`` sums to.
    """
    if not config.es.train:
        return []
    lost = []
    if config.env.config:
        import ragen.envs
        from ragen.envs.tags import resolve_tag

        user = user_tag_dicts(config)
        tags = [resolve_tag(entry.tag, user) for entry in config.es.train]
        trained = [tag.make_env() for tag in tags if tag.env == config.env.name]
        try:
            section = ragen.envs.make(config.env.name, **config.env.config)  # its resolved config (types, defaults)
        except (ValueError, TypeError):  # never validated under es.train: compare the values as written
            section = None
        missing = object()
        for key, written in config.env.config.items():
            value = getattr(getattr(section, "config", None), key, written)
            if not any(getattr(getattr(env, "config", None), key, missing) == value for env in trained):
                lost.append(f"env.config.{key}")
        for env in [*trained, section]:
            if env is not None:
                env.close()
    groups = sum(entry.groups for entry in config.es.train)
    if config.rollout.env_groups not in (RolloutConfig().env_groups, groups):
        lost.append("rollout.env_groups")
    return lost


CONTEXT_MODES = ("full", "window")


def validate(config: RunConfig) -> None:
    """Cross-field checks that types alone cannot express."""

    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"config key {key!r}: {why}")

    need(config.rollout.env_groups >= 1, "rollout.env_groups", "must be >= 1")
    need(config.rollout.group_size >= 1, "rollout.group_size", "must be >= 1")
    need(config.rollout.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
    need(config.rollout.temperature > 0, "rollout.temperature", "must be > 0")
    need(0 < config.rollout.top_p <= 1, "rollout.top_p", "must be in (0, 1] (1 = off)")
    need(config.rollout.top_k >= 0, "rollout.top_k", "must be >= 0 (0 = off)")
    need(config.rollout.batch_size >= 1, "rollout.batch_size", "must be >= 1 (sequences per generate call)")
    need(0 <= config.seed < 2**32, "seed", "must be in [0, 2**32)")
    need(config.rollout.backend in ("local", "ray"), "rollout.backend", "must be 'local' or 'ray'")
    need(config.rollout.num_workers >= 1, "rollout.num_workers", "must be >= 1")
    need(config.rollout.engine in ENGINES, "rollout.engine", f"must be one of {', '.join(ENGINES)}")
    need(config.agent.max_turn >= 1, "agent.max_turn", "must be >= 1")
    need(config.agent.max_actions_per_turn >= 1, "agent.max_actions_per_turn", "must be >= 1")
    need(bool(config.agent.action_sep.strip()), "agent.action_sep", "must be non-blank text (it splits an answer into actions)")
    need(config.agent.context_mode in CONTEXT_MODES, "agent.context_mode", f"must be one of {', '.join(CONTEXT_MODES)}")
    need(config.agent.max_context_window >= 0, "agent.max_context_window", "must be >= 0 (past turns kept in a window prompt)")
    need(config.trainer.total_steps >= 0, "trainer.total_steps", "must be >= 0")
    need(config.trainer.val_temperature > 0 or not config.trainer.val_do_sample, "trainer.val_temperature",
         "must be > 0 (or trainer.val_do_sample=false for greedy validation)")
    for key in ("val_freq", "save_freq", "log_rollouts_freq", "log_rollouts_n", "keep_checkpoints"):
        need(getattr(config.trainer, key) >= 0, f"trainer.{key}", "must be >= 0")
    need(config.trainer.precision in PRECISIONS, "trainer.precision", f"must be one of {', '.join(PRECISIONS)}")
    need(check_device_spec(config.trainer.device) is None, "trainer.device", str(check_device_spec(config.trainer.device)))
    if config.trainer.fsdp:
        import torch

        from ragen.train.fsdp import fsdp_available

        need(fsdp_available(), "trainer.fsdp", f"this torch ({torch.__version__}) lacks the FSDP2 API it needs "
             "(torch.distributed.fsdp.fully_shard with FSDPModule.set_force_sum_reduction_for_comms)")
    need(config.algorithm.ppo_epochs >= 1, "algorithm.ppo_epochs", "must be >= 1")
    need(config.algorithm.mini_batch_size >= 0, "algorithm.mini_batch_size", "must be >= 0 (0 = the whole batch)")
    for key in ("gamma", "lam", "high_level_gamma", "gigpo_gamma"):
        need(0 <= getattr(config.algorithm, key) <= 1, f"algorithm.{key}", "must be in [0, 1]")
    need(0 <= config.algorithm.clip_ratio_low <= 1, "algorithm.clip_ratio_low", "must be in [0, 1] (the ratio's floor is 1 - it)")
    need(config.algorithm.clip_ratio_high >= 0, "algorithm.clip_ratio_high", "must be >= 0")
    need(config.algorithm.clip_ratio_c is None or config.algorithm.clip_ratio_c > 1, "algorithm.clip_ratio_c",
         "must be > 1 (dual clip) or null (off)")
    need(config.algorithm.clip_range_value is None or config.algorithm.clip_range_value > 0, "algorithm.clip_range_value",
         "must be > 0 or null (off)")
    need(config.algorithm.micro_batch_size >= 1, "algorithm.micro_batch_size", "must be >= 1")
    need(config.algorithm.max_tokens_per_micro_batch >= 0, "algorithm.max_tokens_per_micro_batch", "must be >= 0 (0: no bound)")
    config.trainer.gradient_checkpointing = checkpointing_setting(config.trainer.gradient_checkpointing,
                                                                  "trainer.gradient_checkpointing")
    need(config.rollout.max_episodes_in_flight >= 0, "rollout.max_episodes_in_flight", "must be >= 0 (0 = all at once)")
    need(config.rollout.reuse_kv_max_gb > 0, "rollout.reuse_kv_max_gb",
         "must be > 0 (rollout.reuse_kv=false keeps no caches at all)")
    need(config.optim.lr > 0, "optim.lr", "must be > 0")
    need(config.optim.grad_clip > 0, "optim.grad_clip", "must be > 0 (the largest gradient norm; inf = no clipping)")
    need(config.optim.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    need(config.optim.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
    need(len(config.optim.betas) == 2 and all(0 <= b < 1 for b in config.optim.betas), "optim.betas",
         f"must be two numbers in [0, 1), AdamW's (beta1, beta2) (got {list(config.optim.betas)})")
    need(config.optim.trainable_layers >= 0, "optim.trainable_layers", "must be >= 0 (0 = every layer trains)")
    need(config.lora.rank >= 0, "lora.rank", "must be >= 0")
    need(config.trainer.val_episodes >= 1, "trainer.val_episodes", "must be >= 1")
    need(0 < config.algorithm.filter_ratio <= 1, "algorithm.filter_ratio", "must be in (0, 1]")
    need(config.algorithm.filter_mode in ("top_p", "top_p_ragen", "top_k"), "algorithm.filter_mode",
         "must be 'top_p', 'top_p_ragen' or 'top_k'")
    need(config.algorithm.kl_type in ("k1", "k2", "k3"), "algorithm.kl_type", "must be k1, k2 or k3")
    need(config.algorithm.kl_in_reward_type in ("k1", "k2", "k3"), "algorithm.kl_in_reward_type", "must be k1, k2 or k3")
    need(
        config.algorithm.loss_agg_mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"),
        "algorithm.loss_agg_mode",
        "must be token-mean, seq-mean-token-mean or seq-mean-token-sum",
    )
    # The parser fullmatches the rollout's text, response_prefix + what the model writes: a prefix that cannot begin
    # the expected format makes every answer a format error (the bandit preset's "<answer>" with enable_think=true).
    opening = "<think>" if config.agent.enable_think else "<answer>"
    start = config.agent.response_prefix.lstrip()
    need(opening.startswith(start) or start.startswith(opening), "agent.response_prefix",
         f"{config.agent.response_prefix!r} cannot begin a reply in the format agent.enable_think="
         f"{str(config.agent.enable_think).lower()} asks for ({opening}...), so every answer would be a format error; "
         f"use {opening!r} or ''")
    for key in ("think_reward", "prediction_reward"):
        need(getattr(config.agent, key) == 0 or config.agent.enable_think, f"agent.{key}",
             "needs agent.enable_think=true (it rewards what the model writes inside <think>)")
    validate_env_sets(config)
    from ragen.train.loggers import LOGGERS, unknown_loggers

    unknown = unknown_loggers(config.trainer.logger)
    need(not unknown, "trainer.logger", f"unknown logger {', '.join(map(repr, unknown))} (choose from {', '.join(LOGGERS)})")


def validate_env_sets(config: RunConfig) -> None:
    """Every tag the run defines or uses must resolve (its env exists and accepts its config)."""
    from ragen.envs.tags import TagError, resolve_tag

    es = config.es
    for i, entry in enumerate(es.train):
        if entry.groups < 1:
            raise ConfigError(f"config key 'es.train[{i}].groups': must be >= 1 (tag {entry.tag!r})")
    for i, entry in enumerate(es.val):
        if entry.episodes < 0:
            raise ConfigError(f"config key 'es.val[{i}].episodes': must be >= 0, 0 = trainer.val_episodes (tag {entry.tag!r})")
    for key, entries in (("es.train", es.train), ("es.val", es.val)):
        names = [e.tag for e in entries]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ConfigError(f"config key {key!r}: env tag {repeated[0]!r} is listed twice (give it one entry)")
    user_tags = user_tag_dicts(config)
    try:
        for name in sorted(set(user_tags) | {e.tag for e in es.train} | {e.tag for e in es.val}):
            resolve_tag(name, user_tags)
    except TagError as exc:
        raise ConfigError(str(exc)) from None


def user_tag_dicts(config: RunConfig) -> dict[str, dict[str, Any]]:
    """``es.tags`` as plain dicts (the form :func:`ragen.envs.tags.resolve_tag` takes)."""
    return {name: asdict(tag) if is_dataclass(tag) else dict(tag) for name, tag in config.es.tags.items()}
