"""Bimodality: Sarle's coefficient, the correlated Galton board's U-shape, and r's shape.

Sarle's bimodality coefficient (a uniform distribution has 5/9; larger suggests bimodality):
    population  BC = (skew^2 + 1) / kurt = (skew^2 + 1) / (kurt_excess + 3)
    sample      BC = (g^2 + 1) / (k + 3 (n-1)^2 / ((n-2)(n-3)))
                g, k: bias-adjusted sample skewness G1 and excess kurtosis G2.

Beta-binomial (exchangeable Galton board, see theory.galton): the pmf ratio
    f(k+1)/f(k) = (n-k)(k+alpha) / ((k+1)(n-k-1+beta))
is increasing in k when alpha, beta < 1, so the pmf is U-shaped (f(0) > f(1), f(n) > f(n-1),
single interior minimum) iff both end conditions hold:  n alpha - beta < n-1 and
n beta - alpha < n-1 (they imply alpha, beta < 1).  With alpha = p K, beta = q K,
K = (1-icc)/icc:  U-shaped  <=>  icc > icc_U = 1 / (1 + (n-1) / (n max(p,q) - min(p,q))).
p = 1/2: alpha = beta = (1-icc)/(2 icc), icc_U = 1/3 for every n >= 2.  n -> inf:
icc_U -> max(p,q) / (1 + max(p,q)), i.e. alpha < 1 and beta < 1.

Bimodality of r across coordinates (Adam update of an AR(1) stream with mean +-|mu|, see
theory.adam_moments): with random signs r is symmetric, BC = (E r^2)^2 / E r^4 ... inverted:
BC = 1 / (E r^4 / (E r^2)^2).  Two approximations (method):
  "mean_v": v_hat replaced by its mean s2 = mu^2 + sigma^2, m_hat exactly Gaussian, so r is
            a mixture of N(+-c, s^2), c = |mu|/(sqrt s2 + eps), s^2 = Var m_hat/(sqrt s2+eps)^2;
            sat_frac = Phi((c-0.9)/s) + Phi((-c-0.9)/s).
  "second_order" (default): E r^2, E r^4 with (sqrt v + eps)^-p expanded to second order in
            v - E v conditionally on m (theory._gauss.second_order); sat_frac with v replaced
            by its conditional mean given m.  Accuracy: see tests/theory (|dBC| <~ 0.03).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize, special

from . import _gauss as G
from . import _validate as V
from . import galton

BC_THRESHOLD = 5.0 / 9.0
SAT_THRESHOLD = 0.9


def bc_population(skew: float, kurt_excess: float) -> float:
    """(skew^2 + 1) / (kurt_excess + 3)."""
    s = V.finite("skew", skew)
    k = V.finite("kurt_excess", kurt_excess)
    if k + 3.0 <= 0:
        raise ValueError(f"kurt_excess: must be > -3, got {kurt_excess!r}")
    return (s * s + 1.0) / (k + 3.0)


def bc_from_raw_moments(m1: float, m2: float, m3: float, m4: float) -> float:
    """Population BC from raw moments E x, E x^2, E x^3, E x^4."""
    m1, m2, m3, m4 = (V.finite(n, x) for n, x in zip(("m1", "m2", "m3", "m4"), (m1, m2, m3, m4)))
    var = m2 - m1 * m1
    if var <= 0:
        raise ValueError(f"m2: variance must be > 0, got m2 - m1^2 = {var!r}")
    skew = (m3 - 3 * m1 * m2 + 2 * m1 ** 3) / var ** 1.5
    kurt = (m4 - 4 * m1 * m3 + 6 * m1 * m1 * m2 - 3 * m1 ** 4) / var ** 2
    return (skew * skew + 1.0) / kurt


def bc_sample(x) -> float:
    """Sample BC (SAS form) with bias-adjusted skewness and excess kurtosis; needs n >= 4."""
    x = V.finite_array("x", x).ravel()
    n = x.size
    if n < 4:
        raise ValueError(f"x: needs at least 4 values, got {n}")
    d = x - x.mean()
    m2 = np.mean(d ** 2)
    if m2 <= 0:
        raise ValueError("x: must not be constant")
    g1 = np.mean(d ** 3) / m2 ** 1.5
    g2 = np.mean(d ** 4) / m2 ** 2 - 3.0
    skew = g1 * math.sqrt(n * (n - 1)) / (n - 2)
    kurt = (n - 1) / ((n - 2) * (n - 3)) * ((n + 1) * g2 + 6.0)
    return float((skew ** 2 + 1.0) / (kurt + 3.0 * (n - 1) ** 2 / ((n - 2) * (n - 3))))


def is_u_shaped(pmf, rtol: float = 1e-12) -> bool:
    """f(0) > f(1), f(n) > f(n-1), and non-increasing then non-decreasing (a flat bottom,
    e.g. the two middle bins of a symmetric pmf with n odd, is allowed; differences below
    rtol * max f count as flat)."""
    f = V.finite_array("pmf", pmf).ravel()
    if f.size < 3:
        return False
    d = np.diff(f)
    tol = rtol * float(np.max(np.abs(f)))
    up, down = d > tol, d < -tol
    if not (down[0] and up[-1]):
        return False
    first_up = int(np.argmax(up))
    return not bool(np.any(down[first_up:]))


def betabinom_u_threshold(n: int, p: float = 0.5) -> float:
    """icc_U: the beta-binomial pmf is U-shaped iff icc > icc_U (exact, n >= 2)."""
    n = V.count("n", n, 2)
    p = V.prob("p", p, open_low=True, open_high=True)
    hi, lo = max(p, 1 - p), min(p, 1 - p)
    kstar = (n - 1) / (n * hi - lo)
    return 1.0 / (1.0 + kstar)


def betabinom_bc(n: int, icc: float, p: float = 0.5) -> float:
    """Population BC of the beta-binomial board."""
    m = galton.betabinom_moments(n, icc, p)
    return bc_population(m["skew"], m["kurt_excess"])


def betabinom_bc_crossing(n: int, p: float = 0.5, threshold: float = BC_THRESHOLD) -> float:
    """icc at which the beta-binomial's population BC crosses `threshold` (brentq)."""
    n = V.count("n", n, 2)
    thr = V.prob("threshold", threshold, open_low=True, open_high=True)
    f = lambda icc: betabinom_bc(n, icc, p) - thr  # noqa: E731
    lo, hi = 1e-9, 1 - 1e-9
    if f(lo) >= 0:
        return 0.0
    return float(optimize.brentq(f, lo, hi, xtol=1e-12))


def markov_bc_crossing(n: int, p: float = 0.5, threshold: float = BC_THRESHOLD) -> float:
    """persist at which the Markov board's population BC crosses `threshold` (brentq)."""
    n = V.count("n", n, 2)
    thr = V.prob("threshold", threshold, open_low=True, open_high=True)

    def f(a):
        m = galton.pmf_moments(galton.markov_pmf(n, a, p))
        return bc_population(m["skew"], m["kurt_excess"]) - thr

    if f(0.0) >= 0:
        return 0.0
    return float(optimize.brentq(f, 0.0, 1 - 1e-9, xtol=1e-12))


def r_bimodality(b1: float, b2: float, eps: float, snr: float, phi: float = 0.0,
                 sigma: float = 1.0, t: float = math.inf, mu_sign: str = "random",
                 method: str = "second_order") -> dict:
    """Shape of r across coordinates with mean +-snr*sigma (random sign) or +snr*sigma.

    Returns r_m1..r_m4 (raw moments), skew, kurt_excess, bc, bimodal (bc > 5/9), sat_frac.
    """
    b1, b2, eps = V.beta("b1", b1), V.beta("b2", b2), V.eps("eps", eps)
    snr, phi, sigma = V.nonneg("snr", snr), V.phi("phi", phi), V.positive("sigma", sigma)
    t = V.step("t", t)
    if mu_sign not in ("random", "fixed"):
        raise ValueError(f"mu_sign: must be 'random' or 'fixed', got {mu_sign!r}")
    if method not in ("second_order", "mean_v"):
        raise ValueError(f"method: must be 'second_order' or 'mean_v', got {method!r}")
    mu = snr * sigma
    n = G.window_len((b1, b2), t)
    mus, sgs = np.full(n, mu), np.full(n, sigma)
    a, c = G.ema_weights(b1, n, t), G.ema_weights(b2, n, t)
    if method == "mean_v":
        _, var_m = G.linear_moments(mus, sgs, phi, a)
        den = math.sqrt(mu * mu + sigma * sigma) + eps
        cm, s = mu / den, math.sqrt(var_m) / den
        mom = [cm, cm ** 2 + s ** 2, cm ** 3 + 3 * cm * s ** 2, cm ** 4 + 6 * cm ** 2 * s ** 2 + 3 * s ** 4]
        sat = float(special.ndtr((cm - SAT_THRESHOLD) / s) + special.ndtr((-cm - SAT_THRESHOLD) / s))
    else:
        mom = [G.second_order(mus, sgs, phi, a, c, eps, q=k, p=k) for k in (1, 2, 3, 4)]
        sat = G.sat_prob(mus, sgs, phi, a, c, eps, SAT_THRESHOLD)
    if mu_sign == "random":
        mom[0] = mom[2] = 0.0
    m1, m2, m3, m4 = mom
    var = m2 - m1 * m1
    skew = (m3 - 3 * m1 * m2 + 2 * m1 ** 3) / var ** 1.5
    kurt = (m4 - 4 * m1 * m3 + 6 * m1 * m1 * m2 - 3 * m1 ** 4) / var ** 2
    bc = (skew * skew + 1.0) / kurt
    return {"r_m1": m1, "r_m2": m2, "r_m3": m3, "r_m4": m4, "skew": skew,
            "kurt_excess": kurt - 3.0, "bc": bc, "bimodal": bool(bc > BC_THRESHOLD),
            "sat_frac": sat, "method": method}


def snr_bc_crossing(b1: float, b2: float, eps: float = 0.0, phi: float = 0.0,
                    threshold: float = BC_THRESHOLD, method: str = "second_order") -> float:
    """SNR at which r's BC across coordinates (random signs) crosses `threshold`."""
    f = lambda s: r_bimodality(b1, b2, eps, s, phi, method=method)["bc"] - threshold  # noqa: E731
    lo, hi = 1e-3, 50.0
    if f(lo) >= 0:
        return 0.0
    if f(hi) < 0:
        return math.inf
    return float(optimize.brentq(f, lo, hi, xtol=1e-6))
