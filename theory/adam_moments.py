"""Moments of Adam's state and update for a Gaussian AR(1) gradient stream.

Per coordinate g_t = mu + sigma z_t, z stationary AR(1): z_t = phi z_{t-1} + sqrt(1-phi^2) e_t,
Var z = 1, Cov(z_i, z_j) = phi^|i-j|.  Adam from zero state (steps t = 1, 2, ...):

    m_t = b1 m_{t-1} + (1-b1) g_t,    m_hat = m_t / (1-b1^t)
    v_t = b2 v_{t-1} + (1-b2) g_t^2,  v_hat = v_t / (1-b2^t)
    r_t = m_hat / (sqrt(v_hat) + eps)

Exact (closed form, any t; t = inf is the stationary limit), with w_i = (1-b1) b1^(t-i):
    E m_t   = mu (1 - b1^t)
    Var m_t = sigma^2 sum_ij w_i w_j phi^|i-j|
            -> sigma^2 (1-b1)/(1+b1) (1+phi b1)/(1-phi b1)            (t -> inf)
    E v_t   = (mu^2 + sigma^2)(1 - b2^t)
    Var v_t = sum_ij u_i u_j [4 mu^2 sigma^2 phi^|i-j| + 2 sigma^4 phi^(2|i-j|)],
              u_i = (1-b2) b2^(t-i)   (Gaussian: E[z_i^2 z_j^2] = 1 + 2 phi^(2|i-j|))
    Cov(m_t, v_t) = 2 mu sigma^2 sum_ij w_i u_j phi^|i-j|

The update r (method="exact"): E r, E r^2, E|r| by the Laplace representation
    (sqrt V + eps)^-1 = int_0^inf [1/sqrt(pi s) - eps erfcx(eps sqrt s)] e^{-sV} ds
and the Gaussian tilt e^{-s v_hat} (see theory/_gauss.py): exact up to a quadrature error
< 1e-10.  method="second_order": delta method, G(v) = (sqrt v + eps)^-p expanded to
second order in v_hat - E v_hat, conditionally on m_hat (keeps the m-v correlation):
    E r   ~ E[m (G0 + G1 d + G2 d^2 / 2)],  d = v_hat - E v_hat
    E r^2 ~ E[m^2 (H0 + H1 d + H2 d^2 / 2)], H = G^2
Leading order (i.i.d., mu = 0, eps = 0, t -> inf): std r = sqrt((1-b1)/(1+b1)).
Its error is third order in d / E v: about 0.6 % at (b1, b2) = (0.9, 0.95) stationary
(0.2275 vs exact 0.2261), growing with phi (3.6 % at phi = 0.5) and large at small t
(t = 5: 16 %).  Use "exact" for numbers, "second_order" for insight.

grad_mom_cos = cos(g_t, m_{t-1}) over N coordinates -> E[g_t m_{t-1}] / sqrt(E g^2 E m^2)
almost surely as N -> inf (law of large numbers; exact in that limit, O(1/N) bias below):
    E[g_t m_{t-1}] = mu^2 (1-b1^{t-1}) + sigma^2 (1-b1) phi (1 - (b1 phi)^{t-1}) / (1 - b1 phi)

rms_t = sqrt(E[g_t^2 / v_hat_t]) (StableAdamW) ignores the eps^2 floor of max(v_hat, eps^2):
exact when P(v_hat < eps^2) = 0.
"""

from __future__ import annotations

import math

import numpy as np

from . import _gauss as G
from . import _validate as V


def _window(b1, b2, t, mu, sigma):
    n = G.window_len((b1, b2), t)
    return n, np.full(n, mu), np.full(n, sigma)


def _check_stream(b1, b2, eps, sigma, mu, phi, t):
    return (V.beta("b1", b1), V.beta("b2", b2), V.eps("eps", eps), V.positive("sigma", sigma),
            V.finite("mu", mu), V.phi("phi", phi), V.step("t", t))


def iid_update_std(b1: float) -> float:
    """Leading-order std of r for i.i.d. zero-mean gradients: sqrt((1-b1)/(1+b1))."""
    b1 = V.beta("b1", b1)
    return math.sqrt((1.0 - b1) / (1.0 + b1))


def m_moments(b1: float, sigma: float = 1.0, mu: float = 0.0, phi: float = 0.0,
              t: float = math.inf, bias_correct: bool = False) -> dict:
    """Exact mean and variance of m_t (or m_hat when bias_correct)."""
    b1, _, _, sigma, mu, phi, t = _check_stream(b1, 0.0, 0.0, sigma, mu, phi, t)
    n = G.window_len((b1,), t)
    a = G.ema_weights(b1, n, t, bias_correct)
    mean, var = G.linear_moments(np.full(n, mu), np.full(n, sigma), phi, a)
    if not math.isfinite(t):
        # closed form of the stationary variance (identical to the sum up to 1e-17)
        var = sigma ** 2 * (1 - b1) / (1 + b1) * (1 + phi * b1) / (1 - phi * b1)
    return {"mean": mean, "var": var}


def v_moments(b2: float, sigma: float = 1.0, mu: float = 0.0, phi: float = 0.0,
              t: float = math.inf, bias_correct: bool = False) -> dict:
    """Exact mean and variance of v_t (or v_hat when bias_correct)."""
    _, b2, _, sigma, mu, phi, t = _check_stream(0.0, b2, 0.0, sigma, mu, phi, t)
    n = G.window_len((b2,), t)
    c = G.ema_weights(b2, n, t, bias_correct)
    mean, var = G.quadratic_moments(np.full(n, mu), np.full(n, sigma), phi, c)
    return {"mean": mean, "var": var}


def mv_cov(b1: float, b2: float, sigma: float = 1.0, mu: float = 0.0, phi: float = 0.0,
           t: float = math.inf, bias_correct: bool = False) -> float:
    """Exact Cov(m_t, v_t) = 2 mu sigma^2 sum_ij w_i u_j phi^|i-j|."""
    b1, b2, _, sigma, mu, phi, t = _check_stream(b1, b2, 0.0, sigma, mu, phi, t)
    n, mus, sgs = _window(b1, b2, t, mu, sigma)
    return G.cov_linear_quadratic(mus, sgs, phi, G.ema_weights(b1, n, t, bias_correct),
                                  G.ema_weights(b2, n, t, bias_correct))


def grad_mom_cos(b1: float, sigma: float = 1.0, mu: float = 0.0, phi: float = 0.0,
                 t: float = math.inf) -> float:
    """Large-coordinate limit of cos(g_t, m_{t-1}) (needs t >= 2)."""
    b1, _, _, sigma, mu, phi, t = _check_stream(b1, 0.0, 0.0, sigma, mu, phi, t)
    if t < 2:
        raise ValueError(f"t: must be >= 2 (m_0 = 0), got {t!r}")
    tm = t - 1
    bt = 0.0 if not math.isfinite(tm) else b1 ** tm
    bpt = 0.0 if not math.isfinite(tm) else (b1 * phi) ** tm
    num = mu * mu * (1 - bt) + sigma ** 2 * (1 - b1) * phi * (1 - bpt) / (1 - b1 * phi)
    mm = m_moments(b1, sigma, mu, phi, tm)
    em2 = mm["mean"] ** 2 + mm["var"]
    return float(num / math.sqrt((mu * mu + sigma ** 2) * em2))


def update_stats(b1: float, b2: float, eps: float, sigma: float = 1.0, mu: float = 0.0,
                 phi: float = 0.0, t: float = math.inf, method: str = "exact") -> dict:
    """Statistics of r = m_hat/(sqrt(v_hat)+eps) and of m_hat, v_hat at step t.

    Returns r_mean, r_rms, r_std, r_abs (E|r|), m_mean, m_var, v_mean, v_var (of m_hat,
    v_hat), mv_cov, rms_t, grad_mom_cos (nan at t = 1), update_std_leading, method.
    """
    b1, b2, eps, sigma, mu, phi, t = _check_stream(b1, b2, eps, sigma, mu, phi, t)
    if method not in ("exact", "second_order"):
        raise ValueError(f"method: must be 'exact' or 'second_order', got {method!r}")
    n, mus, sgs = _window(b1, b2, t, mu, sigma)
    a = G.ema_weights(b1, n, t)
    c = G.ema_weights(b2, n, t)
    m_mean, m_var = G.linear_moments(mus, sgs, phi, a)
    v_mean, v_var = G.quadratic_moments(mus, sgs, phi, c)
    cov = G.cov_linear_quadratic(mus, sgs, phi, a, c)
    last = np.zeros(n)
    last[-1] = 1.0
    if method == "exact":
        lap = G.laplace(mus, sgs, phi, np.stack([a, last]), c, eps)
        r1, r2, rabs = (float(lap[k][0]) for k in ("r1", "r2", "rabs"))
        inv2 = float(lap["inv2"][1])
    else:
        r1 = G.second_order(mus, sgs, phi, a, c, eps, q=1, p=1)
        r2 = G.second_order(mus, sgs, phi, a, c, eps, q=2, p=2)
        rabs = G.second_order(mus, sgs, phi, a, c, eps, q=1, p=1, absval=True)
        inv2 = G.second_order(mus, sgs, phi, last, c, 0.0, q=2, p=2)
    gmc = grad_mom_cos(b1, sigma, mu, phi, t) if t >= 2 else math.nan
    return {
        "r_mean": r1, "r_rms": math.sqrt(max(r2, 0.0)),
        "r_std": math.sqrt(max(r2 - r1 * r1, 0.0)), "r_abs": rabs,
        "m_mean": m_mean, "m_var": m_var, "v_mean": v_mean, "v_var": v_var, "mv_cov": cov,
        "rms_t": math.sqrt(max(inv2, 0.0)), "grad_mom_cos": gmc,
        "update_std_leading": math.sqrt((1 - b1) / (1 + b1)), "method": method,
    }
