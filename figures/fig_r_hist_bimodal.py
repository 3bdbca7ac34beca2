"""Adam's update r across coordinates turns bimodal as gradients persist (Monte-Carlo + theory).

Histograms of r = m_hat/(sqrt(v_hat)+eps) over coordinates (JAX/optax Monte-Carlo,
simulate.streams.sample_updates) for SNR = |mu|/sigma in {0, 0.3, 1, 3} (random-sign means,
b1 = 0.9, b2 = 0.999, eps = 1e-8, i.i.d. noise), with the theory's Sarle coefficient
(second order) and the MC's, and the 'v at its mean' Gaussian-mixture density as a line.
Bottom-right: BC vs SNR for phi = 0 and 0.5 (theory line, MC points), with 5/9.

    python -m figures.fig_r_hist_bimodal --out DIR [--set KEY=VALUE ...]
"""

from __future__ import annotations

import math
import sys

import matplotlib.pyplot as plt
import numpy as np

from figures.style import apply, computed_figure_main, save
from theory import adam_moments as A
from theory.bimodality import r_bimodality

B1, B2, EPS, T = 0.9, 0.999, 1e-8, 3000
SNRS = (0.0, 0.3, 1.0, 3.0)


# Monte-Carlo sizes (smaller ones: --set KEY=VALUE, figures.style)
SIZES = {"coords": 131072, "steps": T, "snr_points": 31}


def prepare(sizes: dict = SIZES, seed: int = 0) -> dict:
    # lazy: jax Monte-Carlo points (simulate.streams): a known figures -> simulate exception
    # (tests/foundation/test_layering.py KNOWN)
    from simulate.streams import sample_updates, simulate_streams

    n, steps = sizes["coords"], sizes["steps"]
    panels = []
    for s in SNRS:
        r = sample_updates(dict(b1=B1, b2=B2, eps=EPS, mu=s, sigma=1.0), steps, n, seed=seed)
        th = r_bimodality(B1, B2, EPS, s, t=steps)
        mv = A.m_moments(B1, 1.0, s, 0.0, steps, bias_correct=True)
        den = math.sqrt(s * s + 1.0) + EPS
        panels.append({"snr": s, "r": r, "bc_theory": th["bc"], "c": s / den,
                       "s": math.sqrt(mv["var"]) / den})
    grid = np.linspace(0.0, 3.0, sizes["snr_points"])
    curve = {phi: np.array([r_bimodality(B1, B2, EPS, g, phi, t=steps)["bc"] for g in grid]) for phi in (0.0, 0.5)}
    pts_snr = np.array([0.2, 0.5, 1.0, 2.0])
    cfgs = [dict(b1=B1, b2=B2, eps=EPS, mu=g, phi=phi) for phi in (0.0, 0.5) for g in pts_snr]
    mc = simulate_streams(cfgs, steps=steps, n_coords=max(4096, n // 8), mu_sign="random", seed=seed + 1)
    return {"panels": panels, "grid": grid, "curve": curve, "pts_snr": pts_snr,
            "mc_bc": mc["bc"].reshape(2, -1), "mc_bc_se": mc["bc_se"].reshape(2, -1), "steps": steps, "n": n}


def _bc(r):
    d = r - r.mean()
    v = np.mean(d ** 2)
    return (np.mean(d ** 3) ** 2 / v ** 3 + 1) / (np.mean(d ** 4) / v ** 2)


def plot(data: dict, out_dir):
    apply()

    fig, axes = plt.subplots(2, 3, figsize=(11, 6))
    flat = axes.ravel()
    for ax, p in zip(flat[:4], data["panels"]):
        ax.hist(p["r"], bins=120, range=(-1.6, 1.6), density=True, color="#17a589", alpha=0.6,
                label="Monte-Carlo")
        x = np.linspace(-1.6, 1.6, 400)
        dens = 0.5 * (np.exp(-0.5 * ((x - p["c"]) / p["s"]) ** 2) + np.exp(-0.5 * ((x + p["c"]) / p["s"]) ** 2))
        ax.plot(x, dens / (p["s"] * math.sqrt(2 * math.pi)), color="#222222", lw=1, label="v at its mean")
        ax.set_title(f"SNR {p['snr']:g}: BC theory {p['bc_theory']:.3f}, MC {_bc(p['r']):.3f}")
        ax.set_xlabel("r")
    flat[0].legend()
    ax = flat[4]
    for i, (phi, y) in enumerate(data["curve"].items()):
        ax.plot(data["grid"], y, color=f"C{i}", label=f"theory, phi = {phi:g}")
        ax.errorbar(data["pts_snr"], data["mc_bc"][i], yerr=3 * data["mc_bc_se"][i], fmt="o", ms=3,
                    color=f"C{i}", label=f"MC, phi = {phi:g}")
    ax.axhline(5 / 9, ls="--", color="#555555", lw=1)
    ax.set_xlabel("SNR = |mu|/sigma")
    ax.set_ylabel("bimodality coefficient of r")
    ax.legend()
    flat[5].axis("off")
    flat[5].text(0.0, 0.5, f"b1={B1}, b2={B2}, eps={EPS:g}\nt = {data['steps']} steps\n"
                 f"{data['n']:,} coordinates per histogram\nBC > 5/9: bimodal", va="center")
    return save(fig, out_dir, "fig_r_hist_bimodal")


def main(argv=None) -> int:
    return computed_figure_main(__doc__, prepare, plot, argv, SIZES)


if __name__ == "__main__":
    sys.exit(main())
