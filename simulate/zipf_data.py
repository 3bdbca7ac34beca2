"""A Zipf-Markov token source: a real token-frequency tail for the JAX toy (numpy only).

`ZipfMarkov(vocab_size, seq_len, num_samples, seed, exponent, ...)[i]` is sample i, an int64
array of seq_len + 1 tokens, a pure function of the arguments and i (as
adamspike.synthdata.SyntheticTokens, whose interface it shares: batch, entropy_rate,
num_samples, vocab_size, seq_len).

The chain. Unigram Zipf law p_k = (k + 1)^-s / sum_j (j + 1)^-s over token ids k = 0..V-1
(id = frequency rank), s = `exponent`. Each token i has `num_successors` successor tokens
succ_i1..succ_iK drawn from p (rng of `seed`) with weights w_i ~ Dirichlet(1). The
transition is the mixture

    P(j | i) = (1 - q) p_j + q sum_m w_im [succ_im = j],       q = `structure`

so a fraction q of the next-token mass is predictable from the current token and the rest
follows the Zipf unigram. The first token is drawn from p. Rare tokens stay rare under the
chain (successors are drawn from p too): with V = 8192, s = 1.1, q = 0.7 the 4096 rarest ids
carry 1.5 % of the stationary mass (4.5 % under the unigram alone), and 2000 sequences of 65
tokens leave 3271 ids unseen, so those embedding rows get a gradient on few steps.

`entropy_rate()` = sum_i pi_i H(P(. | i)) nats/token, pi the stationary distribution (power
iteration, exact to 1e-12), the loss floor of a model that knows the chain.
"""

from __future__ import annotations

import numpy as np

from adamspike.synthdata import check_source_shape


class ZipfMarkov:
    def __init__(self, vocab_size: int = 8192, seq_len: int = 64, num_samples: int = 1 << 20,
                 seed: int = 0, exponent: float = 1.1, structure: float = 0.7,
                 num_successors: int = 4):
        check_source_shape(vocab_size, seq_len, num_samples)
        if not exponent > 0:
            raise ValueError(f"data.zipf_exponent: must be > 0, got {exponent}")
        if not 0 <= structure < 1:
            raise ValueError(f"structure: must be in [0, 1), got {structure}")
        self.vocab_size, self.seq_len, self.num_samples = int(vocab_size), int(seq_len), int(num_samples)
        self.seed, self.exponent, self.structure = int(seed), float(exponent), float(structure)
        V, K = self.vocab_size, int(num_successors)
        p = np.arange(1, V + 1, dtype=np.float64) ** -self.exponent
        self.unigram = p / p.sum()
        self._cdf = np.cumsum(self.unigram)
        self._cdf[-1] = 1.0
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 0x21F]))
        self.successors = np.minimum(np.searchsorted(self._cdf, rng.random((V, K)), side="right"),
                                     V - 1)
        w = rng.dirichlet(np.ones(K), size=V)
        self.weights = w
        self._wcdf = np.cumsum(w, axis=1)
        self._wcdf[:, -1] = 1.0

    def __len__(self) -> int:
        return self.num_samples

    def _draw(self, u: np.ndarray) -> np.ndarray:
        """u: (batch, n, 3) uniforms -> tokens (batch, n)."""
        b, n = u.shape[:2]
        out = np.empty((b, n), dtype=np.int64)
        uni = np.minimum(np.searchsorted(self._cdf, u[..., 1], side="right"), self.vocab_size - 1)
        out[:, 0] = uni[:, 0]
        rows = np.arange(b)
        for t in range(1, n):
            prev = out[:, t - 1]
            m = (u[:, t, 2, None] > self._wcdf[prev]).sum(axis=1)
            succ = self.successors[prev, np.minimum(m, self.successors.shape[1] - 1)]
            out[:, t] = np.where(u[:, t, 0] < self.structure, succ, uni[:, t])
        del rows
        return out

    def _uniforms(self, index: int) -> np.ndarray:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample index {index} out of range [0, {self.num_samples})")
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 2, int(index)]))
        return rng.random((self.seq_len + 1, 3))

    def __getitem__(self, index: int) -> np.ndarray:
        return self._draw(self._uniforms(int(index))[None])[0]

    def batch(self, indices) -> np.ndarray:
        """Stack samples: int64 array (len(indices), seq_len + 1); the chain runs over the
        batch at once (same tokens as item by item)."""
        return self._draw(np.stack([self._uniforms(int(i)) for i in indices]))

    def stationary(self, iters: int = 500) -> np.ndarray:
        V, q = self.vocab_size, self.structure
        pi = self.unigram.copy()
        for _ in range(iters):
            new = (1 - q) * self.unigram + q * np.bincount(
                self.successors.ravel(), weights=(pi[:, None] * self.weights).ravel(), minlength=V)
            if np.max(np.abs(new - pi)) < 1e-13:
                pi = new
                break
            pi = new
        return pi / pi.sum()

    def entropy_rate(self) -> float:
        """sum_i pi_i H(P(. | i)) in nats: the loss floor."""
        q, p = self.structure, self.unigram
        base_terms = -(1 - q) * p * np.log((1 - q) * p)
        base = base_terms.sum()
        pi = self.stationary()
        h = np.empty(self.vocab_size)
        for i in range(self.vocab_size):
            succ, w = self.successors[i], self.weights[i]
            js = np.unique(succ)
            mass = np.array([w[succ == j].sum() for j in js])
            pij = (1 - q) * p[js] + q * mass
            h[i] = base - base_terms[js].sum() - np.sum(pij * np.log(pij))
        return float(pi @ h)
