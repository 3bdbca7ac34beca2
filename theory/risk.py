"""Per-layer spike risk from the closed forms (consumed by simulate's predict helper).

For each layer l with rho_l = rms(g_l)/eps and lag-1 gradient correlation phi_l:
    regime        frozen (rho < 0.1) / transition (0.1 <= rho <= 10) /
                  scale_invariant (rho > 10)                         [theory.eps_regime]
    update_rms    exact sqrt(E r^2) for an AR(1) stream at (rho, phi, snr)
    bc, sat_frac  bimodality of r across the layer's coordinates (random-sign mean
                  +-snr*sigma; second-order, theory.bimodality.r_bimodality)
    rms_t_bound   1/sqrt(1-b2), the overshoot bound after a dormant stretch
    const_peak    peak of (1-b1^k)/sqrt(1-b2^k) (constant gradient after dormancy)
    eps_star      lr lam (1-b1)/(2(1+b1)) and bai_safe = eps >= eps_star (when lam is given)
    frozen_risk   the layer sits below rho = 0.1 (updates ~ m/eps ~ 0; a coherent wake-up
                  can move many coordinates to |r| ~ 1 at once)
"""

from __future__ import annotations

import math
from typing import Sequence

from . import _validate as V
from .bimodality import BC_THRESHOLD, r_bimodality
from .eps_regime import regime, update_rms
from .quadratic import critical_eps
from .transients import constant_after_dormancy_peak, dormant_rms_t_bound


def layer_risk(rho: Sequence[float] | float, phi: Sequence[float] | float, b1: float, b2: float,
               eps: float, lr: float, snr: Sequence[float] | float = 0.0,
               lam: float | None = None, names: Sequence[str] | None = None) -> list[dict]:
    """One dict per layer (see module docstring); rho, phi, snr broadcast to a common length."""
    b1, b2 = V.beta("b1", b1), V.beta("b2", b2)
    eps, lr = V.positive("eps", eps), V.positive("lr", lr)

    def seq(name, x):
        return [x] if isinstance(x, (int, float)) else list(x)

    rhos, phis, snrs = seq("rho", rho), seq("phi", phi), seq("snr", snr)
    n = max(len(rhos), len(phis), len(snrs))
    for name, s in (("rho", rhos), ("phi", phis), ("snr", snrs)):
        if len(s) not in (1, n):
            raise ValueError(f"{name}: length {len(s)} does not match {n} layers")
    if names is not None and len(names) != n:
        raise ValueError(f"names: length {len(names)} does not match {n} layers")
    pick = lambda s, i: s[0] if len(s) == 1 else s[i]  # noqa: E731
    kp, vp = constant_after_dormancy_peak(b1, b2)
    bound = dormant_rms_t_bound(b2)
    es = critical_eps(lr, lam, b1) if lam is not None else None
    out = []
    cache: dict = {}
    for i in range(n):
        r = V.positive("rho", pick(rhos, i))
        p = V.phi("phi", pick(phis, i))
        s = V.nonneg("snr", pick(snrs, i))
        key = (r, p, s)
        if key not in cache:
            sigma = 1.0 / math.sqrt(1 + s * s)
            bim = r_bimodality(b1, b2, 1.0 / r, s, p, sigma=sigma)
            cache[key] = (update_rms(r, b1, b2, p, s), bim)
        urms, bim = cache[key]
        reg = regime(r)
        row = {
            "name": names[i] if names is not None else str(i), "rho": r, "phi": p, "snr": s,
            "regime": reg, "update_rms": urms, "update_rms_lr": lr * urms,
            "bc": bim["bc"], "bimodal": bool(bim["bc"] > BC_THRESHOLD), "sat_frac": bim["sat_frac"],
            "rms_t_bound": bound, "const_peak": vp, "const_peak_step": kp,
            "frozen_risk": reg == "frozen",
            "eps_star": es, "bai_safe": (eps >= es) if es is not None else None,
        }
        out.append(row)
    return out
