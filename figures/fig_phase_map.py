"""The phase map: spike rate against Adam's stability number, per b2 and batch, in the 70B's
rho band.

    python -m figures.fig_phase_map --map DIR_or_phase_map.csv --out DIR

Reads phase_map.csv (analysis/phase_map.py, written by `adamspike phase-map`). Left: each
cell's spike rate per 1k steps (height >= the lowest class) with its exact 95 % Poisson
interval against the cell's median stability number S = lr lambda_max(P H) / 2 (the
horizontal bar spans the median to the 90th percentile of S; S = 1, dotted, is Adam's edge of
stability, Pi_eps = 38 at b1 0.9); colour b2, marker the batch multiple. A cell without
spikes sits at 0 with its upper limit drawn; a cell out of the 70B's band is faded. Right:
the rho each depth group reached per cell against the 70B's target (the band the map holds;
a group below 1e-3, collapsed, is a triangle at 1e-3). Writes phase_map.png / .pdf.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from figures import style

B2_COLORS = {0.95: "#1f77b4", 0.99: "#ff7f0e", 0.999: "#2ca02c"}
BATCH_MARKERS = {1: "o", 2: "s", 4: "D"}


def _load(path: str) -> dict:
    p = Path(path)
    table = p / "phase_map.csv" if p.is_dir() else p
    if not table.is_file():
        raise FileNotFoundError(f"{path}: phase_map.csv not found")
    meta_path = table.parent / "map.json"
    targets = json.loads(meta_path.read_text()).get("targets", {}) if meta_path.is_file() else {}
    return {"table": pd.read_csv(table), "targets": targets}


def prepare(data: dict) -> dict:
    t = data["table"]
    rate_cols = sorted((c for c in t.columns if c.startswith("rate_") and c.count("_") == 1),
                       key=lambda c: int(c.split("_")[1]))
    need = {"lr_mult", "b2", "batch_mult", "S_median", "S_p90"}
    if t.empty or not rate_cols or not need <= set(t.columns):
        raise ValueError("not a phase-map table (no cells, or missing rate / S columns)")
    rate = rate_cols[0]
    rho_cols = [c for c in t.columns if c.startswith("rho_")]
    return {"cells": t, "rate": rate, "height": int(rate.split("_")[1]), "rho_cols": rho_cols,
            "targets": data["targets"]}


def plot(d: dict, out_dir: str | Path) -> list[Path]:
    style.apply()
    t, rate = d["cells"], d["rate"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    for _, r in t.iterrows():
        col = B2_COLORS.get(round(float(r["b2"]), 3), "#7f7f7f")
        mk = BATCH_MARKERS.get(int(r["batch_mult"]), "^")
        x = max(float(r["S_median"]), 1e-4)
        y, lo, hi = float(r[rate]), float(r[f"{rate}_lo"]), float(r[f"{rate}_hi"])
        a = 1.0 if bool(r.get("in_band", True)) else 0.3   # out of the 70B's band: faded
        ax.plot([x, max(float(r["S_p90"]), x)], [y, y], color=col, lw=1, alpha=0.5 * a)
        ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], fmt=mk, color=col, ms=5, capsize=2,
                    mfc=col if y > 0 else "white", alpha=a)
    ax.axvline(1.0, color="black", ls=":", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("stability number S (median; bar to p90)")
    ax.set_ylabel(f"spikes >= {d['height']} % per 1k steps [95 % Poisson]")
    ax.set_title("Spike rate vs Adam's stability number", fontsize=9)
    handles = [plt.Line2D([], [], color=c, marker="o", ls="", label=f"b2 {b}") for b, c in B2_COLORS.items()
               if np.isclose(t["b2"], b).any()]
    handles += [plt.Line2D([], [], color="black", marker=m, ls="", mfc="white", label=f"batch x{b}")
                for b, m in BATCH_MARKERS.items() if (t["batch_mult"] == b).any()]
    if "in_band" in t and not t["in_band"].all():
        handles.append(plt.Line2D([], [], color="#7f7f7f", marker="o", ls="", alpha=0.3,
                                  label="out of the 70B's band"))
    ax.legend(handles=handles, fontsize=7, loc="upper left")
    groups = [c.removeprefix("rho_") for c in d["rho_cols"]]
    xs = np.arange(len(groups))
    floor = 1e-3    # a collapsed group (rho ~ 0) is drawn at the floor, as a down triangle
    for i, (_, r) in enumerate(t.iterrows()):
        for j, g in enumerate(groups):
            v = float(r[f"rho_{g}"])
            ax2.plot(xs[j] + (i - len(t) / 2) * 0.02, max(v, floor), "v" if v < floor else ".",
                     color="#7f7f7f", ms=3)
    tg = [d["targets"].get(g, np.nan) for g in groups]
    ax2.plot(xs, tg, "_", color="#c0392b", ms=18, mew=2, label="70B target (eps 1e-5)")
    ax2.axhline(1.0, color="black", ls=":", lw=0.8)
    ax2.set_yscale("log")
    ax2.set_xticks(xs, groups)
    ax2.set_ylabel("rho = rms(g) / eps (cell median)")
    ax2.set_title("Where each group sits (per cell)", fontsize=9)
    ax2.legend(fontsize=7)
    fig.suptitle("Phase map in the 70B's rho band", fontsize=10)
    fig.tight_layout()
    return style.save(fig, out_dir, "phase_map")


def main(argv: list[str] | None = None) -> int:
    return style.table_figure_main("fig_phase_map", __doc__, _load, prepare, plot, argv,
                                   table_help="phase-map directory or phase_map.csv",
                                   option="--map")


if __name__ == "__main__":
    raise SystemExit(main())
