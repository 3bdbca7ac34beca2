"""Per-layer gradient RMS vs step against eps (Molybog et al.: shallow layers sink toward eps).

One line per depth (median grad_rms over the tensors at that depth), coloured from the
embedding (-1, red) to the last block / head (blue); the optimizer's eps as a horizontal
line. A layer near or below the line is in the frozen / transition eps regime
(rho = grad_rms / eps <= 10). Steps are thinned to at most 2000 points per line.

    python -m figures.fig_layer_grad_rms RUN... --out DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
from matplotlib import cm, colors
import numpy as np

from figures import style
from figures._common import run_figure_main

MAX_POINTS = 2000


def prepare(run, tables=None) -> dict:
    """tables: unused (the figure draws the run's layers table only)."""
    lay = run.layers
    if lay.empty:
        raise ValueError(f"{run.path}: no per-layer telemetry (layers table is empty)")
    med = lay.groupby(["depth", "step"], sort=True)["grad_rms"].median().reset_index()
    steps = np.unique(med["step"].to_numpy())
    keep = set(steps[:: max(1, len(steps) // MAX_POINTS)])
    med = med[med["step"].isin(keep)]
    eps = ((run.config.get("optim") or {}).get("eps")
           or (run.config.get("problem") or {}).get("eps"))  # toy problems keep their own
    return {"name": Path(run.path).name, "eps": float(eps) if eps else None,
            "by_depth": {int(d): (g["step"].to_numpy(), g["grad_rms"].to_numpy(float))
                         for d, g in med.groupby("depth")}}


def plot(data: dict, out_dir) -> list[Path]:
    style.apply()

    fig, ax = plt.subplots()
    depths = sorted(data["by_depth"])
    norm = colors.Normalize(vmin=min(depths), vmax=max(depths))
    cmap = matplotlib.colormaps["coolwarm_r"]
    for d in depths:
        s, v = data["by_depth"][d]
        lw = 1.4 if d in (depths[0], depths[-1]) else 0.6
        ax.plot(s, v, color=cmap(norm(d)), lw=lw,
                label={-1: "embedding"}.get(d) if d == -1 else None)
    if data["eps"]:
        ax.axhline(data["eps"], color=style.COLORS["eps"], ls="--", lw=1.2,
                   label=f"eps = {data['eps']:g}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("grad RMS (median per depth)")
    ax.set_title(f"{data['name']}: per-layer gradient RMS")
    sm = cm.ScalarMappable(norm=norm, cmap=cmap)
    fig.colorbar(sm, ax=ax, label="depth (-1 = embedding)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best")
    return style.save(fig, out_dir, "layer_grad_rms")


def main(argv: list[str] | None = None) -> int:
    return run_figure_main(argv, __doc__, prepare, plot, tables=("layers",),
                           layer_columns=["grad_rms"])


if __name__ == "__main__":
    sys.exit(main())
