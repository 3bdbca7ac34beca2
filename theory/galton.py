"""Galton boards: the sum K of n left/right deflections (K = number of "right"s, 0..n).

Independent deflections, P(right) = p:
    P(K = k) = C(n,k) p^k q^(n-k),   q = 1 - p;   K ~ N(np, npq) as n -> inf
    Berry-Esseen: sup_x |F_n(x) - Phi((x-np)/sqrt(npq))| <= C0 (p^2+q^2) / sqrt(npq),
    C0 = 0.4748 (Shevtsova 2011; rho/sigma^3 = (p^2+q^2)/sqrt(pq) for a Bernoulli).
Exchangeable deflections (beta-binomial), intra-class correlation icc = Corr(X_i, X_j):
    alpha = p (1-icc)/icc,  beta = q (1-icc)/icc   (icc = 1/(alpha+beta+1))
    E K = np,  Var K = npq (1 + (n-1) icc)
Markov-persistent deflections: X_1 ~ Bern(p); X_{i+1} = X_i with probability `persist`,
otherwise a fresh Bern(p) draw.  Stationary, Corr(X_i, X_{i+k}) = persist^k:
    E K = np,  Var K = pq [n (1+a)/(1-a) - 2a (1-a^n)/(1-a)^2],  a = persist.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special, stats

from . import _validate as V

BERRY_ESSEEN_C = 0.4748


def _np(n, p):
    return V.count("n", n, 1), V.prob("p", p, open_low=True, open_high=True)


def binomial_pmf(n: int, p: float = 0.5) -> np.ndarray:
    """P(K = k), k = 0..n, independent deflections."""
    n, p = _np(n, p)
    return stats.binom.pmf(np.arange(n + 1), n, p)


def normal_limit_pmf(n: int, p: float = 0.5) -> np.ndarray:
    """Normal limit with continuity correction: Phi((k+1/2-np)/s) - Phi((k-1/2-np)/s)."""
    n, p = _np(n, p)
    s = math.sqrt(n * p * (1 - p))
    k = np.arange(n + 1)
    return special.ndtr((k + 0.5 - n * p) / s) - special.ndtr((k - 0.5 - n * p) / s)


def berry_esseen_bound(n: int, p: float = 0.5, c0: float = BERRY_ESSEEN_C) -> float:
    """C0 (p^2 + q^2) / sqrt(n p q): bound on the Kolmogorov distance to the normal."""
    n, p = _np(n, p)
    q = 1 - p
    return float(V.positive("c0", c0) * (p * p + q * q) / math.sqrt(n * p * q))


def kolmogorov_distance(n: int, p: float = 0.5) -> float:
    """Actual sup_x |F_n(x) - Phi((x - np)/sqrt(npq))| (attained at the jumps)."""
    n, p = _np(n, p)
    k = np.arange(n + 1)
    cdf = stats.binom.cdf(k, n, p)
    left = np.concatenate([[0.0], cdf[:-1]])
    phi = special.ndtr((k - n * p) / math.sqrt(n * p * (1 - p)))
    return float(max(np.max(np.abs(cdf - phi)), np.max(np.abs(left - phi))))


def betabinom_params(icc: float, p: float = 0.5) -> tuple[float, float]:
    """(alpha, beta) of the beta-binomial with mean p and intra-class correlation icc."""
    icc = V.prob("icc", icc, open_low=True, open_high=True)
    p = V.prob("p", p, open_low=True, open_high=True)
    k = (1 - icc) / icc
    return p * k, (1 - p) * k


def _check_icc(icc):
    return V.prob("icc", icc)


def betabinom_pmf(n: int, icc: float, p: float = 0.5) -> np.ndarray:
    """P(K = k), exchangeable deflections with correlation icc in [0, 1].

    Stable for every icc (no alpha, beta overflow): with rho = icc,
        f(0) = prod_{j<n} (q(1-rho) + j rho) / ((1-rho) + j rho)
        f(k+1)/f(k) = (n-k)(k rho + p(1-rho)) / ((k+1)((n-k-1) rho + q(1-rho)))
    (the alpha/beta ratios multiplied through by rho); icc = 0 is the binomial.
    """
    n, p = _np(n, p)
    rho = _check_icc(icc)
    q = 1 - p
    if rho == 1.0:
        out = np.zeros(n + 1)
        out[0], out[n] = q, p
        return out
    j = np.arange(n, dtype=float)
    logf0 = float(np.sum(np.log(q * (1 - rho) + j * rho) - np.log((1 - rho) + j * rho)))
    k = np.arange(n, dtype=float)
    logr = (np.log(n - k) + np.log(k * rho + p * (1 - rho))
            - np.log(k + 1) - np.log((n - k - 1) * rho + q * (1 - rho)))
    logf = logf0 + np.concatenate([[0.0], np.cumsum(logr)])
    return np.exp(logf)


def pmf_moments(pmf: np.ndarray) -> dict:
    """mean, var, skew, kurt_excess of a pmf on 0..n."""
    pmf = V.finite_array("pmf", pmf)
    k = np.arange(pmf.size, dtype=float)
    m = float(np.dot(pmf, k))
    c = k - m
    var = float(np.dot(pmf, c ** 2))
    if var <= 0:
        raise ValueError("pmf: must have positive variance")
    return {"mean": m, "var": var, "skew": float(np.dot(pmf, c ** 3)) / var ** 1.5,
            "kurt_excess": float(np.dot(pmf, c ** 4)) / var ** 2 - 3.0}


def betabinom_moments(n: int, icc: float, p: float = 0.5) -> dict:
    """Mean, var, skew, kurt_excess of the beta-binomial (from its exact pmf), and the
    closed form var_closed_form = npq (1 + (n-1) icc)."""
    n, p = _np(n, p)
    icc = _check_icc(icc)
    mom = pmf_moments(betabinom_pmf(n, icc, p))
    mom["var_closed_form"] = n * p * (1 - p) * (1 + (n - 1) * icc)
    return mom


def markov_pmf(n: int, persist: float, p: float = 0.5) -> np.ndarray:
    """Exact P(K = k) for Markov-persistent deflections (dynamic programming, O(n^2))."""
    n, p = _np(n, p)
    a = V.prob("persist", persist)
    q = 1 - p
    # f[s, k]: P(last deflection = s, k rights so far)
    f = np.zeros((2, n + 1))
    f[0, 0], f[1, 1] = q, p
    to1 = np.array([(1 - a) * p, a + (1 - a) * p])     # P(next = right | last = 0, 1)
    for _ in range(n - 1):
        g = np.zeros_like(f)
        for s in (0, 1):
            g[1, 1:] += f[s, :-1] * to1[s]
            g[0, :] += f[s, :] * (1 - to1[s])
        f = g
    return f.sum(0)


def _markov_pair_sum(n: int, a: float) -> float:
    """S = sum_{k=1}^{n-1} (n - k) a^k, the correlated pairs' weight in var K = pq (n + 2S).

    The closed form a (n (1-a) - (1 - a^n)) / (1-a)^2 cancels catastrophically as a -> 1
    (at a = 1 - 1e-16 and n = 1 it gave var = 2pq instead of pq). With t = 1 - a (exact)
    and 1 - a^n = -expm1(n log a) it loses at most ~20 ulps while n t >= 0.1; below
    that, the positive terms are summed directly (in chunks: n < 0.1 / t)."""
    if n < 2 or a == 0.0:
        return 0.0
    t = 1.0 - a
    if t == 0.0:
        return n * (n - 1) / 2.0
    log_a = math.log1p(-t) if a >= 0.5 else math.log(a)   # t exact for a >= 1/2
    if n * t >= 0.1:
        return a * (n * t + math.expm1(n * log_a)) / (t * t)
    total, chunk = 0.0, 1 << 20
    for lo in range(1, n, chunk):
        k = np.arange(lo, min(n, lo + chunk), dtype=np.float64)
        total += float(np.dot(n - k, np.exp(k * log_a)))
    return total


def markov_moments(n: int, persist: float, p: float = 0.5) -> dict:
    """Mean n p and variance p q (n + 2 sum_{k=1}^{n-1} (n-k) a^k) of K for
    Markov-persistent deflections (corr(X_i, X_j) = a^|i-j|), evaluated stably for a
    near 1 (`_markov_pair_sum`)."""
    n, p = _np(n, p)
    a = V.prob("persist", persist)
    q = 1 - p
    return {"mean": n * p, "var": p * q * (n + 2.0 * _markov_pair_sum(n, a))}
