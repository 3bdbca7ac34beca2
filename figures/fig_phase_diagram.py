"""Phase diagrams of a sweep: where Adam spikes over eps x b2, eps x lr and batch x lr
(the sweep table's dotted columns optim.eps, optim.b2, optim.lr, and the batch key).

    python -m figures.fig_phase_diagram --table SWEEP_DIR_or_runs.parquet --out DIR

Colour = fraction of runs (seeds, and any other swept axes pooled) with at least one spike
or a divergence; the number in each cell is that fraction, over the number of runs. Only
runs without mitigations enter (every mitigation.* column neutral, adamspike.mitigations). A panel is drawn for
each pair whose two axes vary in the table. Where the table has the curvature of a quadratic
problem (lam_max), the theory's eps* = lr lam (1-b1) / (2 (1+b1)) (Bai et al.;
theory.quadratic.critical_eps) is overlaid: a vertical line on eps x b2 (one per lr), the
line eps = eps*(lr) on eps x lr (axes are categorical, one column per swept value; the line is
placed by log interpolation between neighbouring values). Writes phase_diagram.png / .pdf.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from adamspike.mitigations import neutral_mask
from figures import style
from theory.quadratic import critical_eps

EPS, B2, LR, B1 = "optim.eps", "optim.b2", "optim.lr", "optim.b1"
BATCH = ("train.global_batch_size", "mlp.batch")   # the first present is the batch axis
LAM_MAX = "quadratic.lam_max"
PAIRS = ((EPS, B2), (EPS, LR), ("batch", LR))


def _load(path: str) -> pd.DataFrame:
    p = Path(path)
    if p.is_dir():
        p = p / "runs.parquet"
    if not p.is_file():
        raise FileNotFoundError(f"{path}: sweep table not found (runs.parquet or .csv)")
    return pd.read_csv(p) if p.suffix == ".csv" else pd.read_parquet(p)


def prepare(table: pd.DataFrame) -> dict:
    """-> {"panels": [{x, y, xs, ys, rate [len(ys), len(xs)], count, eps_star}], "problem"}."""
    t = table[neutral_mask(table)]
    if t.empty:
        raise ValueError("the table has no runs without mitigations")
    spiked = (t["num_spikes"] > 0) | t["diverged"].astype(bool)
    t = t.assign(spiked=spiked.astype(float))
    batch = next((b for b in BATCH if b in t), None)
    if batch is not None:
        t = t.assign(batch=t[batch])
    panels = []
    for x, y in PAIRS:
        if x not in t or y not in t or t[x].nunique() < 2 or t[y].nunique() < 2:
            continue
        g = t.groupby([y, x])["spiked"].agg(["mean", "count"])
        xs, ys = sorted(t[x].unique()), sorted(t[y].unique())
        rate = np.full((len(ys), len(xs)), np.nan)
        count = np.zeros((len(ys), len(xs)), dtype=int)
        for (yv, xv), row in g.iterrows():
            rate[ys.index(yv), xs.index(xv)] = row["mean"]
            count[ys.index(yv), xs.index(xv)] = int(row["count"])
        eps_star = None
        if x == EPS and LAM_MAX in t and t[LAM_MAX].nunique() == 1 and B1 in t \
                and t[B1].nunique() == 1:
            lam, b1 = float(t[LAM_MAX].iloc[0]), float(t[B1].iloc[0])
            lrs = sorted(t[LR].unique()) if y != LR else ys
            eps_star = {float(lr): critical_eps(float(lr), lam, b1) for lr in lrs}
        panels.append({"x": x, "y": y, "xs": xs, "ys": ys, "rate": rate, "count": count,
                       "eps_star": eps_star})
    if not panels:
        raise ValueError("no pair of swept axes among " + ", ".join(f"{a} x {b}" for a, b in PAIRS))
    return {"panels": panels, "problem": str(t["problem"].iloc[0]) if "problem" in t else "",
            "num_runs": int(len(t))}


def _position(values: list, v: float, log: bool) -> float:
    """Fractional index of v among the (sorted) category values, interpolated (log if asked)."""
    f = (lambda a: math.log10(a)) if log else (lambda a: a)
    pts = [f(a) for a in values]
    return float(np.interp(f(v), pts, np.arange(len(values)), left=-0.5, right=len(values) - 0.5))


def plot(data: dict, out_dir: str | Path) -> list[Path]:
    style.apply()

    panels = data["panels"]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False)
    for ax, p in zip(axes[0], panels):
        im = ax.imshow(p["rate"], origin="lower", cmap="magma_r", vmin=0, vmax=1, aspect="auto")
        for (i, j), r in np.ndenumerate(p["rate"]):
            if np.isfinite(r):
                ax.text(j, i, f"{r:.2f}\n/{p['count'][i, j]}", ha="center", va="center", fontsize=6,
                        color="white" if r > 0.6 else "black")
        ax.set_xticks(range(len(p["xs"])), [f"{v:.2g}" for v in p["xs"]], rotation=45)
        ax.set_yticks(range(len(p["ys"])), [f"{v:g}" for v in p["ys"]])
        ax.set_xlabel(p["x"])
        ax.set_ylabel(p["y"])
        ax.grid(False)
        if p["eps_star"]:
            if p["y"] == LR:
                xs_line = [_position(p["xs"], e, True) for e in p["eps_star"].values()]
                ys_line = [_position(p["ys"], lr, True) for lr in p["eps_star"]]
                ax.plot(xs_line, ys_line, color="#17a589", lw=2, label="eps* (theory)")
            else:
                for (lr, e), ls in zip(p["eps_star"].items(), ("--", "-.", ":", "-")):
                    ax.axvline(_position(p["xs"], e, True), color="#17a589", lw=2, ls=ls,
                               label=f"eps*, lr={lr:g}")
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.28), fontsize=6, ncol=3)
        ax.set_title(f"P(spike): {p['y']} vs {p['x']}")
        fig.colorbar(im, ax=ax, shrink=0.85, label="fraction of runs that spiked")
    fig.suptitle(f"{data['problem']} sweep ({data['num_runs']} runs)", fontsize=9)
    return style.save(fig, out_dir, "phase_diagram")


def main(argv: list[str] | None = None) -> int:

    return style.table_figure_main("fig_phase_diagram", __doc__, _load, prepare, plot, argv,
                                   table_help="sweep directory or runs.parquet / .csv")


if __name__ == "__main__":
    raise SystemExit(main())
