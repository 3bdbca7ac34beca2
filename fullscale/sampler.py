"""Which tokens each rank trains on at each step: deterministic, resumable, skippable.

Optimizer step s (1-based) with data offset o reads global batch number b = s + o, i.e. the
sample indices `adamspike.order.sample_indices(s, B, N, seed, offset=o)` (positions
[(s-1+o)B, (s+o)B) of the seeded epoch permutations); rank r of W takes the contiguous
slice `rank_slice(indices, r, W)` of B/W sequences and splits it into
accum = (B/W) / micro micro-batches (global batch = W x micro x accum). The offset counts
batches skipped on top of the steps taken (PaLM-style skipping after a rollback), so
(step, offset) fixes the data exactly and a resumed run reads what an uninterrupted one
would.

Test / study hooks from the `data` config section:
- `data.poison_steps`: global batch numbers b (= the step that reads the batch when no batch
  was skipped) whose targets are all replaced by POISON_TOKEN: a deterministic loss spike.
  It is a property of the data, so skipping past it after a rollback really removes it.
- `data.skip_batches`: optimizer steps whose batch is consumed but not trained on (the
  trainer takes no forward/backward/update and logs the step with skipped=True), like
  Megatron's --iterations-to-skip. `local_batch` returns [] for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from adamspike.config import ConfigError
from adamspike.order import rank_slice, sample_indices

POISON_TOKEN = 0


class MicroBatch(NamedTuple):
    inputs: torch.Tensor    # long (micro, seq_len)
    targets: torch.Tensor   # long (micro, seq_len)


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int
    world_size: int
    local_batch_size: int       # sequences per rank per step
    micro_batch_size: int       # sequences per forward
    num_micro_batches: int      # gradient-accumulation steps


def batch_plan(cfg: Any, world_size: int) -> BatchPlan:
    """Split train.global_batch_size over ranks and micro-batches; ConfigError if it
    does not divide (the message names the key and the world size)."""
    gbs, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    if gbs % world_size:
        raise ConfigError(f"train.global_batch_size: {gbs} is not divisible by the world size "
                          f"{world_size} (every data-parallel rank needs the same number of "
                          "sequences)")
    local = gbs // world_size
    micro = mbs or local
    if local % micro:
        raise ConfigError(f"train.micro_batch_size: {micro} does not divide the per-rank batch "
                          f"{local} (= train.global_batch_size {gbs} / world size {world_size})")
    return BatchPlan(gbs, world_size, local, micro, local // micro)


@dataclass
class DataPosition:
    """Where the data stream stands: `step` = last completed optimizer step, `offset` =
    batches skipped on top of the steps. The next step reads batch step + 1 + offset."""
    step: int = 0
    offset: int = 0

    def skip(self, num_batches: int) -> None:
        """Skip `num_batches` batches: the next step reads num_batches further on."""
        if num_batches < 0:
            raise ValueError(f"cannot skip a negative number of batches ({num_batches})")
        self.offset += int(num_batches)

    def state_dict(self) -> dict[str, int]:
        return {"step": int(self.step), "offset": int(self.offset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            step, offset = int(state["step"]), int(state["offset"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"data position state must hold integer step and offset, "
                             f"got {state!r}") from None
        if step < 0 or offset < 0:
            raise ValueError(f"data position state has negative step/offset: {state!r}")
        self.step, self.offset = step, offset


def is_skipped(step: int, cfg: Any) -> bool:
    """Is optimizer step `step` listed in data.skip_batches?"""
    return int(step) in set(cfg.data.skip_batches)


def is_poisoned(step: int, offset: int, cfg: Any) -> bool:
    """Does step `step` at data offset `offset` read a batch listed in data.poison_steps or
    inside faults.poison_batches = [from, to]?"""
    b = int(step) + int(offset)
    span = getattr(getattr(cfg, "faults", None), "poison_batches", None)
    return b in set(cfg.data.poison_steps) or bool(span) and span[0] <= b <= span[1]


def local_batch(source: Any, step: int, cfg: Any, rank: int, world_size: int,
                offset: int = 0) -> list[MicroBatch]:
    """This rank's micro-batches for optimizer step `step` (1-based) at data offset `offset`.

    `source[i]` (SyntheticTokens, fullscale.data.GPTSamples) must return train.seq_len + 1
    tokens. Returns num_micro_batches MicroBatch(inputs, targets) of long CPU tensors
    (micro, seq_len); [] when the step is in data.skip_batches. Poisoned batches
    (data.poison_steps) have every target set to POISON_TOKEN.
    """
    plan = batch_plan(cfg, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world size {world_size}")
    if is_skipped(step, cfg):
        return []
    indices = sample_indices(step, plan.global_batch_size, len(source), cfg.train.seed,
                             offset=offset)
    mine = rank_slice(indices, rank, world_size)
    tokens = source.batch(mine) if hasattr(source, "batch") else np.stack([source[i] for i in mine])
    seq_len = cfg.train.seq_len
    if tokens.ndim != 2 or tokens.shape[1] != seq_len + 1:
        raise ValueError(f"data source returned samples of shape {tokens.shape[1:]}, expected "
                         f"train.seq_len + 1 = {seq_len + 1} tokens")
    tokens = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    if is_poisoned(step, offset, cfg):
        targets.fill_(POISON_TOKEN)
    m = plan.micro_batch_size
    return [MicroBatch(inputs[i:i + m].contiguous(), targets[i:i + m].contiguous())
            for i in range(0, plan.local_batch_size, m)]
