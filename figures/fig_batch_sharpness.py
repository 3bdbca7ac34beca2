"""Where the minibatch sharpness stops falling: lambda_max(H) against the evaluation batch at
trained ladder rungs, and the full-data limit carried to the 70B.

    python -m figures.fig_batch_sharpness --batch-sharpness DIR --out DIR

Reads batch_sharpness.csv and summary.json (`adamspike simulate batch-sharpness`,
simulate/batch_sharpness.py). Left: per rung (colour: width, line style: depth) and seed,
lambda_max(H) of the mean loss over n tokens against n, with the fit lambda_inf + a / n
(thin dashed, to 4M tokens): where the noise term dies out (a non-positive reading, a
dominant negative eigenvalue, is left out). Right:
lambda_inf per rung against width (marker: depth), the law across rungs at 4 layers and at
80 (with an lr term: at lr 3e-3 and at LLaMA2's 1.5e-4), and the 70B's full-data reading with its leave-one-rung-out range, against the
sharpness at which the 70B's Pi_eps = (lr / eps) lambda reaches the eps band's threshold 38
(lr 1.5e-4, eps 1e-5). Writes batch_sharpness.png / .pdf.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from figures import style

DEPTH_STYLES = {2: ":", 4: "-", 8: "--"}
DEPTH_MARKERS = {2: "v", 4: "o", 8: "^"}


def _load(path: str) -> dict:
    p = Path(path)
    d = p if p.is_dir() else p.parent
    table, summary = d / "batch_sharpness.csv", d / "summary.json"
    for f in (table, summary):
        if not f.is_file():
            raise FileNotFoundError(f"{path}: {f.name} not found (adamspike simulate batch-sharpness)")
    return {"long": pd.read_csv(table), "summary": json.loads(summary.read_text())}


def prepare(data: dict) -> dict:
    long, s = data["long"], data["summary"]
    need = {"dim", "layers", "seed", "tokens", "lambda"}
    if long.empty or not need <= set(long.columns):
        raise ValueError(f"not a batch-sharpness table (needs columns {sorted(need)})")
    return {"long": long, "rungs": pd.DataFrame(s["rungs"]), "law": s.get("law"),
            "t70": s.get("llama2_70b")}


def plot(d: dict, out_dir: str | Path) -> list[Path]:
    style.apply()
    long, rungs = d["long"], d["rungs"]
    dims = sorted(long["dim"].unique())
    colors = {dim: plt.cm.viridis(i / max(len(dims) - 1, 1)) for i, dim in enumerate(dims)}
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    n_fit = np.geomspace(long["tokens"].min(), 4 * 1024 ** 2, 60)
    labelled = set()
    for (dim, layers, seed), g in long.groupby(["dim", "layers", "seed"]):
        g = g.sort_values("tokens")
        g = g[g["lambda"] > 0]      # a dominant negative eigenvalue has no place on a log axis
        col, ls = colors[dim], DEPTH_STYLES.get(int(layers), "-.")
        ax.plot(g["tokens"], g["lambda"], ls=ls, marker=".", color=col, lw=1,
                label=None if (dim, layers) in labelled else f"dim {dim}, {layers} layers")
        labelled.add((dim, layers))
        r = rungs[(rungs["dim"] == dim) & (rungs["layers"] == layers) & (rungs["seed"] == seed)]
        if len(r) and r["lambda_inf"].iloc[0] > 0:
            ax.plot(n_fit, r["lambda_inf"].iloc[0] + r["noise_a"].iloc[0] / n_fit, color=col,
                    lw=0.6, ls=(0, (3, 3)), alpha=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("evaluation batch (tokens)")
    ax.set_ylabel("lambda_max(H) at the trained parameters")
    ax.set_title("The minibatch sharpness falls, then stops (dashed: lambda_inf + a / n)",
                 fontsize=9)
    ax.legend(fontsize=6.5, ncol=2)
    per = rungs[rungs["lambda_inf"] > 0].groupby(["dim", "layers"], as_index=False)["lambda_inf"].median()
    for _, r in per.iterrows():
        ax2.plot(r["dim"], r["lambda_inf"], DEPTH_MARKERS.get(int(r["layers"]), "s"),
                 color=colors.get(r["dim"], "k"), ms=6)
    law, t70 = d["law"], d["t70"]
    if law:
        w = np.geomspace(min(dims), 8192, 50)
        for L, lr, ls in ((4, 3e-3, "-"), (80, 1.5e-4, "--")):
            lr_part = law["lr"] * np.log10(lr) if law.get("lr") is not None else 0.0
            ax2.plot(w, 10 ** (law["c0"] + law["dim"] * np.log10(w) + law["layers"] * np.log10(L)
                               + lr_part), color="#7f7f7f", ls=ls, lw=0.9,
                     label=f"law at {L} layers" + (f", lr {lr:g}" if law.get("lr") is not None
                                                   else ""))
    if t70:
        lo, hi = t70.get("lambda_inf_leave_one_out") or (t70["lambda_inf"],) * 2
        ax2.errorbar([8192], [t70["lambda_inf"]],
                     yerr=[[t70["lambda_inf"] - lo], [hi - t70["lambda_inf"]]], fmt="*",
                     color="#c0392b", ms=10, capsize=3,
                     label=f"LLaMA2-70B: Pi_eps {t70['pi_eps']:.3g} ({t70['over_threshold']:.2g}x)")
        ax2.axhline(t70["threshold"] * t70["eps"] / t70["lr"], color="black", ls=":", lw=0.8,
                    label="Pi_eps = 38 at the 70B's lr / eps")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("width (dim)")
    ax2.set_ylabel("full-data lambda_inf")
    ax2.set_title("The full-data limit across rungs, carried to the 70B", fontsize=9)
    ax2.legend(fontsize=6.5)
    fig.suptitle("Sharpness against the evaluation batch", fontsize=10)
    style.wrap_titles(fig)
    fig.tight_layout()
    return style.save(fig, out_dir, "batch_sharpness")


def main(argv: list[str] | None = None) -> int:
    return style.table_figure_main("fig_batch_sharpness", __doc__, _load, prepare, plot, argv,
                                   table_help="batch-sharpness directory",
                                   option="--batch-sharpness")


if __name__ == "__main__":
    raise SystemExit(main())
