"""Measured vs theory: update_rms against the closed form, rms_t against its bound.

Left: measured update_rms per (step, tensor) against theory.eps_regime.update_rms at the
measured rho and the phi implied by the measured grad_mom_cos (`adamspike analyze`'s fit:
update_rms_fit_rows.csv, a uniform subsample of at most 20,000 points, and summary.json; no
free parameter), shallow vs deep colours, y = x line, R^2 of log values in the title and the
fitted effective-eps scale c. Right: per step the
largest rms_t over shallow and over deep tensors, with the dormant bound 1/sqrt(1-b2)
(theory.transients; summary.json) and 1 (v tracks g^2).

    python -m figures.fig_theory_fit RUN... --tables DIR --out DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from adamspike.depth_groups import infer_num_layers, is_shallow
from figures import style
from figures._common import need_tables, run_figure_main


def prepare(run, tables=None) -> dict:
    """tables: the run's `adamspike analyze` folder (figures._common.RunTables)."""
    a = need_tables(tables, run.path)
    fit = a.summary.get("update_fit")
    if not fit:
        raise ValueError(f"{run.path}: no update_rms fit in summary.json "
                         f"({(a.summary.get('notes') or {}).get('update_fit', '')})")
    fit = dict(fit, rows=a.table("update_rms_fit_rows"))
    bound = float((a.summary.get("rms_t") or {})["bound"])   # 1/sqrt(1-b2), theory.transients
    lay = run.layers
    if lay.empty:
        raise ValueError(f"{run.path}: no per-layer telemetry (layers table is empty)")
    rt = lay[["step", "depth", "rms_t"]].copy()
    d = rt["depth"].to_numpy()   # shallow = embed + shallow groups (adamspike.depth_groups)
    rt["group"] = np.where(is_shallow(d, infer_num_layers(lay)), "shallow", "deep")
    mx = rt.groupby(["group", "step"])["rms_t"].max()
    return {"name": Path(run.path).name, "fit": fit, "bound": bound,
            "b2": 1.0 - 1.0 / bound ** 2,
            "rms_t_max": {g: (s.index.get_level_values("step").to_numpy(), s.to_numpy())
                          for g, s in mx.groupby(level="group")}}


def _num(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def plot(data: dict, out_dir) -> list[Path]:
    style.apply()

    fig, (a, b) = plt.subplots(1, 2, figsize=(9.5, 3.8))
    fit = data["fit"]
    rows = fit["rows"]
    for grp in ("deep", "shallow"):
        r = rows[rows["group"] == grp]
        a.loglog(r["predicted"], r["measured"], ".", ms=1.5, alpha=0.4, color=style.COLORS[grp],
                 label=grp, rasterized=True)
    lo = float(np.nanmin([rows["predicted"].min(), rows["measured"].min()]))
    hi = float(np.nanmax([rows["predicted"].max(), rows["measured"].max()]))
    a.plot([lo, hi], [lo, hi], color=style.COLORS["theory"], lw=1, label="y = x")
    a.set_xlabel("theory update_rms(rho, phi)")
    a.set_ylabel("measured update_rms")
    a.set_title(f"R^2(log) = {_num(fit['r2_log'])}; fitted eps scale c = "
                f"{_num(fit['eps_scale'])} (R^2 {_num(fit['r2_log_fitted'])})", fontsize=8)
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
                           layer_columns=["rms_t"])


if __name__ == "__main__":
    sys.exit(main())
