"""Second-moment transients: v lags a step up of the gradient scale (StableAdamW's signal).

Scenario: a quiet stretch with g = sigma_q z (z AR(1), phi) of `quiet` steps (None: long
enough that v is stationary), then g = kappa sigma_q z for steps k = 1..K.  Per step k, exact
(theory._gauss.laplace, no expansion):
    rms_t(k) = sqrt(E[g_k^2 / v_hat_k])      (the eps^2 floor of max(v_hat, eps^2) ignored)
    r_rms(k) = sqrt(E r_k^2),  r_abs(k) = E|r_k|   (eps included)
Bounds:
    dormant v (v ~ 0 before the step; kappa -> inf), first loud step:
        g^2 / v_hat <= 1/(1-b2)  =>  rms_t <= 1/sqrt(1-b2)    (31.6 / 10 / 4.47 for
        b2 = 0.999 / 0.99 / 0.95)
    constant gradient after dormancy (m = v = 0, t large):
        |r_k| = (1 - b1^k) / sqrt(1 - b2^k)
        peak (b1 = 0.9): 6.57 at k = 12 (b2 = 0.999), 2.13 at k = 13 (0.99), 1.10 at k = 20 (0.95)
"""

from __future__ import annotations

import math

import numpy as np

from . import _gauss as G
from . import _validate as V


def dormant_rms_t_bound(b2: float) -> float:
    """1/sqrt(1-b2): the largest rms_t on the first step after a dormant stretch."""
    return 1.0 / math.sqrt(1.0 - V.beta("b2", b2))


def constant_after_dormancy(b1: float, b2: float, k) -> np.ndarray:
    """|r_k| = (1-b1^k)/sqrt(1-b2^k) for a constant gradient after dormancy (k >= 1)."""
    b1, b2 = V.beta("b1", b1), V.beta("b2", b2)
    k = V.finite_array("k", k)
    if np.any(k < 1):
        raise ValueError("k: must be >= 1")
    return (1.0 - b1 ** k) / np.sqrt(1.0 - b2 ** k)


def constant_after_dormancy_peak(b1: float, b2: float, k_max: int = 100000) -> tuple[int, float]:
    """(k, value) of the peak of (1-b1^k)/sqrt(1-b2^k) over integers 1..k_max."""
    k_max = V.count("k_max", k_max)
    k = np.arange(1, k_max + 1, dtype=float)
    r = constant_after_dormancy(b1, b2, k)
    i = int(np.argmax(r))
    return int(k[i]), float(r[i])


def step_up(b1: float, b2: float, kappa: float, steps: int = 50, sigma_q: float = 1.0,
            phi: float = 0.0, eps: float = 0.0, quiet: int | None = None) -> dict:
    """Expected rms_t, r_rms, r_abs for loud steps k = 1..steps after the scale steps up.

    Returns arrays k, rms_t, r_rms, r_abs; peak_rms_t, peak_step (argmax of rms_t),
    bound (1/sqrt(1-b2)), const_peak_step/const_peak (dormant constant-gradient peak),
    rms_t_before (stationary quiet value).
    """
    b1, b2 = V.beta("b1", b1), V.beta("b2", b2)
    kappa, sigma_q = V.positive("kappa", kappa), V.positive("sigma_q", sigma_q)
    phi, eps = V.phi("phi", phi), V.eps("eps", eps)
    steps = V.count("steps", steps)
    if quiet is None:
        nq = G.window_len((b1, b2), math.inf)
    else:
        nq = V.count("quiet", quiet, 0)
    rms_t, r_rms, r_abs = [], [], []
    for k in range(0, steps + 1):
        n = nq + k
        if n == 0:
            continue
        t = math.inf if quiet is None else float(n)
        sig = np.concatenate([np.full(nq, sigma_q), np.full(k, kappa * sigma_q)])
        mu = np.zeros(n)
        a = G.ema_weights(b1, n, t)
        c = G.ema_weights(b2, n, t)
        last = np.zeros(n)
        last[-1] = 1.0
        lap = G.laplace(mu, sig, phi, np.stack([a, last]), c, eps)
        if k == 0:
            before = math.sqrt(lap["inv2"][1])
            continue
        rms_t.append(math.sqrt(lap["inv2"][1]))
        r_rms.append(math.sqrt(lap["r2"][0]))
        r_abs.append(float(lap["rabs"][0]))
    rms_t = np.array(rms_t)
    i = int(np.argmax(rms_t))
    kp, vp = constant_after_dormancy_peak(b1, b2)
    return {"k": np.arange(1, steps + 1), "rms_t": rms_t, "r_rms": np.array(r_rms),
            "r_abs": np.array(r_abs), "peak_rms_t": float(rms_t[i]), "peak_step": i + 1,
            "bound": dormant_rms_t_bound(b2), "const_peak_step": kp, "const_peak": vp,
            "rms_t_before": before if nq > 0 else math.nan}
