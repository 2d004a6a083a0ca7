"""FSDP for the update stage (``trainer.fsdp=true`` under ``torchrun``): the decoder layers are sharded.

What is sharded, and why only that
----------------------------------
Each decoder layer becomes an FSDP2 unit (``torch.distributed.fsdp.fully_shard``): its
parameters, gradients and AdamW moments live as 1/world shards (``DTensor``) on each rank and
are all-gathered for that layer's forward and backward only. The embeddings, the final norm,
the LM head and the critic's value head stay whole on every rank, and their gradients are
summed by :func:`ragen.train.distributed.all_reduce_grads` as in the plain data-parallel update.
Reasons:

* :func:`ragen.train.logprobs.policy_forward` calls the decoder and the LM head separately (the
  head runs on response positions only), so an FSDP unit around the whole model would never
  see its forward hook fire;
* many models tie the LM head to the input embedding (SmolLM2, Qwen2.5 ≤ 3B): sharding the
  embedding in one unit while the head uses the same tensor elsewhere would break the tie.

The layers hold most of the parameters: SmolLM2-135M 106 M of 134.5 M (79 %); Qwen2.5-7B
(vocabulary 152 064 × hidden 3 584, untied head) about 6.5 B of 7.6 B (86 %).

Gradient semantics
------------------
The update's losses are already weighted by each rank's share of the *global* token count
(``ragen/train/distributed.py``), so gradients must be **summed** over ranks: every unit's
gradient divide factor is set to 1 (FSDP's default divides by the world size).

Collectives must line up
------------------------
Every forward of a sharded layer is a collective: all ranks must run the same number of
decoder passes in the same order. The trainer guarantees it: scoring runs on the whole batch
on every rank; the update pads ranks with fewer micro-batches with a weight-0 micro-batch (every rank computes every
rank's micro-batches, ``ActorUpdate.local_micro_batches``, and runs as many as the busiest), and its ranks agree on each micro-batch's
shared-prompt layout on the fast update path (one pass packed, two split: ``ActorUpdate.agreed_layout``; the plain
path, ``algorithm.fast_update=false``, runs full rows and has none to agree on); rank 0's rollout and validation run on an unsharded replica
(:func:`sync_replica`), never on the sharded model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ragen.models.freeze import decoder_layers

try:  # torch >= 2.6 exports FSDP2 here
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover - older torch: trainer.fsdp reports it
    fully_shard = None
    DTensor = ()  # isinstance(x, ()) is always False


def fsdp_available() -> bool:
    """FSDP2 with what this module calls (``set_force_sum_reduction_for_comms`` is the newest of them)."""
    if fully_shard is None or not dist.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return (hasattr(FSDPModule, "set_force_sum_reduction_for_comms") and hasattr(FSDPModule, "set_gradient_divide_factor")
            and hasattr(torch.nn.utils, "get_total_norm") and hasattr(torch.nn.utils, "clip_grads_with_norm_"))


def shard_layers(model: nn.Module, device: torch.device) -> int:
    """``fully_shard`` every decoder layer of ``model`` over all ranks, summing gradients; returns the layer count.

    Call after LoRA adapters are applied and ``requires_grad`` is set (frozen parameters are
    sharded too, and get no gradient), and before the optimizer is built (it must hold the
    sharded parameters).
    """
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    layers = decoder_layers(model)
    for layer in layers:
        # Each layer is its own FSDP root (nothing encloses it), and roots keep their gathered
        # weights after forward unless told otherwise: free them after every forward.
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        layer.set_gradient_divide_factor(1.0)  # SUM: losses already carry the global token weights
        layer.set_force_sum_reduction_for_comms(True)  # a plain SUM reduce-scatter (gloo has no PREMUL_SUM)
    return len(layers)


def is_sharded(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather for a shard: every rank must call it, in the same order)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as ``param``: this rank's shard of it when ``param`` is sharded (a collective), else itself."""
    if isinstance(param, DTensor) and full.dim() > 0:
        return distribute_tensor(full.to(param.device, param.dtype), param.device_mesh, param.placements)
    return full


def clip_grad_norm_(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over a mix of sharded and whole gradients; returns the total norm.

    Without sharded gradients this *is* torch's function. Otherwise
    ‖g‖ = sqrt(‖g_sharded‖² + ‖g_whole‖²), where the sharded part is reduced over ranks
    (``full_tensor`` of the ``DTensor`` norm, a collective), and every gradient is then scaled by
    min(1, max_norm / (‖g‖ + 1e-6)) as torch's own function does (non-finite norms included).
    """
    with_grad = [p for p in params if p.grad is not None]
    sharded = [p for p in with_grad if isinstance(p.grad, DTensor)]
    if not sharded:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    whole = [p for p in with_grad if not isinstance(p.grad, DTensor)]
    norm_sq = full_tensor(torch.nn.utils.get_total_norm([p.grad for p in sharded])).float().cpu() ** 2
    if whole:
        norm_sq = norm_sq + torch.nn.utils.get_total_norm([p.grad for p in whole]).float().cpu() ** 2
    total = norm_sq.sqrt()
    for group in (sharded, whole):
        if group:  # scales each parameter's .grad in place
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(group[0].grad.device))
    return total


@torch.no_grad()
def sync_replica(named: list[tuple[str, torch.Tensor]], replica: nn.Module | None) -> list[tuple[str, torch.Tensor]]:
    """Gather each named (possibly sharded) tensor on every rank; on the rank holding ``replica``, copy it in.

    Returns the gathered ``(name, tensor)`` pairs (for a vLLM engine's weight sync). A collective:
    every rank calls it with the same names in the same order; ranks without a replica pass None.
    """
    targets = dict(replica.named_parameters()) if replica is not None else {}
    gathered = []
    for name, tensor in named:
        full = full_tensor(tensor.detach())
        if replica is not None:
            targets[name].copy_(full)
            gathered.append((name, targets[name]))
    return gathered
