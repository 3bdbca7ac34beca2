"""Second-moment lag: rms_t and |r| after the gradient scale steps up (theory + Monte-Carlo).

Left: rms_t = sqrt(E[g^2 / v_hat]) for k = 1..K loud steps after a quiet stretch, scale
factor kappa = 10, b1 = 0.9, b2 in {0.95, 0.99, 0.999} (exact theory lines; JAX Monte-Carlo
points with 3-SE bars); dotted: the dormant bound 1/sqrt(1-b2).  Right: a constant gradient
after dormancy, |r_k| = (1-b1^k)/sqrt(1-b2^k), with its peaks (6.57 at k = 12, 2.13 at 13,
1.10 at 20), and the expected rms r of the noisy step-up from the left panel.

    python -m figures.fig_rms_t_transient --out DIR [--set KEY=VALUE ...]
"""

from __future__ import annotations

import sys

import matplotlib.pyplot as plt
import numpy as np

from figures.style import apply, computed_figure_main, save
from theory import transients as T

B1, KAPPA = 0.9, 10.0
B2S = (0.95, 0.99, 0.999)


# Monte-Carlo sizes (smaller ones: --set KEY=VALUE, figures.style)
SIZES = {"quiet": 4000, "steps": 60, "coords": 32768}


def prepare(sizes: dict = SIZES, seed: int = 0) -> dict:
    # lazy: jax Monte-Carlo points (simulate.streams): a known figures -> simulate exception
    # (tests/foundation/test_layering.py KNOWN)
    from simulate.streams import simulate_streams

    quiet, steps = sizes["quiet"], sizes["steps"]
    total = quiet + steps
    sig = np.ones((len(B2S), total))
    sig[:, quiet:] = KAPPA
    mc = simulate_streams([dict(b1=B1, b2=b, eps=1e-8) for b in B2S], steps=total,
                          n_coords=sizes["coords"], record="all", sigma_t=sig, seed=seed)
    rows = []
    for i, b2 in enumerate(B2S):
        th = T.step_up(B1, b2, KAPPA, steps, eps=1e-8, quiet=quiet)
        kk = np.arange(1, 201)
        pk, pv = T.constant_after_dormancy_peak(B1, b2)
        rows.append({"b2": b2, "k": th["k"], "rms_t": th["rms_t"], "r_rms": th["r_rms"],
                     "bound": th["bound"], "mc": mc["rms_t"][i, quiet:], "mc_se": mc["rms_t_se"][i, quiet:],
                     "const_k": kk, "const": T.constant_after_dormancy(B1, b2, kk), "peak": (pk, pv)})
    return {"rows": rows, "quiet": quiet, "steps": steps}


def plot(data: dict, out_dir):
    apply()

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for i, r in enumerate(data["rows"]):
        c = f"C{i}"
        ax.plot(r["k"], r["rms_t"], color=c, label=f"b2 = {r['b2']} (peak {r['rms_t'].max():.2f})")
        ax.errorbar(r["k"], r["mc"], yerr=3 * r["mc_se"], fmt="o", ms=2, color=c)
        ax.axhline(r["bound"], ls=":", color=c, lw=1)
        bx.plot(r["const_k"], r["const"], color=c,
                label=f"b2 = {r['b2']}: peak {r['peak'][1]:.2f} at k = {r['peak'][0]}")
        bx.plot(r["k"], r["r_rms"], ls="--", color=c, lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel(f"steps k after the scale steps up x{KAPPA:g} (after {data['quiet']} quiet steps)")
    ax.set_ylabel("rms_t")
    ax.set_title("lines: exact theory; points: MC; dotted: 1/sqrt(1-b2)")
    ax.legend()
    bx.axhline(1.0, color="#555555", lw=0.8)
    bx.set_xscale("log")
    bx.set_xlabel("k")
    bx.set_ylabel("|r_k|")
    bx.set_title("solid: constant g after dormancy; dashed: rms r (left case)")
    bx.legend()
    return save(fig, out_dir, "fig_rms_t_transient")


def main(argv=None) -> int:
    return computed_figure_main(__doc__, prepare, plot, argv, SIZES)


if __name__ == "__main__":
    sys.exit(main())
