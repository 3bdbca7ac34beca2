"""Deterministic synthetic token data, shared by the JAX and torch backends through numpy.

`SyntheticTokens(task, vocab_size, seq_len, num_samples, seed)[i]` is sample i: an int64
array of seq_len + 1 tokens (inputs = x[:-1], targets = x[1:]), a pure function of
(task, vocab_size, seq_len, seed, i), so any backend, rank or resumed run sees the same
tokens for the same index.

Tasks:
- "markov": a first-order Markov chain over the vocabulary whose transition rows are
  Dirichlet(alpha) draws (small alpha = peaked, learnable). The best achievable loss is the
  chain's entropy rate, `entropy_rate()` nats/token.
- "copy": a random prefix of (seq_len + 1) // 2 tokens followed by its copy; the copied
  half is exactly predictable, so the achievable loss is about half the uniform entropy.
"""

from __future__ import annotations

import numpy as np

TASKS = ("markov", "copy")


def check_source_shape(vocab_size: int, seq_len: int, num_samples: int) -> None:
    """The checks every synthetic token source shares; ValueError naming the data.* key."""
    if vocab_size < 2:
        raise ValueError(f"data.vocab_size: must be >= 2, got {vocab_size}")
    if seq_len < 2:
        raise ValueError(f"data.seq_len: must be >= 2, got {seq_len}")
    if num_samples < 1:
        raise ValueError(f"data.num_samples: must be >= 1, got {num_samples}")


class SyntheticTokens:
    def __init__(self, task: str = "markov", vocab_size: int = 64, seq_len: int = 32,
                 num_samples: int = 1 << 20, seed: int = 0, alpha: float = 0.1):
        if task not in TASKS:
            raise ValueError(f"data.task: unknown synthetic task {task!r}; known: {TASKS}")
        check_source_shape(vocab_size, seq_len, num_samples)
        if not alpha > 0:
            raise ValueError(f"data.alpha: must be > 0, got {alpha}")
        self.task, self.vocab_size, self.seq_len = task, int(vocab_size), int(seq_len)
        self.num_samples, self.seed, self.alpha = int(num_samples), int(seed), float(alpha)
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 0x5EED]))
        self.transition = rng.dirichlet(np.full(self.vocab_size, self.alpha), size=self.vocab_size)
        self._cdf = np.cumsum(self.transition, axis=1)
        self._cdf[:, -1] = 1.0
        evals, evecs = np.linalg.eig(self.transition.T)
        pi = np.real(evecs[:, np.argmin(np.abs(evals - 1))])
        self.stationary = pi / pi.sum()

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        index = int(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample index {index} out of range [0, {self.num_samples})")
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 1, index]))
        n = self.seq_len + 1
        if self.task == "copy":
            half = n // 2
            prefix = rng.integers(0, self.vocab_size, size=n - half)
            return np.concatenate([prefix, prefix[:half]]).astype(np.int64)
        u = rng.random(n)
        out = np.empty(n, dtype=np.int64)
        out[0] = np.searchsorted(np.cumsum(self.stationary), u[0] * 0.999999)
        for t in range(1, n):
            out[t] = np.searchsorted(self._cdf[out[t - 1]], u[t], side="right")
        return np.minimum(out, self.vocab_size - 1)

    def batch(self, indices) -> np.ndarray:
        """Stack samples: int64 array (len(indices), seq_len + 1)."""
        return np.stack([self[i] for i in indices])

    def entropy_rate(self) -> float:
        """Markov task: sum_i pi_i H(P_i) in nats (the loss floor); copy task: its analogue."""
        if self.task == "copy":
            n = self.seq_len
            predictable = (self.seq_len + 1) // 2
            return float(np.log(self.vocab_size) * (n - predictable) / n)
        with np.errstate(divide="ignore", invalid="ignore"):
            h = -np.where(self.transition > 0, self.transition * np.log(self.transition), 0.0).sum(1)
        return float(self.stationary @ h)
