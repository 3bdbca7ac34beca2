"""Apply activation checkpointing and FSDP2 to a `fullscale.model.Transformer`, torchtitan
order: activation checkpointing per block -> `fully_shard` per block -> `fully_shard` on the
root (embedding, final norm and head form the root's group).

Decisions:
- FSDP2 is applied whenever a process group exists, *including world size 1* (the trainer
  creates a one-rank group when it is not under torchrun). Then 1 and N processes run the
  same code path: the same bf16 casts, the same fp32 gradient reduction, the same DTensor
  optimizer state; only the batch split differs (see tests/fullscale/test_dist.py for
  the measured agreement). Without a process group (model tests, benchmarks) the model is
  returned unsharded and runs in fp32.
- mixed_precision "bf16": parameters are kept in fp32 (sharded master copy, what AdamW
  updates), all-gathered and computed in bf16, gradients reduced in fp32
  (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`); RMSNorm and RoPE compute
  in fp32 inside the model and the logits are fp32. "fp32": no casting at all.
- Activation checkpointing is the model's per-block flag (torch.utils.checkpoint, non
  reentrant), so parameter names stay `layers.{i}...` for telemetry and checkpoints.
- Gradient accumulation: gradients are reduce-scattered after every micro-batch (FSDP2's
  default), so no rank ever holds an unsharded gradient of the whole model (at 70B that
  would be 276 GB in fp32); the trainer scales each micro-batch loss by 1 / accum.
- reshard_after_forward=True for blocks (ZeRO-3: the 70B layout), False for the root,
  whose parameters are needed again at once by backward.

FSDP2 needs torch >= 2.4 (public `torch.distributed.fsdp.fully_shard` from 2.6). On the
torch 2.1 Ascend stack it does not exist: one process still works, more raise a clear error.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def _fsdp2():
    """(fully_shard, MixedPrecisionPolicy) or None if this torch has no FSDP2."""
    try:   # lazy: where FSDP2 lives depends on the torch version (none before 2.4)
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        return fully_shard, MixedPrecisionPolicy
    except ImportError:
        pass
    try:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard   # torch 2.4 - 2.5
        return fully_shard, MixedPrecisionPolicy
    except ImportError:
        return None


def parallelize(model: nn.Module, world_size: int, *, activation_checkpointing: bool,
                mixed_precision: str, device: torch.device) -> nn.Module:
    """Checkpoint and shard `model` in place (it may still be on the meta device; call
    `to_empty(device=...)` + `init_weights` afterwards) and return it."""
    if mixed_precision not in ("fp32", "bf16"):
        raise ValueError(f"train.dtype: must be fp32 or bf16, got {mixed_precision!r}")
    for block in model.layers:
        block.activation_checkpointing = bool(activation_checkpointing)
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed:
        if world_size > 1:
            raise RuntimeError("parallelize: world_size > 1 but no process group is initialised")
        if mixed_precision == "bf16":
            raise RuntimeError("parallelize: bf16 needs FSDP2 mixed precision; initialise a "
                               "process group first (the trainer does so even for 1 process)")
        return model
    fsdp = _fsdp2()
    if fsdp is None:
        if world_size > 1 or mixed_precision == "bf16":
            raise RuntimeError(f"torch {torch.__version__} has no FSDP2 (fully_shard needs torch "
                               ">= 2.4); run one process in fp32, or use the Megatron/ModelLink "
                               "engine on this stack")
        return model
    fully_shard, MixedPrecisionPolicy = fsdp
    from torch.distributed.device_mesh import init_device_mesh   # lazy: torch >= 2.2, FSDP2 only

    mesh = init_device_mesh(device.type, (world_size,))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if mixed_precision == "bf16" else MixedPrecisionPolicy())
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return model
