"""The replication table as a figure: each claim's measured effect with its 95% CI.

    python -m figures.fig_replication --table DIR_or_replication.csv --out DIR

Reads replication.csv (written by `adamspike sweep replicate`); --table may also be the
replication folder, or a study's sweep/ folder (then ../replication/replication.csv). One horizontal bar per
claim, grouped by the kind of effect (difference of means, relative difference, one-cell
mean), since their units differ; the marker is the point estimate, the line its 95%
percentile-bootstrap CI, the colour the verdict. Rows that were not run are listed with
"not run" and no bar. Writes replication.png / .pdf.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from figures import style

VERDICT_COLORS = {"supported": "#17a589", "not supported": "#c0392b", "inconclusive": "#7f8c8d"}


def _load(path: str) -> pd.DataFrame:
    p = Path(path)
    if p.is_dir():
        # a replication folder, or a study's sweep/ folder next to its replication/
        cands = [p / "replication.csv", p.parent / "replication" / "replication.csv"]
        p = next((c for c in cands if c.is_file()), cands[0])
    if not p.is_file():
        raise FileNotFoundError(f"{path}: replication.csv not found (nor ../replication/)")
    return pd.read_csv(p)


def prepare(table: pd.DataFrame) -> list[dict]:
    """-> panels [{title, rows: [{label, effect, lo, hi, verdict, ref}]}]."""
    need = {"id", "rule", "effect", "ci_low", "ci_high", "verdict", "metric"}
    if not need <= set(table.columns):
        raise ValueError(f"not a replication table (missing {sorted(need - set(table.columns))})")
    groups = {"difference of means (treatment - control)": [], "relative difference": [],
              "one-cell mean": []}
    for _, r in table.iterrows():
        rule = str(r["rule"])
        key = ("relative difference" if "/ control" in rule else
               "one-cell mean" if "of the mean" in rule else
               "difference of means (treatment - control)")
        ref = 0.0
        if "> " in rule and "of the mean" in rule:
            ref = float(rule.rsplit("> ", 1)[1])
        groups[key].append({"label": f"{r['id']} [{r['metric']}]", "effect": float(r["effect"]),
                            "lo": float(r["ci_low"]), "hi": float(r["ci_high"]),
                            "verdict": str(r["verdict"]), "ref": ref})
    return [{"title": k, "rows": v} for k, v in groups.items() if v]


def plot(panels: list[dict], out_dir: str | Path) -> list[Path]:
    style.apply()

    heights = [max(1.2, 0.32 * len(p["rows"]) + 0.6) for p in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7.5, sum(heights)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, p in zip(axes[:, 0], panels):
        ys = np.arange(len(p["rows"]))[::-1]
        for y, r in zip(ys, p["rows"]):
            col = VERDICT_COLORS.get(r["verdict"], "#7f8c8d")
            if math.isfinite(r["effect"]):
                ax.plot([r["lo"], r["hi"]], [y, y], color=col, lw=2)
                ax.plot([r["effect"]], [y], "o", color=col, ms=5)
            else:
                ax.text(0.01, y, "not run", transform=ax.get_yaxis_transform(), va="center",
                        fontsize=7, color=col)
        refs = sorted({r["ref"] for r in p["rows"]})
        for ref in refs:
            ax.axvline(ref, color="black", lw=0.8, ls=":")
        ax.set_yticks(ys, [r["label"] for r in p["rows"]], fontsize=7)
        ax.set_title(p["title"], fontsize=8)
        ax.set_xscale("symlog", linthresh=1.0)
    handles = [plt.Line2D([], [], color=c, marker="o", lw=2, label=v) for v, c in VERDICT_COLORS.items()]
    axes[0, 0].legend(handles=handles, loc="lower right", fontsize=7)
    fig.suptitle("Literature claims at toy scale: effect and 95% bootstrap CI", fontsize=9)
    return style.save(fig, out_dir, "replication")


def main(argv: list[str] | None = None) -> int:

    return style.table_figure_main("fig_replication", __doc__, _load, prepare, plot, argv,
                                   table_help="replication directory or replication.csv")


if __name__ == "__main__":
    raise SystemExit(main())
