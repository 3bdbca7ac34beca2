"""Galton boards: independent vs correlated deflections (theory + direct simulation).

Left: the distribution of K (rights out of n = 20 rows) for independent deflections, the
exchangeable (beta-binomial) board at icc = 0.1, 1/3 (the exact U-shape threshold for p = 1/2)
and 0.5, and the Markov-persistent board (persist = 0.9); lines are the exact pmfs, markers a
direct numpy simulation.  Right: Sarle's bimodality coefficient of the exchangeable board vs
icc for several n, with the 5/9 line and the U-shape threshold icc = 1/3.

    python -m figures.fig_galton --out DIR [--set KEY=VALUE ...]
"""

from __future__ import annotations

import sys

import matplotlib.pyplot as plt
import numpy as np

from figures.style import apply, computed_figure_main, save
from theory import bimodality as B
from theory import galton as G

N = 20


def _simulate_exchangeable(rng, n, icc, draws):
    if icc == 0:
        q = np.full(draws, 0.5)
    else:
        a, b = G.betabinom_params(icc, 0.5)
        q = rng.beta(a, b, size=draws)
    return np.bincount((rng.random((draws, n)) < q[:, None]).sum(1), minlength=n + 1) / draws


def _simulate_markov(rng, n, persist, draws):
    x = rng.random(draws) < 0.5
    tot = x.astype(int)
    for _ in range(n - 1):
        x = np.where(rng.random(draws) < persist, x, rng.random(draws) < 0.5)
        tot += x
    return np.bincount(tot, minlength=n + 1) / draws


# Monte-Carlo sizes (smaller ones: --set KEY=VALUE, figures.style)
SIZES = {"draws": 200_000, "icc_points": 300}


def prepare(sizes: dict = SIZES, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    draws = sizes["draws"]
    boards = []
    for label, icc in (("independent", 0.0), ("icc = 0.1", 0.1), ("icc = 1/3 (threshold)", 1 / 3),
                       ("icc = 0.5", 0.5)):
        boards.append({"label": label, "pmf": G.betabinom_pmf(N, icc),
                       "sim": _simulate_exchangeable(rng, N, icc, draws)})
    boards.append({"label": "Markov, persist = 0.9", "pmf": G.markov_pmf(N, 0.9),
                   "sim": _simulate_markov(rng, N, 0.9, draws)})
    icc = np.linspace(0.0, 0.99, sizes["icc_points"])
    bc = {n: np.array([B.betabinom_bc(n, x) for x in icc]) for n in (5, 20, 100)}
    return {"n": N, "boards": boards, "icc": icc, "bc": bc,
            "u_threshold": B.betabinom_u_threshold(N), "draws": draws,
            "bc_crossing": {n: B.betabinom_bc_crossing(n) for n in bc}}


def plot(data: dict, out_dir):
    apply()

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    k = np.arange(data["n"] + 1)
    for i, b in enumerate(data["boards"]):
        col = f"C{i}"
        ax.plot(k, b["pmf"], "-", color=col, label=b["label"])
        ax.plot(k, b["sim"], "o", ms=3, color=col, mfc="none")
    ax.set_xlabel(f"K = rights out of n = {data['n']}")
    ax.set_ylabel("P(K)")
    ax.set_title(f"lines: exact pmf; circles: simulation ({data['draws']:,} boards)")
    ax.legend()
    for n, y in data["bc"].items():
        bx.plot(data["icc"], y, label=f"n = {n} (BC = 5/9 at icc = {data['bc_crossing'][n]:.3f})")
    bx.axhline(5 / 9, ls="--", color="#555555", lw=1, label="5/9")
    bx.axvline(data["u_threshold"], ls=":", color="#c0392b", lw=1, label="U-shaped for icc > 1/3")
    bx.set_xlabel("intra-class correlation of deflections")
    bx.set_ylabel("Sarle's bimodality coefficient")
    bx.set_title("exchangeable board: bimodality vs correlation")
    bx.legend()
    return save(fig, out_dir, "fig_galton")


def main(argv=None) -> int:
    return computed_figure_main(__doc__, prepare, plot, argv, SIZES)


if __name__ == "__main__":
    sys.exit(main())
