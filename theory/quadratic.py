"""Quadratic stability of Adam (Bai et al. 2025): when a decayed v makes the step too large.

For a direction of curvature lam, late in training (bias correction of m: 1 - b1^t):
    effective lr      lr_eff  = lr / (sqrt(v_hat) + eps)
    preconditioned    lam_hat = lam (1-b1) / ((1+b1)(1-b1^t)) / (sqrt(v_hat) + eps)
    unstable          lam_hat > 2 / lr   (threshold of the heavy-ball/EMA iteration)
Since lam_hat <= lam c / eps (c = (1-b1)/(1+b1), t -> inf) whatever v does, any
    eps >= eps* = lr lam (1-b1) / (2 (1+b1))
rules the instability out (lam=1, lr=1e-2, b1=0.9: eps* = 2.63e-4).  For eps < eps*, the
instability starts once sqrt(v_hat) < sqrt(v*) = eps*/(1-b1^t) - eps, reached from v0 after log(v*/v0)/log(b2) steps of pure decay (g^2 << v).
"""

from __future__ import annotations

import math

from . import _validate as V


def _common(lr, b1, eps, t):
    return V.positive("lr", lr), V.beta("b1", b1), V.eps("eps", eps), V.step("t", t)


def effective_lr(lr: float, v_hat: float, eps: float) -> float:
    """lr / (sqrt(v_hat) + eps)."""
    lr, v, eps = V.positive("lr", lr), V.nonneg("v_hat", v_hat), V.eps("eps", eps)
    if v == 0 and eps == 0:
        return math.inf
    return lr / (math.sqrt(v) + eps)


def preconditioned_curvature(lam: float, b1: float, v_hat: float, eps: float,
                             t: float = math.inf) -> float:
    """lam_hat = lam (1-b1) / ((1+b1)(1-b1^t)) / (sqrt(v_hat) + eps)."""
    lam = V.nonneg("lam", lam)
    b1, v, eps, t = V.beta("b1", b1), V.nonneg("v_hat", v_hat), V.eps("eps", eps), V.step("t", t)
    bc = 1.0 if not math.isfinite(t) else 1.0 - b1 ** t
    den = math.sqrt(v) + eps
    if den == 0:
        return math.inf if lam > 0 else 0.0
    return lam * (1 - b1) / ((1 + b1) * bc) / den


def stability_threshold(lr: float) -> float:
    """2 / lr."""
    return 2.0 / V.positive("lr", lr)


def critical_eps(lr: float, lam: float, b1: float) -> float:
    """eps* = lr lam (1-b1) / (2 (1+b1))."""
    lr, lam, b1 = V.positive("lr", lr), V.nonneg("lam", lam), V.beta("b1", b1)
    return lr * lam * (1 - b1) / (2 * (1 + b1))


def is_unstable(lr: float, lam: float, b1: float, eps: float, v_hat: float,
                t: float = math.inf) -> bool:
    """True when the curvature along the gradient, lam_hat, exceeds 2/lr."""
    lr, b1, eps, t = _common(lr, b1, eps, t)
    return preconditioned_curvature(lam, b1, v_hat, eps, t) > stability_threshold(lr)


def critical_v(lr: float, lam: float, b1: float, eps: float, t: float = math.inf) -> float:
    """v* such that v_hat < v* is unstable: sqrt(v*) = lr lam (1-b1)/(2(1+b1)(1-b1^t)) - eps
    (0 when eps is at or above that, i.e. no v is unstable)."""
    lr, b1, eps, t = _common(lr, b1, eps, t)
    lam = V.nonneg("lam", lam)
    bc = 1.0 if not math.isfinite(t) else 1.0 - b1 ** t
    root = lr * lam * (1 - b1) / (2 * (1 + b1) * bc) - eps
    return root * root if root > 0 else 0.0


def decay_steps_to_instability(v0: float, lr: float, lam: float, b1: float, b2: float,
                               eps: float) -> float:
    """Steps of pure decay (g^2 << v, v_k = b2^k v0) until v < v*; inf if never, 0 if already."""
    v0 = V.positive("v0", v0)
    b2 = V.beta("b2", b2)
    vs = critical_v(lr, lam, b1, eps)
    if vs <= 0:
        return math.inf
    if v0 < vs:
        return 0.0
    if b2 == 0:
        return 1.0
    return math.log(vs / v0) / math.log(b2)
