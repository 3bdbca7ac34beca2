"""Measured vs theory: update_rms against the closed form, rms_t against its bound.

Left: measured update_rms per (step, tensor) against theory.eps_regime.update_rms at the
measured rho and the phi implied by the measured grad_mom_cos (analysis.fits, a uniform
subsample of at most 20,000 points; no free parameter), shallow vs deep colours, y = x line,
R^2 of log values in the title and the fitted effective-eps scale c. Right: per step the
largest rms_t over shallow and over deep tensors, with the dormant bound 1/sqrt(1-b2)
(theory.transients) and 1 (v tracks g^2).

    python -m figures.fig_theory_fit RUN... --out DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from analysis.fits import fit_update_rms, optim_params
from analysis.precursors import depth_group
from figures import style
from figures.cli import run_figure_main
from theory.transients import dormant_rms_t_bound

MAX_SCATTER = 20_000


def prepare(run) -> dict:

    op = optim_params(run.config)
    if op["b1"] is None or op["b2"] is None:
        raise ValueError(f"{run.path}: run.json config lacks optim.b1 / optim.b2")
    lay = run.layers
    if lay.empty:
        raise ValueError(f"{run.path}: no per-layer telemetry (layers table is empty)")
    fit = fit_update_rms(lay, op["b1"], op["b2"], max_rows=MAX_SCATTER)
    rt = lay[["step", "depth", "rms_t"]].copy()
    rt["group"] = depth_group(rt["depth"])
    mx = rt.groupby(["group", "step"])["rms_t"].max()
    return {"name": Path(run.path).name, "fit": fit, "bound": dormant_rms_t_bound(op["b2"]),
            "b2": op["b2"],
            "rms_t_max": {g: (s.index.get_level_values("step").to_numpy(), s.to_numpy())
                          for g, s in mx.groupby(level="group")}}


def plot(data: dict, out_dir) -> list[Path]:
    style.apply()

    fig, (a, b) = plt.subplots(1, 2, figsize=(9.5, 3.8))
    fit = data["fit"]
    rows = fit.rows
    for grp in ("deep", "shallow"):
        r = rows[rows["group"] == grp]
        a.loglog(r["predicted"], r["measured"], ".", ms=1.5, alpha=0.4, color=style.COLORS[grp],
                 label=grp, rasterized=True)
    lo = float(np.nanmin([rows["predicted"].min(), rows["measured"].min()]))
    hi = float(np.nanmax([rows["predicted"].max(), rows["measured"].max()]))
    a.plot([lo, hi], [lo, hi], color=style.COLORS["theory"], lw=1, label="y = x")
    a.set_xlabel("theory update_rms(rho, phi)")
    a.set_ylabel("measured update_rms")
    a.set_title(f"R^2(log) = {fit.r2_log:.3f}; fitted eps scale c = {fit.eps_scale:.3g} "
                f"(R^2 {fit.r2_log_fitted:.3f})", fontsize=8)
    a.legend(loc="upper left", markerscale=6)
    for grp, (s, v) in data["rms_t_max"].items():
        b.plot(s, v, color=style.COLORS[grp], lw=0.8, label=f"max rms_t, {grp}")
    b.axhline(data["bound"], color=style.COLORS["theory"], ls="--", lw=1,
              label=f"1/sqrt(1-b2) = {data['bound']:.2f}")
    b.axhline(1.0, color="#888888", ls=":", lw=1)
    b.set_yscale("log")
    b.set_xlabel("step")
    b.set_ylabel("rms_t")
    b.set_title(f"rms_t vs the dormant bound (b2 = {data['b2']:g})", fontsize=8)
    b.legend(loc="center right")
    fig.suptitle(f"{data['name']}: telemetry vs theory", fontsize=10)
    return style.save(fig, out_dir, "theory_fit")


def main(argv: list[str] | None = None) -> int:
    return run_figure_main(argv, __doc__, prepare, plot, tables=("layers",),
                           layer_columns=["rho", "update_rms", "grad_mom_cos", "rms_t"])


if __name__ == "__main__":
    sys.exit(main())
