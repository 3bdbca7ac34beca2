"""The eps regime: update RMS vs rho = rms(g)/eps (exact theory + JAX Monte-Carlo).

update_rms = sqrt(E r^2) for i.i.d. gradients (b1 = 0.9, b2 in {0.95, 0.999}) and a persistent
high-SNR stream (phi = 0.5, SNR = 1), rho from 100 down to 0.01; Monte-Carlo points with
3-SE bars; dashed: the frozen asymptote rho sqrt(E m_hat^2)/rms(g) (= rho sqrt((1-b1)/(1+b1))
for i.i.d.); shaded: the frozen (< 0.1) and transition (0.1..10) regimes.

    python -m figures.fig_update_rms_vs_rho --out DIR [--set KEY=VALUE ...]
"""

from __future__ import annotations

import math
import sys

import matplotlib.pyplot as plt
import numpy as np

from figures.style import apply, computed_figure_main, save
from theory import eps_regime as E

CASES = ((0.9, 0.95, 0.0, 0.0), (0.9, 0.999, 0.0, 0.0), (0.9, 0.95, 0.5, 1.0))


# Monte-Carlo sizes (smaller ones: --set KEY=VALUE, figures.style)
SIZES = {"rho_points": 41, "mc_points": 9, "steps": 3000, "coords": 32768}


def prepare(sizes: dict = SIZES, seed: int = 0) -> dict:
    # lazy: jax Monte-Carlo points (simulate.streams): a known figures -> simulate exception
    # (tests/foundation/test_layering.py KNOWN)
    from simulate.streams import simulate_streams

    rho = np.logspace(2, -2, sizes["rho_points"])
    pts = np.logspace(2, -2, sizes["mc_points"])
    steps = sizes["steps"]
    out = []
    for b1, b2, phi, snr in CASES:
        sigma = 1 / math.sqrt(1 + snr * snr)
        mc = simulate_streams([dict(b1=b1, b2=b2, phi=phi, mu=snr * sigma, sigma=sigma, eps=1 / r) for r in pts],
                              steps=steps, n_coords=sizes["coords"], seed=seed)
        out.append({"b1": b1, "b2": b2, "phi": phi, "snr": snr,
                    "theory": E.update_rms_curve(rho, b1, b2, phi, snr, t=steps),
                    "frozen": E.frozen_limit(rho, b1, phi, snr, t=steps),
                    "mc": mc["r_rms"], "mc_se": mc["r_rms_se"]})
    return {"rho": rho, "pts": pts, "cases": out, "steps": steps}


def plot(data: dict, out_dir):
    apply()

    fig, ax = plt.subplots()
    ax.axvspan(data["rho"].min(), E.RHO_FROZEN, color="#7d3c98", alpha=0.08, label="frozen (rho < 0.1)")
    ax.axvspan(E.RHO_FROZEN, E.RHO_SCALE_INVARIANT, color="#f5b041", alpha=0.08, label="transition")
    for i, c in enumerate(data["cases"]):
        lab = f"b1={c['b1']}, b2={c['b2']}, phi={c['phi']}, SNR={c['snr']}"
        ax.loglog(data["rho"], c["theory"], color=f"C{i}", label=lab)
        ax.loglog(data["rho"], c["frozen"], ls="--", color=f"C{i}", lw=0.8)
        ax.errorbar(data["pts"], c["mc"], yerr=3 * c["mc_se"], fmt="o", ms=3, color=f"C{i}")
    ax.set_xlabel("rho = rms(g) / eps")
    ax.set_ylabel("update RMS = sqrt(mean r^2)")
    ax.set_title(f"lines: exact theory; points: Monte-Carlo (t = {data['steps']}); dashed: r ~ m/eps")
    ax.legend(loc="lower right")
    return save(fig, out_dir, "fig_update_rms_vs_rho")


def main(argv=None) -> int:
    return computed_figure_main(__doc__, prepare, plot, argv, SIZES)


if __name__ == "__main__":
    sys.exit(main())
