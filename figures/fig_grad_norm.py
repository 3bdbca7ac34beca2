"""Figure 2 of the seed report: the global gradient norm (before clipping) with the clip
threshold.

grad_norm vs step (log y), the threshold optim.grad_clip of run.json as a dashed line,
clipped steps as dots and grad-norm spikes (the spike rule on log grad_norm, `adamspike
analyze`'s grad_norm_spikes.csv) as triangles. Loss-spike starts (its spikes.csv) are drawn
as thin vertical lines for comparison.

    python -m figures.fig_grad_norm RUN... --tables DIR --out DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from figures import style
from figures._common import break_gaps, need_tables, run_figure_main


def prepare(run, tables=None) -> dict:
    """tables: the run's `adamspike analyze` folder (figures._common.RunTables)."""
    a = need_tables(tables, run.path)
    st = run.steps
    gn = st["grad_norm"].to_numpy(float)
    if not np.isfinite(gn).any():
        raise ValueError(f"{run.path}: no measured grad norm (none printed, or only "
                         "placeholders read as missing)")
    steps = st["step"].to_numpy()
    clip = (run.config.get("optim") or {}).get("grad_clip")
    return {"name": Path(run.path).name, "step": steps, "grad_norm": gn,
            "clip": float(clip) if clip else None,
            "clipped": st["clipped"].to_numpy(bool) if "clipped" in st else np.zeros(len(st), bool),
            "grad_spikes": a.table("grad_norm_spikes"), "loss_spikes": a.table("spikes")}


def plot(data: dict, out_dir) -> list[Path]:
    style.apply()

    fig, ax = plt.subplots()
    ax.plot(*break_gaps(data["step"], data["grad_norm"]), color=style.COLORS["deep"], lw=0.8,
            label="grad norm (before clipping)")
    if data["clip"]:
        ax.axhline(data["clip"], ls="--", color="#555555", lw=1, label=f"clip {data['clip']:g}")
    c = data["clipped"]
    if c.any():
        ax.plot(data["step"][c], data["grad_norm"][c], ".", ms=2, color="#7f8c8d",
                label=f"clipped ({int(c.sum())} steps)")
    gs = data["grad_spikes"]
    fin = gs[np.isfinite(gs["peak"].to_numpy(float))]
    if len(fin):
        ax.plot(fin["peak_step"], fin["peak"], "^", color="#c0392b", ms=4,
                label=f"grad-norm spikes ({len(gs)})")
    for s in data["loss_spikes"]["start"]:
        ax.axvline(s, color=style.COLORS["spike"], lw=0.8, alpha=0.7)
    gn = data["grad_norm"]
    if (np.isfinite(gn) & (gn > 0)).any():
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("global grad norm")
    ax.set_title(f"{data['name']}: gradient norm (vertical lines: loss-spike starts)")
    ax.legend(loc="best")
    return style.save(fig, out_dir, "grad_norm")


def main(argv: list[str] | None = None) -> int:
    return run_figure_main(argv, __doc__, prepare, plot, tables=("steps",))


if __name__ == "__main__":
    sys.exit(main())
