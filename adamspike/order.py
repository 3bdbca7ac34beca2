"""Deterministic data order shared by both backends.

The training data is read as a stream of sample positions 0, 1, 2, ...; optimizer step s
(1-based) of a run with global batch B consumes positions [(s-1+offset)*B, (s+offset)*B).
Position k maps to sample index perm_e[k mod N] where e = k // N is the epoch and perm_e a
permutation seeded by (seed, e). `offset` counts batches skipped on top of the steps taken
(PaLM-style skipping after a rollback), so the whole order is a pure function of
(step, offset, B, N, seed): a resumed run reads exactly the batches an uninterrupted run
would, and both backends read the same samples.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


@lru_cache(maxsize=4)
def _permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng(np.random.SeedSequence([seed, 0xDA7A, epoch])).permutation(num_samples)


def sample_indices(step: int, global_batch_size: int, num_samples: int, seed: int,
                   offset: int = 0, shuffle: bool = True) -> np.ndarray:
    """Sample indices (int64, length global_batch_size) of optimizer step `step` (1-based)."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    if global_batch_size < 1 or num_samples < 1:
        raise ValueError("global_batch_size and num_samples must be >= 1")
    start = (step - 1 + offset) * global_batch_size
    pos = np.arange(start, start + global_batch_size, dtype=np.int64)
    if not shuffle:
        return pos % num_samples
    epochs, within = np.divmod(pos, num_samples)
    out = np.empty_like(pos)
    for e in np.unique(epochs):
        sel = epochs == e
        out[sel] = _permutation(num_samples, seed, int(e))[within[sel]]
    return out


def rank_slice(indices: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """The contiguous share of a global batch that data-parallel rank `rank` reads."""
    if len(indices) % world_size:
        raise ValueError(f"global batch {len(indices)} is not divisible by world size {world_size}")
    per = len(indices) // world_size
    return indices[rank * per:(rank + 1) * per]
