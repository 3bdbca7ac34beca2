"""r-histogram-vs-step heatmaps for a shallow and a deep tensor (Molybog et al.'s diagnostic).

Each column is one logged histogram of r = m_hat / (sqrt(v_hat) + eps) over the tensor's
coordinates (fixed edges from run.json, out-of-range values in the end bins), normalised to
a fraction per bin; colour on a log scale. A healthy tensor is unimodal around 0; a tensor
whose gradients became time-correlated shows mass at +-1 (bimodal). Left: the shallowest
tensor with histograms (the embedding when logged); right: the deepest block's tensor of
the same kind when there is one, else the deepest. Loss-spike starts (`adamspike analyze`'s
spikes.csv, when its tables are given) are dashed lines.

    python -m figures.fig_r_heatmap RUN... --out DIR [--tables DIR]
                                    [--shallow NAME] [--deep NAME]
"""

from __future__ import annotations

import sys
from pathlib import Path

from matplotlib.colors import LogNorm
import matplotlib.pyplot as plt
import numpy as np

from figures import style
from figures._common import run_figure_main


def _pick(hists, shallow: str | None, deep: str | None) -> tuple[str, str]:
    names = hists.groupby("name", observed=True)["depth"].first()
    if shallow is None:
        shallow = str(names.idxmin())
    if deep is None:
        blocks = names[(names > names.min()) & (names < names.max())]
        pool = blocks if len(blocks) else names
        top = pool[pool == pool.max()]
        kind = hists.loc[hists["name"] == shallow, "kind"].astype(str).iloc[0]
        same = [n for n in top.index if hists.loc[hists["name"] == n, "kind"].astype(str).iloc[0]
                == kind]
        deep = str(same[0] if same else top.index[0])
    for n in (shallow, deep):
        if n not in names.index:
            raise ValueError(f"no histograms for tensor {n!r}")
    return shallow, deep


def prepare(run, tables=None, *, shallow: str | None = None, deep: str | None = None) -> dict:
    """tables: the run's `adamspike analyze` folder (RunTables) for the spike lines, or None."""
    h = run.hists
    if h.empty:
        raise ValueError(f"{run.path}: no r histograms (hists table is empty)")
    sname, dname = _pick(h, shallow, deep)
    panels = {}
    for label, n in (("shallow", sname), ("deep", dname)):
        g = h[h["name"] == n].sort_values("step")
        counts = np.stack(g["counts"].to_numpy()).astype(float)
        frac = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
        panels[label] = {"name": n, "depth": int(g["depth"].iloc[0]),
                         "step": g["step"].to_numpy(), "frac": frac}
    spikes = None if tables is None else tables.table("spikes")
    return {"name": Path(run.path).name, "edges": run.hist_edges, "panels": panels,
            "spike_starts": [] if spikes is None else list(spikes["start"])}


def plot(data: dict, out_dir) -> list[Path]:
    style.apply()

    fig, axes = plt.subplots(1, 2, figsize=(9.0, 3.6), sharey=True)
    e = data["edges"]
    im = None
    for ax, key in zip(axes, ("shallow", "deep")):
        p = data["panels"][key]
        s = p["step"]
        x = np.append(s, s[-1] + (s[-1] - s[-2] if len(s) > 1 else 1))
        z = np.where(p["frac"] > 0, p["frac"], np.nan).T
        im = ax.pcolormesh(x, e, z, norm=LogNorm(vmin=1e-5, vmax=1), cmap="magma",
                           shading="flat", rasterized=True)
        for s0 in data["spike_starts"]:
            ax.axvline(s0, color="#5dade2", ls="--", lw=0.8)
        ax.set_title(f"{key}: {p['name']} (depth {p['depth']})", fontsize=8)
        ax.set_xlabel("step")
        ax.grid(False)
    axes[0].set_ylabel("r = m_hat / (sqrt(v_hat) + eps)")
    fig.colorbar(im, ax=axes, label="fraction of coordinates")
    fig.suptitle(f"{data['name']}: distribution of r over steps", fontsize=10)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"r_heatmap.{ext}" for ext in style.FORMATS]
    for p in paths:  # colorbar over two axes: tight_layout (style.save) would warn
        fig.savefig(p, bbox_inches="tight")
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    return run_figure_main(argv, __doc__, prepare, plot, tables=("hists",),
                           extra_args=(("--shallow", "shallow"), ("--deep", "deep")))


if __name__ == "__main__":
    sys.exit(main())
