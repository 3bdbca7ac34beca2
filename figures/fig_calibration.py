"""Calibration of the spike-rate GLM on its held-out runs.

    python -m figures.fig_calibration --spike-rate DIR --out DIR

Reads what `adamspike spike-rate` writes: heldout.csv (one row per held-out run: predicted
P(>= 1 spike in its steps) of the GLM and of the constant-rate baseline, its spike count)
and calibration.csv (runs binned by the GLM's predicted P: mean predicted, observed
fraction with its Wilson 90 % interval), and model.json (the scores). Two panels:
  (a) reliability diagram: observed fraction vs mean predicted P per bin (marker area ~
      runs in the bin) with the diagonal, and each held-out run's (P, spiked) as ticks;
  (b) predicted vs observed spikes per held-out run (GLM and baseline).
Writes calibration.png / .pdf.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from figures import style


def load(spike_rate_dir: str | Path) -> dict:
    d = Path(spike_rate_dir)
    need = ["heldout.csv", "calibration.csv", "model.json"]
    missing = [n for n in need if not (d / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{d}: not a spike-rate directory (missing {', '.join(missing)})")
    return {"heldout": pd.read_csv(d / "heldout.csv"), "cal": pd.read_csv(d / "calibration.csv"),
            "model": json.loads((d / "model.json").read_text())}


def prepare(data: dict) -> dict:
    h = data["heldout"]
    if h.empty:
        raise ValueError("spike-rate: no held-out runs")
    val = data["model"].get("validation", {})
    return {**data, "val": val}


def plot(data: dict, out_dir: str | Path) -> list[Path]:
    import matplotlib.pyplot as plt   # figures only

    style.apply()
    h, cal, val = data["heldout"], data["cal"], data["val"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    ax = axes[0]
    ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--", label="perfect calibration")
    if len(cal):
        err = np.vstack([cal["observed_fraction"] - cal["observed_lo"],
                         cal["observed_hi"] - cal["observed_fraction"]])
        ax.errorbar(cal["mean_predicted"], cal["observed_fraction"], yerr=err, fmt="none",
                    ecolor="#2471a3", capsize=3)
        ax.scatter(cal["mean_predicted"], cal["observed_fraction"], s=20 + 8 * cal["n_runs"],
                   color="#2471a3", zorder=3, label="GLM, binned (area ~ runs)")
    y = (h["num_spikes"] > 0).astype(float)
    jitter = 0.02 * (np.arange(len(h)) % 5 - 2) / 2
    ax.scatter(h["p_pred"], y + jitter, marker="|", color="#c0392b", s=60, label="held-out runs")
    m, b = val.get("model", {}), val.get("baseline", {})
    title = "(a) held-out calibration"
    if m and b:
        title += (f"\nlog-loss {m['log_loss']:.3f} (const {b['log_loss']:.3f}), "
                  f"Brier {m['brier']:.3f} (const {b['brier']:.3f})")
    ax.set(xlim=(-0.03, 1.03), ylim=(-0.08, 1.08), xlabel="predicted P(>= 1 spike in the run)",
           ylabel="observed fraction with a spike", title=title)
    ax.legend(loc="upper left", fontsize=8)
    ax = axes[1]
    n = h["num_steps"].to_numpy(float)
    mu = h["rate_pred_per_1k"].to_numpy(float) * n / 1000
    mu0 = -np.log1p(-np.clip(h["p_baseline"].to_numpy(float), 0, 1 - 1e-12))
    k = h["num_spikes"].to_numpy(float)
    ax.scatter(mu, k, color="#2471a3", label="GLM")
    ax.scatter(mu0, k, color="0.5", marker="x", label="constant rate")
    top = max(1.0, float(np.nanmax([mu.max(), mu0.max(), k.max()]))) * 1.1
    ax.plot([0, top], [0, top], color="0.6", lw=1, ls="--")
    ax.set(xlabel="predicted spikes in the run", ylabel="observed spikes",
           title=f"(b) {len(h)} held-out runs: spikes predicted vs observed")
    ax.title.set_fontsize(8)
    ax.legend(fontsize=8)
    return style.save(fig, out_dir, "calibration")


def main(argv: list[str] | None = None) -> int:
    return style.table_figure_main("fig_calibration", __doc__, load, prepare, plot, argv,
                                   table_help="spike-rate directory (adamspike spike-rate)",
                                   option="--spike-rate")


if __name__ == "__main__":
    sys.exit(main())
