"""The run config's schema: one dataclass per section (``env``, ``es``, ``agent``, ``rollout``, ``algorithm``,
``optim``, ``lora``, ``trainer``), each field with its type, default and a ``#:`` comment that ``ragen config --list``
prints."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


from ragen.agent.settings import AgentConfig

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
    #: Play a rollout's multi-turn episodes in waves of at most this many (0: all at once). Each wave keeps
    #: its own KV caches and runs to its end, so an evaluation of hundreds of long episodes (``ragen eval``,
    #: ``trainer.val_episodes``) holds one wave's memory, without re-encoding histories. Single-turn episodes
    #: keep nothing between turns and always play at once. With 32, a 512-episode 20-turn FrozenLake evaluation
    #: of SmolLM2-135M peaks at 5.4 GB (``benchmarks/bench_memory_presets.py``, ``docs/performance.md``).
    max_episodes_in_flight: int = 32
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
    #: Generation engine: ``hf`` (plain transformers ``generate``, the reference the others are tested against),
    #: ``cpu`` (transformers with ragen's CPU fast path: the levers of ``fast_decode`` and ``native_decode``),
    #: ``auto`` (``cpu`` unless ``fast_decode`` is false) or ``vllm`` (GPU only, extra ``ragen[vllm]``).
    engine: str = "auto"


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
    #: The update's CPU speed-ups (shared prompts run once, grouped fp32 attention, the LM head's hand-written
    #: backward, a kept tied-weight gradient): the same log-probs and gradients up to float rounding
    #: (tests/train/test_fast_update.py), in less time (benchmarks/bench_update.py). False = the plain transformers
    #: forward and backward, the reference.
    fast_update: bool = True


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
