"""Figure 2 of the seed report: the global gradient norm (before clipping) with the clip
threshold.

grad_norm vs step (log y), the threshold optim.grad_clip of run.json as a dashed line,
clipped steps as dots and grad-norm spikes (analysis.spikes.detect_spikes on log grad_norm)
as triangles. Loss-spike starts are drawn as thin vertical lines for comparison.

    python -m figures.fig_grad_norm RUN... --out DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from adamspike.spikes import SpikeParams, detect_spikes, loss_spikes
from figures import style
from figures.cli import run_figure_main


def prepare(run, *, window: int = 50, k: float = 6.0) -> dict:

    st = run.steps
    gn = st["grad_norm"].to_numpy(float)
    steps = st["step"].to_numpy()
    clip = (run.config.get("optim") or {}).get("grad_clip")
    return {"name": Path(run.path).name, "step": steps, "grad_norm": gn,
            "clip": float(clip) if clip else None,
            "clipped": st["clipped"].to_numpy(bool) if "clipped" in st else np.zeros(len(st), bool),
            "grad_spikes": detect_spikes(gn, steps, window=window, k=k, log=True),
            "loss_spikes": loss_spikes(st, SpikeParams(window, k), config=run.config)[0]}


def plot(data: dict, out_dir) -> list[Path]:
    style.apply()

    fig, ax = plt.subplots()
    ax.plot(data["step"], data["grad_norm"], color=style.COLORS["deep"], lw=0.8,
            label="grad norm (before clipping)")
    if data["clip"]:
        ax.axhline(data["clip"], ls="--", color="#555555", lw=1, label=f"clip {data['clip']:g}")
    c = data["clipped"]
    if c.any():
        ax.plot(data["step"][c], data["grad_norm"][c], ".", ms=2, color="#7f8c8d",
                label=f"clipped ({int(c.sum())} steps)")
    gs = data["grad_spikes"]
    fin = gs[np.isfinite(gs["peak"])]
    if len(fin):
        ax.plot(fin["peak_step"], fin["peak"], "^", color="#c0392b", ms=4,
                label=f"grad-norm spikes ({len(gs)})")
    for s in data["loss_spikes"]["start"]:
        ax.axvline(s, color=style.COLORS["spike"], lw=0.8, alpha=0.7)
    if np.nanmin(np.where(data["grad_norm"] > 0, data["grad_norm"], np.nan)) > 0:
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
