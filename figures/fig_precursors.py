"""Per-layer Adam metrics aligned on the spike start: shallow (embed + shallow groups, adamspike.depth_groups) vs deep.

For each loss spike and metric (rho, rms_t, update_rms, sat_frac, bimodality of r,
grad_mom_cos) the group median across tensors per step (`adamspike analyze`'s
precursor_trajectories.csv and precursor_leads.csv), divided by that spike's baseline (median over the `baseline` steps
before the window), then the median over spikes; thin lines are single spikes when there
are at most 10. x = step - spike start; the grey band is the pre-spike window in which lead
times are measured. Values > 1 before x = 0 mean the metric moved before the loss did.

    python -m figures.fig_precursors RUN... --tables DIR --out DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from figures import style
from figures._common import need_tables, run_figure_main

METRICS = ("rms_t", "update_rms", "sat_frac", "bimodality", "grad_mom_cos", "rho")


def prepare(run, tables=None) -> dict:
    """tables: the run's `adamspike analyze` folder (figures._common.RunTables); its
    precursor tables exist when the run has per-layer telemetry and spikes."""
    a = need_tables(tables, run.path)
    traj, leads = a.table("precursor_trajectories"), a.table("precursor_leads")
    tr = traj.merge(leads[["spike_id", "group", "metric", "baseline"]],
                    on=["spike_id", "group", "metric"])
    with np.errstate(all="ignore"):
        tr["rel_value"] = tr["value"] / tr["baseline"]
    return {"name": Path(run.path).name, "traj": tr,
            "window": int(a.summary.get("precursor_window") or 50),
            "num_spikes": len(a.table("spikes")), "summary": a.table("lead_summary", False)}


def plot(data: dict, out_dir) -> list[Path]:
    style.apply()

    fig, axes = plt.subplots(2, 3, figsize=(9.5, 5.2), sharex=True)
    tr = data["traj"]
    for ax, m in zip(axes.ravel(), METRICS):
        ax.axvspan(-data["window"], 0, color="#dddddd", alpha=0.5, lw=0)
        ax.axvline(0, color="#555555", lw=0.8)
        for grp in ("shallow", "deep"):
            d = tr[(tr["metric"] == m) & (tr["group"] == grp)]
            if d.empty:
                continue
            if data["num_spikes"] <= 10:
                for _, one in d.groupby("spike_id"):
                    ax.plot(one["rel_step"], one["rel_value"], color=style.COLORS[grp],
                            lw=0.4, alpha=0.4)
            med = d.groupby("rel_step")["rel_value"].median()
            ax.plot(med.index, med.to_numpy(), color=style.COLORS[grp], lw=1.4, label=grp)
        ax.set_title(m)
        ax.set_xlim(-2 * data["window"], data["window"])
    for ax in axes[-1]:
        ax.set_xlabel("step - spike start")
    for ax in axes[:, 0]:
        ax.set_ylabel("value / pre-spike baseline")
    axes[0, 0].legend(loc="upper left")
    fig.suptitle(f"{data['name']}: metrics around {data['num_spikes']} spike(s)", fontsize=10)
    return style.save(fig, out_dir, "precursors")


def main(argv: list[str] | None = None) -> int:
    return run_figure_main(argv, __doc__, prepare, plot, tables=("steps",))


if __name__ == "__main__":
    sys.exit(main())
