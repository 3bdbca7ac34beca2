"""The eps regime: Adam's update size as a function of rho = rms(g) / eps.

With rms(g) = sqrt(mu^2 + sigma^2) fixed and eps = rms(g)/rho, r = m_hat/(sqrt(v_hat)+eps):
    rho >> 1  (scale-invariant):  r ~ m_hat/sqrt(v_hat), update_rms independent of rho
    rho << 1  (frozen):           r ~ m_hat/eps,  update_rms ~ rho sqrt(E m_hat^2) / rms(g)
              i.i.d. zero mean:   update_rms ~ rho sqrt((1-b1)/(1+b1))
Scaling the loss by s multiplies rho by s (it is the same as eps -> eps/s).
Regimes (thresholds used by theory.risk): frozen rho < 0.1, transition 0.1 <= rho <= 10,
scale-invariant rho > 10.  update_rms is exact (theory.adam_moments, method="exact").
"""

from __future__ import annotations

import math

import numpy as np

from . import _validate as V
from .adam_moments import m_moments, update_stats

RHO_FROZEN = 0.1
RHO_SCALE_INVARIANT = 10.0
REGIMES = ("frozen", "transition", "scale_invariant")


def regime(rho: float) -> str:
    """'frozen' (rho < 0.1), 'transition' (0.1..10) or 'scale_invariant' (rho > 10)."""
    rho = V.positive("rho", rho)
    if rho < RHO_FROZEN:
        return "frozen"
    if rho > RHO_SCALE_INVARIANT:
        return "scale_invariant"
    return "transition"


def regimes(rho) -> np.ndarray:
    """`regime` elementwise over an array, unvalidated (NaN -> 'transition', like no band)."""
    rho = np.asarray(rho, dtype=float)
    return np.select([rho < RHO_FROZEN, rho > RHO_SCALE_INVARIANT],
                     [REGIMES[0], REGIMES[2]], REGIMES[1])


def _split(snr):
    snr = V.nonneg("snr", snr)
    sigma = 1.0 / math.sqrt(1.0 + snr * snr)          # rms(g) = 1
    return sigma, snr * sigma


def update_rms(rho: float, b1: float, b2: float, phi: float = 0.0, snr: float = 0.0,
               t: float = math.inf, method: str = "exact") -> float:
    """sqrt(E r^2) at rho = rms(g)/eps (rms(g) = sqrt(mu^2+sigma^2), snr = |mu|/sigma)."""
    rho = V.positive("rho", rho)
    sigma, mu = _split(snr)
    return update_stats(b1, b2, 1.0 / rho, sigma, mu, phi, t, method)["r_rms"]


def update_rms_curve(rho, b1: float, b2: float, phi: float = 0.0, snr: float = 0.0,
                     t: float = math.inf, method: str = "exact") -> np.ndarray:
    """update_rms over an array of rho."""
    rho = V.finite_array("rho", rho)
    return np.array([update_rms(r, b1, b2, phi, snr, t, method) for r in rho.ravel()]).reshape(rho.shape)


def frozen_limit(rho, b1: float, phi: float = 0.0, snr: float = 0.0,
                 t: float = math.inf) -> np.ndarray:
    """rho -> 0 asymptote: rho sqrt(E m_hat^2)/rms(g)  (= rho sqrt((1-b1)/(1+b1)) for i.i.d.)."""
    rho = V.finite_array("rho", rho)
    if np.any(rho <= 0):
        raise ValueError("rho: must be > 0")
    sigma, mu = _split(snr)
    mm = m_moments(b1, sigma, mu, phi, t, bias_correct=True)
    return rho * math.sqrt(mm["mean"] ** 2 + mm["var"])


def scale_invariant_limit(b1: float, b2: float, phi: float = 0.0, snr: float = 0.0,
                          t: float = math.inf) -> float:
    """rho -> inf asymptote: update_rms at eps = 0."""
    sigma, mu = _split(snr)
    return update_stats(b1, b2, 0.0, sigma, mu, phi, t)["r_rms"]
