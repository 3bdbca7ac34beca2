"""Figure 1 of the seed report: the training loss with the detected spikes marked.

Loss vs step (log y when `adamspike analyze` ran the spike rule on log loss); each spike of
`adamspike analyze` (its spikes.csv: the project's spike rule, adamspike.spikes) is shaded
from its start for its duration (red when it never came back inside the band), its peak
marked and labelled with the height over the baseline.

    python -m figures.fig_loss_spikes RUN... --tables DIR --out DIR
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
    spikes = a.table("spikes")
    log = bool((a.summary.get("spike_rule") or {}).get("log"))
    # The trainer's spike guard rolls back and re-runs steps, so a guarded spike is not in the
    # steps table (readers keep the re-run row); it lives in the events.
    ev = run.events
    guard = (ev[ev["type"].isin(["spike", "nonfinite_loss", "rollback"])]
             if len(ev) and "type" in ev else ev.iloc[0:0])
    guard_events = [(str(r["type"]), int(r["step"])) for _, r in guard.iterrows()
                    if r.get("step") == r.get("step")]
    return {"name": Path(run.path).name, "step": st["step"].to_numpy(),
            "loss": st["loss"].to_numpy(float), "spikes": spikes, "log": log,
            "guard_events": guard_events}


def plot(data: dict, out_dir) -> list[Path]:
    style.apply()

    fig, ax = plt.subplots()
    # markers on short traces: a point isolated between gaps is still seen
    ax.plot(*break_gaps(data["step"], data["loss"]), color="#333333", lw=0.9, label="loss",
            marker="." if len(data["step"]) <= 300 else None, ms=3)
    if data["log"]:
        ax.set_yscale("log")
    sp = data["spikes"]
    for r in sp.itertuples(index=False):
        color = style.COLORS["spike"] if r.recovered else "#c0392b"
        ax.axvspan(r.start, r.start + max(r.duration, 1), color=color, alpha=0.35, lw=0)
        if np.isfinite(r.peak):
            ax.plot([r.peak_step], [r.peak], "v", color="#c0392b", ms=4)
            ax.annotate(f"+{100 * r.height:.0f}%", (r.peak_step, r.peak), fontsize=7,
                        xytext=(2, 3), textcoords="offset points")
    for i, (kind, step) in enumerate(data.get("guard_events", [])):
        ax.axvline(step, color="#7d3c98" if kind == "rollback" else "#c0392b", ls=":", lw=1,
                   label=f"guard: {kind}" if kind not in [k for k, _ in data["guard_events"][:i]] else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    guarded = sum(k != "rollback" for k, _ in data.get("guard_events", []))
    ax.set_title(f"{data['name']}: loss, {len(sp)} spike(s) detected"
                 + (f", {guarded} caught and rolled back by the guard" if guarded else ""))
    if data.get("guard_events"):
        ax.legend()
    return style.save(fig, out_dir, "loss_spikes")


def main(argv: list[str] | None = None) -> int:
    return run_figure_main(argv, __doc__, prepare, plot, tables=("steps",))


if __name__ == "__main__":
    sys.exit(main())
