"""The typed run configuration: one schema, validated at construction, YAML presets on top.

``load_config(preset_or_yaml, overrides)`` merges, in order: the schema's defaults, a preset
(``ragen/configs/<name>.yaml``) or a YAML file, then ``key=value`` overrides. An unknown key or
a value of the wrong type raises :class:`ConfigError` naming the key; the CLI turns it into
one line on stderr and exit code 2.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ragen.agent.settings import AgentConfig
from ragen.errors import ConfigError
from ragen.models.device import check_device_spec
from ragen.models.precision import PRECISIONS, resolve_precision

PRESET_DIR = Path(__file__).parent / "configs"


@dataclass
class EnvConfig:
    #: Registered env name (see ``ragen envs``).
    name: str = "bandit"
    #: Keyword config passed to the env's constructor (validated by the env itself).
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class EnvTagConfig:
    """A user-defined env tag (``es.tags.NAME``); see ``ragen/envs/tags.py`` for the presets."""

    #: Registered env name (see ``ragen envs``).
    env: str = ""
    #: Keyword config passed to the env's constructor.
    config: dict[str, Any] = field(default_factory=dict)
    #: Replaces the env's own instructions in the first prompt ("" = keep the env's).
    instructions: str = ""
    #: Replaces ``agent.system_prompt`` for this tag (null = keep it).
    system_prompt: Optional[str] = None
    #: Per-tag horizon; null = the ``agent`` section's value.
    max_turn: Optional[int] = None
    max_actions_per_turn: Optional[int] = None
    max_actions_per_traj: Optional[int] = None


@dataclass
class TrainTagConfig:
    """One entry of ``es.train``: ``groups`` env groups (of ``rollout.group_size``) of tag ``tag``."""

    tag: str = ""
    groups: int = 1


@dataclass
class ValTagConfig:
    """One entry of ``es.val``: ``episodes`` held-out episodes of tag ``tag`` (0 = ``trainer.val_episodes``)."""

    tag: str = ""
    episodes: int = 0


@dataclass
class EnvSetsConfig:
    """Mixed-env training and per-tag validation (RAGEN's env tags; ``docs/env_tags.md``).

    Empty ``train`` = the single env of ``env`` with ``rollout.env_groups`` groups; empty
    ``val`` = every training tag with ``trainer.val_episodes`` episodes.
    """

    #: Your own tags by name (one naming its env replaces a preset of the same name; one without extends it).
    tags: dict[str, EnvTagConfig] = field(default_factory=dict)
    #: Training mix: ``[{tag: SimpleSokoban, groups: 4}, {tag: FrozenLake, groups: 4}]``.
    train: list[TrainTagConfig] = field(default_factory=list)
    #: Validation sets: ``[{tag: Bandit, episodes: 64}, {tag: BanditTest, episodes: 64}]``.
    val: list[ValTagConfig] = field(default_factory=list)


@dataclass
class RolloutConfig:
    #: Number of env groups per step; all envs in a group share a seed (and so a start state).
    env_groups: int = 8
    #: Envs per group (GRPO's G).
    group_size: int = 4
    #: Most tokens the model may write in one turn; a longer answer is cut there (and usually fails to parse).
    max_new_tokens: int = 128
    #: Sampling temperature of training rollouts (the update's log-probs use the same ``softmax(logits / T)``).
    temperature: float = 1.0
    #: Nucleus sampling (1 = off). The update's log-probs assume it off.
    top_p: float = 1.0
    #: Top-k sampling (0 = off). The update's log-probs assume it off.
    top_k: int = 0
    #: Sequences per ``generate`` call.
    batch_size: int = 64
    #: Keep each episode's KV cache between turns so a turn prefills only its new tokens
    #: (``context_mode=full``, HF engine; ``ragen/models/prefix_cache.py``). Same tokens either way in
    #: fp32 (under bf16 a split prefill rounds differently); costs memory for one cache per episode
    #: during a rollout, up to ``reuse_kv_max_gb``.
    reuse_kv: bool = True
    #: Most GB of kept KV caches between turns (``reuse_kv``; ``inf``: no bound); an episode whose
    #: cache does not fit prefills its history again at its next turn (more work; greedy decoding
    #: gives the same tokens, a sampled run other draws of the same distribution). Bounds
    #: ``ragen eval`` of hundreds of long episodes in one rollout, which held ~19 GB without it.
    reuse_kv_max_gb: float = 4.0
    #: Play a rollout's episodes in waves of at most this many (0: all at once). Each wave keeps its
    #: own KV caches and runs to its end, so memory is bounded without re-encoding histories; set
    #: it for evals of hundreds of long episodes (``ragen eval``, ``trainer.val_episodes``).
    max_episodes_in_flight: int = 0
    #: Decode levers of the HF engine on the CPU: plain fp32 linears as ``(W @ hᵀ)ᵀ``, a KV cache that
    #: grows in place, one-query decode attention, the fused Llama-family decode step on packed bf16
    #: weights, the prompts' common prefix prefilled once, the prompt prefill on the same packed weights
    #: with each row's first token sampled from its logits, and ragen's own sampling loop
    #: (ragen/models/: transposed_gemm, growing_cache, decode_attention, fused_decode, fused_prefill,
    #: decode_loop; backend.py). Same tokens up to float rounding of the logits; false = transformers' plain path.
    fast_decode: bool = True
    #: With ``fast_decode``, ragen's C++ kernels, compiled once per machine on first use (~15 s each; needs a C++
    #: compiler; else, with a warning, the same arithmetic in Python): bf16 decode steps of rows in groups sharing a
    #: prompt run all layers in one kernel (ragen/models/native_decode.py, AVX-512 BF16), and fp32 decode steps run
    #: the decoder's projections on the panel GEMM (ragen/models/packed_linear.py, AVX2, non-Intel CPUs). Same tokens
    #: up to float rounding.
    native_decode: bool = True
    #: Where episodes are played: ``local`` (in the trainer's process) or ``ray`` (``num_workers``
    #: Ray actors, each holding env slots and a policy replica; see docs/scaling.md).
    backend: str = "local"
    #: Ray rollout actors (``backend=ray``).
    num_workers: int = 2
    #: Ray cluster to join (``ray.init(address=...)``); "" starts a local one.
    ray_address: str = ""
    #: Generation engine: ``hf`` (transformers ``generate``) or ``vllm`` (GPU only, extra ``ragen[vllm]``).
    engine: str = "hf"


@dataclass
class AlgorithmConfig:
    #: Advantage estimator by registered name (``ragen.algos``).
    adv_estimator: str = "grpo"
    #: GRPO's division by the in-group std (Dr.GRPO turns it off).
    norm_adv_by_std: bool = True
    #: Token-level discount of the returns (GAE, REINFORCE++, RLOO...).
    gamma: float = 1.0
    #: GAE's λ.
    lam: float = 1.0
    #: Turn-level discount of bi-level GAE (VAGEN's TRICO).
    high_level_gamma: float = 0.95
    #: Put each turn's reward on that turn's last token instead of the episode return on the last token.
    use_turn_rewards: bool = False
    #: GiGPO's weight of the step-level (anchor-state) advantage.
    gigpo_step_weight: float = 1.0
    #: GiGPO's discount of the step-level returns from each anchor state (the paper's γ = 0.95), kept apart from
    #: ``gamma``, the token-level discount of the episode estimators.
    gigpo_gamma: float = 0.95
    #: StarPO-S uncertainty filtering (1 = off): groups ranked by in-group reward std, highest first, kept until they
    #: hold this share of the summed std (``top_p``, ``top_p_ragen``) or are this share of the groups (``top_k``,
    #: RAGEN's count rule).
    filter_ratio: float = 1.0
    #: "top_p" (the fewest groups whose std share reaches the ratio; at least one), "top_p_ragen" (RAGEN's rule: the
    #: same but zero-std groups never, a 0.01 slack on the target, and none at all when every group has std 0) or
    #: "top_k" (share of the groups). docs/algorithms.md compares them.
    filter_mode: str = "top_p"
    #: KL to the initial policy as a loss term (StarPO-S removes it: off by default).
    use_kl_loss: bool = False
    #: KL to the initial policy as a per-token reward penalty.
    use_kl_in_reward: bool = False
    #: Weight of the KL term (``use_kl_loss``) or penalty (``use_kl_in_reward``).
    kl_coef: float = 0.001
    #: KL estimator of the KL loss: k1, k2 or k3 (Schulman 2020).
    kl_type: str = "k3"
    #: KL estimator of the in-reward penalty (``use_kl_in_reward``): k1, as verl and REINFORCE++ use there (its
    #: per-token sum is the sequence's log-ratio, whose expectation is the KL); k2 or k3 as for the loss.
    kl_in_reward_type: str = "k1"
    #: Critic loss weight (gae, bi_level_gae: a value head shares the policy's backbone).
    value_coef: float = 0.5
    #: PPO value clipping range (None = off).
    clip_range_value: float | None = 0.2
    #: Policy loss by registered name.
    policy_loss: str = "clipped"
    #: PPO's lower clip: the ratio is floored at ``1 - clip_ratio_low``.
    clip_ratio_low: float = 0.2
    #: Clip-higher (DAPO; StarPO-S uses 0.28): a larger upper clip keeps exploring tokens alive.
    clip_ratio_high: float = 0.28
    #: Dual-clip bound for negative advantages (Ye et al. 2020); None = off.
    clip_ratio_c: float | None = None
    #: Weight of the entropy bonus in the policy loss (0 = off; the entropy is still logged).
    entropy_coeff: float = 0.0
    #: How token losses become one number: ``token-mean`` (DAPO), ``seq-mean-token-mean`` or ``seq-mean-token-sum``
    #: (Dr.GRPO).
    loss_agg_mode: str = "token-mean"
    #: Passes over one rollout batch.
    ppo_epochs: int = 1
    #: Training samples per optimizer step (0 = the whole rollout batch). A sample is an episode
    #: (``agent.context_mode=full``) or one turn (``window``).
    mini_batch_size: int = 0
    #: Sequences per forward/backward pass at most (gradient accumulation inside a mini-batch).
    micro_batch_size: int = 16
    #: Tokens per forward/backward pass at most, padding included (rows × longest row; 0 = no bound): the memory
    #: knob, since activations grow with tokens, not sequences. Short episodes run ``micro_batch_size`` to a pass,
    #: long ones fewer; a sample longer than this runs alone (and ``trainer.gradient_checkpointing=auto`` then
    #: checkpoints its layers). The gradient is the same however the rows are cut (ragen/train/micro_batches.py).
    max_tokens_per_micro_batch: int = 2048
    #: Dropout off in the policy (``ragen/models/dropout.py``): π_old is scored without it, so with it the
    #: PPO ratio and KL would compare two different functions. ``lora.dropout`` still applies.
    disable_dropout: bool = True


@dataclass
class AdamWConfig:
    """The optimizer keys RL and SFT runs share (``optim.*``); each run kind adds its own below."""

    #: AdamW's learning rate (the peak, after warm-up).
    lr: float = 1e-6
    #: AdamW's decoupled weight decay.
    weight_decay: float = 0.0
    #: AdamW's β1, β2.
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    #: Largest global gradient norm; larger gradients are scaled down to it.
    grad_clip: float = 1.0
    #: Linear warm-up over this many *optimizer* steps (0 = constant LR), as in transformers' Trainer / TRL: an RL
    #: training step makes ppo_epochs x ceil(episodes / mini_batch_size) of them, an SFT step one. A skipped
    #: (non-finite gradient) step does not count.
    warmup_steps: int = 0
    #: torch's fused AdamW kernel where every trainable parameter allows it (plain CPU/CUDA tensors;
    #: not under FSDP): 4-5x faster steps on CPU, results equal to the for-loop AdamW up to float
    #: rounding (ragen/train/optimizer.py). False = torch's default implementation.
    fused: bool = True


@dataclass
class OptimConfig(AdamWConfig):
    #: Train only the last N decoder layers (0 = all): embeddings, LM head and lower layers stay
    #: frozen, so the backward pass stops at layer L-N (ragen/models/freeze.py). Under LoRA only
    #: the adapters of those layers train.
    trainable_layers: int = 0


@dataclass
class LoraConfig:
    #: 0 = full fine-tuning; > 0 trains LoRA adapters of this rank (peft).
    rank: int = 0
    #: LoRA's scale numerator: the adapter's update is multiplied by ``alpha / rank``.
    alpha: float = 32.0
    #: Dropout on the adapters' input.
    dropout: float = 0.0
    #: Module names that get adapters (peft's ``target_modules``); ``[all-linear]``: every linear layer but the head.
    #: The default names Llama-family projections; a model with none of them (GPT-2, GPT-NeoX) gets ``all-linear``.
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class TrainerConfig:
    #: RL steps (each: one rollout, then the update).
    total_steps: int = 20
    #: Run directory; empty = ``runs/<env>-<timestamp>``.
    output_dir: str = ""
    #: "auto" (bf16 where the hardware multiplies bf16 natively, else fp32), "bf16"
    #: (autocast, fp32 master weights) or "fp32". The resolved value is what config.yaml records.
    precision: str = "auto"
    #: Where the policy (and critic, reference) live: "auto" (``cuda:LOCAL_RANK`` when a CUDA GPU
    #: is visible, else cpu), "cpu", "cuda" (= cuda:LOCAL_RANK) or "cuda:N". Ray rollout workers
    #: keep their replicas on CPU. See ragen/models/device.py and docs/scaling.md.
    device: str = "auto"
    #: Validate every N steps (0 = only before training and at the end).
    val_freq: int = 0
    #: Validate the untrained model first (the "before" of every learning claim).
    val_before_train: bool = True
    #: Held-out validation episodes (seeds disjoint from training seeds).
    val_episodes: int = 64
    #: Validation decoding: sampled at ``val_temperature``, or greedy when ``val_do_sample`` is false.
    val_do_sample: bool = True
    #: Sampling temperature of validation when ``val_do_sample`` is true.
    val_temperature: float = 1.0
    #: Save the final weights (or LoRA adapter) to ``<output_dir>/final``.
    save_final: bool = True
    #: Show a tqdm progress bar with live reward/success.
    progress_bar: bool = True
    #: Save sampled trajectories (tokens, masks, advantages) every N steps to ``rollouts/`` (0 = never).
    log_rollouts_freq: int = 10
    #: Trajectories saved per logged step.
    log_rollouts_n: int = 8
    #: Write a checkpoint every N steps (0 = only on Ctrl-C); see ``ragen train --resume``.
    save_freq: int = 0
    #: Checkpoints kept on disk, the newest (0 = every one).
    keep_checkpoints: int = 2
    #: Stop (after saving a checkpoint) once a collapse is confirmed: entropy and in-group reward std both ~0.
    stop_on_collapse: bool = False
    #: Draw ``curves.png`` (success, reward, entropy, grad norm, length) at the end.
    plot: bool = True
    #: Metric sinks, any of console, jsonl, tensorboard (RUN_DIR/tensorboard), wandb (the ``wandb``
    #: extra; offline unless WANDB_API_KEY is set). metrics.jsonl is always written. docs/logging.md.
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    #: Run each group's shared first prompt once in the update and reuse its KV cache for every
    #: member (same results up to float rounding; ~3x faster on the bandit preset).
    share_prompt_prefix: bool = True
    #: torch threads (0 = torch's default).
    num_threads: int = 0
    #: Activation checkpointing in the update: keep only each decoder layer's input and recompute
    #: the layer in the backward pass (ragen/models/checkpointing.py). Far less memory on long
    #: multi-turn episodes for about one extra forward pass; the update then runs shared prompts
    #: once per row (``share_prompt_prefix`` needs a KV cache, which a checkpointed layer cannot write).
    #: ``auto``: on for an update whose longest sample alone exceeds ``algorithm.max_tokens_per_micro_batch``
    #: (the token budget cannot split it further), off otherwise; ``true`` / ``false``: always / never.
    gradient_checkpointing: str = "auto"
    #: Under ``torchrun``: shard the decoder layers' weights, gradients and AdamW moments over the
    #: ranks (FSDP2) instead of keeping a whole copy on each. Same updates up to float rounding; rank 0
    #: keeps an unsharded replica to generate with. No effect in a single process. ragen/train/fsdp.py.
    fsdp: bool = False


@dataclass
class RunConfig:
    #: ``smollm2-135m`` (embedded default), ``tiny`` (tests), or a path to an HF model dir.
    model: str = "smollm2-135m"
    #: Seeds the model's random init (``tiny``), torch, numpy and the training seeds' draw.
    seed: int = 0
    env: EnvConfig = field(default_factory=EnvConfig)
    #: Env tags: mixed training batches and several validation sets (overrides ``env`` when set).
    es: EnvSetsConfig = field(default_factory=EnvSetsConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


#: What ``trainer.gradient_checkpointing`` may say (YAML's true/false arrive as the strings "True"/"False").
CHECKPOINTING_SETTINGS = {"auto": "auto", "true": "true", "false": "false", "on": "true", "off": "false"}


def checkpointing_setting(value: Any, key: str) -> str:
    """``auto``, ``true`` or ``false`` for a ``gradient_checkpointing`` value; :class:`ConfigError` naming ``key``."""
    setting = CHECKPOINTING_SETTINGS.get(str(value).strip().lower())
    if setting is None:
        raise ConfigError(f"config key {key!r}: must be auto, true or false (got {value!r})")
    return setting


def _friendly(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
    msg = str(exc).splitlines()[0]
    if key and "is not a ListConfig, TupleConfig, list, or tuple" in msg:  # OmegaConf's words for a scalar given
        msg = f"expects a list, written [...] ({key}=[...] on the command line; got one value)"
    elif key and msg.startswith("Incompatible value 'None' for field of type 'str'"):  # `key=` reads as null
        msg = f"expects text (for an empty one write {key}='')"
    return f"config key {key!r}: {msg}" if key else msg


def load_yaml_mapping(path: str | Path) -> DictConfig:
    """A YAML file whose top level is a mapping; :class:`ConfigError` naming the file otherwise (a syntax
    error, bytes that are not UTF-8 text, a list or a scalar at the top, an unreadable file)."""
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"config file {path}:{line} is not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path}: not UTF-8 text") from None
    except OSError as exc:  # OmegaConf also raises it for a scalar at the top level
        if "Invalid loaded object type" in str(exc):
            raise ConfigError(f"config file {path}: the top level must be a mapping of sections") from None
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {path}: the top level must be a mapping of sections (got a list)")
    return loaded


def overrides_layer(overrides: list[str] | tuple[str, ...]) -> DictConfig:
    """``key=value`` overrides as one config layer; :class:`ConfigError` naming the override whose value is not YAML."""
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except yaml.YAMLError:
        bad = next((item for item in overrides if _bad_yaml_value(item)), None)
        raise ConfigError(f"override {bad!r}: its value is not valid YAML" if bad else "an override's value is not valid YAML") from None
    except (ValueError, TypeError, OmegaConfBaseException):  # e.g. es.val=[...] then es.val.tag=x: a list has no key 'tag'
        layer = OmegaConf.create()
        for item in overrides:  # the first override that cannot go on top of the ones before it
            try:
                layer = OmegaConf.merge(layer, OmegaConf.from_dotlist([item]))
            except (ValueError, TypeError, OmegaConfBaseException):
                raise ConfigError(f"override {item!r} does not fit the overrides before it (a key into a list, "
                                  "or a list where they made a mapping)") from None
        raise


def _merge_fails(schema: DictConfig, *layers: DictConfig) -> bool:
    try:
        OmegaConf.to_object(OmegaConf.merge(schema, *layers))
        return False
    except (TypeError, OmegaConfBaseException):
        return True


def _culprit_override(schema: DictConfig, files: list[DictConfig], overrides: list[str] | tuple[str, ...]) -> str | None:
    """The first ``key=value`` override that fails to merge on top of the schema and the file layers, each on its own;
    None when the file layers fail without any override (the file's fault) or no single override fails."""
    if _merge_fails(schema, *files):
        return None
    return next((item for item in overrides if _merge_fails(schema, *files, OmegaConf.from_dotlist([item]))), None)


def _wrong_container(schema: DictConfig, files: list[DictConfig], overrides: list[str] | tuple[str, ...],
                     preset: str | None) -> str:
    """The message for a list where the schema has a mapping (or the reverse): the override that does it, else the file."""
    culprit = _culprit_override(schema, files, overrides)
    if culprit:
        return f"override {culprit!r}: a list where the config has a mapping, or a mapping where it has a list"
    if preset and files:
        return f"config file {preset}: a list where the config has a mapping, or a mapping where it has a list"
    return "an override puts a list where the config has a mapping, or a mapping where it has a list"


def _bad_yaml_value(item: str) -> bool:
    try:
        yaml.safe_load(item.split("=", 1)[1])
        return False
    except yaml.YAMLError:
        return True


def run_kind(path: str | Path) -> str | None:
    """``"sft"`` or ``"rl"`` for a run's config.yaml at ``path`` (``ragen sft train``'s has ``data`` and none of
    ``env``/``es``/``rollout``; ``ragen train``'s the reverse), else None: the commands name a mix-up instead of
    failing on a key the other kind has."""
    try:
        saved = yaml.safe_load(Path(path).read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    if not isinstance(saved, dict):
        return None
    sft, rl = "data" in saved, bool({"env", "es", "rollout"} & set(saved))
    return "sft" if sft and not rl else "rl" if rl and not sft else None


def builtin_model_names() -> tuple[str, ...]:
    from ragen.models.loading import BUILTIN_MODELS

    return BUILTIN_MODELS


def absolute_path(path: str, keep: tuple[str, ...] = ()) -> str:
    """An existing ``path`` made absolute (``~`` expanded; ``..`` and symlinks left as they are) as a run records it,
    so its config.yaml, a LoRA adapter's base and a resumed run name the same file from any working directory.

    ``""``, the names in ``keep`` (built-in models) and paths that do not exist are returned as typed: the error
    that follows names what the user wrote."""
    if not path or path in keep:
        return path
    full = Path(path).expanduser()
    return str(full.absolute()) if full.exists() else path


def load_config(preset: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Defaults ← preset name or YAML path ← ``key=value`` overrides, validated; returns a ``RunConfig``."""
    schema = OmegaConf.structured(RunConfig)
    layers: list[DictConfig] = []
    if preset:
        path = Path(preset)
        if not path.suffix:
            path = PRESET_DIR / f"{preset}.yaml"
        if path.is_file():
            layers.append(load_yaml_mapping(path))
        elif preset.endswith((".yaml", ".yml")):
            raise ConfigError(f"config file not found: {preset}")
        else:  # an env name without a preset: defaults with that env
            import ragen.envs

            if preset not in ragen.envs.registered():
                presets = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
                raise ConfigError(f"{preset!r} is neither a preset ({', '.join(presets)}), a YAML file nor an env "
                                  f"({', '.join(sorted(ragen.envs.registered()))})")
            layers.append(OmegaConf.create({"env": {"name": preset}}))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
    files = list(layers)  # the preset or YAML file (for error messages)
    try:
        layers.append(overrides_layer(overrides))
        merged = OmegaConf.merge(schema, *layers)
        config: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        message = _friendly(exc)
        culprit = _culprit_override(schema, files, overrides)
        if culprit and not message.startswith(f"config key '{culprit.split('=', 1)[0].strip()}"):
            message = f"override {culprit!r}: {message}"  # e.g. a field inside a list item, named without its path
        elif culprit is None and preset and Path(preset).suffix and _merge_fails(schema, *files):
            message = f"config file {preset}: {message}"
        raise ConfigError(message) from None
    except TypeError:  # OmegaConf cannot merge a list into a mapping section (or the other way round)
        raise ConfigError(_wrong_container(schema, files, overrides, preset)) from None
    _reject_overrides_es_train_ignores(config, overrides)
    config.model = absolute_path(config.model, keep=builtin_model_names())
    validate(config)
    config.trainer.precision = resolve_precision(config.trainer.precision, config.trainer.device)
    return config


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
    need(config.rollout.engine in ("hf", "vllm"), "rollout.engine", "must be 'hf' or 'vllm'")
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


#: Keys that may change on ``--resume`` without changing the results of the steps already run.
RESUME_SAFE_KEYS = {
    "trainer.total_steps", "trainer.progress_bar", "trainer.log_rollouts_freq", "trainer.log_rollouts_n",
    "trainer.save_freq", "trainer.keep_checkpoints", "trainer.output_dir", "trainer.num_threads",
    "trainer.logger", "trainer.plot", "trainer.fsdp",
    # same results up to float rounding (tests/models/test_checkpointing.py, tests/train/test_micro_batches.py):
    # the fixes after an OOM kill
    "trainer.gradient_checkpointing", "algorithm.micro_batch_size", "algorithm.max_tokens_per_micro_batch",
}


def flat_config(config: Any) -> dict[str, Any]:
    """A structured config (``RunConfig``, ``SFTConfig``) as ``{dotted key: leaf value}``."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node

    walk(OmegaConf.to_container(OmegaConf.structured(config)), "")
    return out


def result_changing_differences(old: RunConfig, new: RunConfig) -> list[str]:
    """Dotted keys whose values differ between two configs, ignoring :data:`RESUME_SAFE_KEYS`."""
    a, b = flat_config(old), flat_config(new)
    return sorted(k for k in a.keys() | b.keys() if not resume_safe(k, b) and a.get(k) != b.get(k))


def resume_safe(key: str, config: dict[str, Any], safe_keys: set[str] = RESUME_SAFE_KEYS) -> bool:
    """Whether ``key`` (of the flat ``config``) may change on resume: one of ``safe_keys``, except where dropout would
    draw other masks: the micro-batch size (masks per micro-batch; ``*.micro_batch_size`` of RL and SFT) and
    ``trainer.fsdp`` (its padding passes draw too), under LoRA dropout or, in RL, with the model's own dropout left
    on (``algorithm.disable_dropout=false``: the model may have some; its config is not read here)."""
    if key.endswith((".micro_batch_size", ".max_tokens_per_micro_batch")) or key == "trainer.fsdp":
        if config.get("lora.rank", 0) > 0 and config.get("lora.dropout", 0) > 0:
            return False
        if config.get("algorithm.disable_dropout") is False:
            return False
    return key in safe_keys


#: First line of every ``config.yaml`` a run writes: a YAML comment, so the file loads the same, but it tells a
#: run's own file from a user's (:func:`written_by_ragen`).
RUN_CONFIG_HEADER = "# ragen: this run's resolved config, written when the run started\n"


def written_by_ragen(path: str | Path) -> bool:
    """Whether ``path`` is a ``config.yaml`` a ragen run wrote (its first line is :data:`RUN_CONFIG_HEADER`)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline() == RUN_CONFIG_HEADER
    except (OSError, UnicodeDecodeError):
        return False


def taken_run_entries(run_dir: Path, entries: tuple[str, ...]) -> list[str]:
    """Of ``entries`` (what a run writes into its dir), those ``run_dir`` already holds, in order.

    A ``config.yaml`` that ragen wrote, alone, does not count: that run stopped before it logged a
    step, and a new run starts it over (``docs/design.md``, "A run owns the files it writes").
    """
    taken = [name for name in entries if (run_dir / name).exists() or (run_dir / name).is_symlink()]
    if taken == ["config.yaml"] and written_by_ragen(run_dir / "config.yaml"):
        return []
    return taken


def to_yaml(config: RunConfig) -> str:
    return RUN_CONFIG_HEADER + OmegaConf.to_yaml(OmegaConf.structured(config))
