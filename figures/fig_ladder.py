"""The width/depth ladder, its power-law fit and the LLaMA2-70B extrapolation.

    python -m figures.fig_ladder --ladder LADDER_DIR --out DIR

Reads the files `adamspike simulate ladder` writes (simulate.ladder.write_outputs):
responses.csv (one row per rung x seed: log10 group RMS of the raw gradient, late-training
median), fit.json (per-group coefficients, R^2, the 70B extrapolation), band.csv (raw group
RMS along width at 80 layers and 1024 x 4096 tokens per step with the bootstrap prediction
interval), depth_rms.csv (per-depth RMS per rung). Four panels:
  (a) group RMS vs width at the ladder's base batch, one marker per layer count, the fit's
      line at that layer count;
  (b) group RMS vs tokens per step where the ladder varies them, with the fit;
  (c) the extrapolation band to width 8192 at 80 layers, 4.2M tokens per step (raw, before
      the clip), with eps = 1e-5 and 1e-8 as horizontal lines;
  (d) the 70B profile Adam would consume at eps 1e-5 (after the clip) per depth, with its
      interval, against the bound on the mean rho, clip / (sqrt(N) eps).
With the sharpness ladder (fit.json `sharpness`; responses.csv `sharpness`, `stability`) two
more panels:
  (e) lambda_max(H) vs width at the base batch, one marker per layer count, with the fit,
      and Adam's stability number S per rung (right axis: how far below its edge the
      ladder trains);
  (f) the 70B's Pi_eps = (lr / eps) lambda_max(H) at the peak lr and at step 1000 of the
      warmup, in both readings of the batch extrapolation (the fitted fall carried to 4M
      tokens; stopped at the ladder's largest batch), with intervals, against 38.
Writes ladder.png / .pdf.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from figures import style

GROUP_COLORS = {"embed": "#7d3c98", "shallow": "#c0392b", "deep": "#2471a3", "head": "#17a589"}
MARKERS = {2: "o", 4: "s", 8: "^", 1: "v", 16: "D"}


def load(ladder_dir: str | Path) -> dict:
    d = Path(ladder_dir)
    need = ["fit.json", "responses.csv", "band.csv"]
    missing = [n for n in need if not (d / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{d}: not a finished ladder directory (missing {', '.join(missing)})")
    return {"fit": json.loads((d / "fit.json").read_text()),
            "responses": pd.read_csv(d / "responses.csv"), "band": pd.read_csv(d / "band.csv")}


def _line(coef, dim, layers, tokens):
    return 10 ** (coef[0] + coef[1] * np.log10(dim) + coef[2] * np.log10(layers)
                  + coef[3] * np.log10(tokens))


def prepare(data: dict) -> dict:
    resp, fit = data["responses"], data["fit"]
    groups = [g for g in GROUP_COLORS if g in resp and g in fit["fit"]["groups"]]
    if resp.empty or not groups:
        raise ValueError("ladder: no fitted rows")
    base_tokens = resp["tokens_per_step"].mode().iloc[0]
    return {"resp": resp, "groups": groups, "coef": {g: fit["fit"]["groups"][g]["coef"] for g in groups},
            "r2": {g: fit["fit"]["groups"][g]["r2_log"] for g in groups},
            "base_tokens": int(base_tokens), "band": data["band"], "ext": fit["llama2_70b"],
            "profile": pd.DataFrame(fit["profile_by_depth"]),
            "sharp": fit["fit"].get("sharpness") if "sharpness" in resp else None}


def plot(p: dict, out_dir: str | Path) -> list[Path]:

    style.apply()
    sharp = p["sharp"] is not None and "sharpness" in p["ext"]
    fig, axes = plt.subplots(3 if sharp else 2, 2, figsize=(10.5, 11.4 if sharp else 7.6))
    resp, groups = p["resp"], p["groups"]

    ax = axes[0, 0]
    base = resp[resp["tokens_per_step"] == p["base_tokens"]]
    dims = np.geomspace(base["dim"].min(), base["dim"].max(), 20)
    for g in groups:
        for L, sub in base.groupby("num_layers"):
            m = sub.groupby("dim")[g].agg(["mean", "min", "max"])
            ax.errorbar(m.index, 10 ** m["mean"], yerr=[10 ** m["mean"] - 10 ** m["min"],
                        10 ** m["max"] - 10 ** m["mean"]], fmt=MARKERS.get(int(L), "x"),
                        color=GROUP_COLORS[g], ms=4, lw=0.8)
            ax.plot(dims, _line(p["coef"][g], dims, L, p["base_tokens"]), color=GROUP_COLORS[g],
                    lw=0.8, alpha=0.6)
        ax.plot([], [], color=GROUP_COLORS[g], label=f"{g} (R$^2_{{log}}$ {p['r2'][g]:.2f})")
    for L in sorted(base["num_layers"].unique()):
        ax.plot([], [], MARKERS.get(int(L), "x"), color="gray", label=f"{L} layers")
    ax.set(xscale="log", yscale="log", xlabel="width (dim)", ylabel="gradient RMS (raw)",
           title=f"(a) ladder at {p['base_tokens']} tokens/step: data (seed range) and fit")
    ax.legend(ncol=2)

    ax = axes[0, 1]
    var = resp.groupby(["dim", "num_layers"])["tokens_per_step"].nunique()
    var = var[var > 1]
    if len(var):
        d0, L0 = var.index[0]
        sub = resp[(resp["dim"] == d0) & (resp["num_layers"] == L0)]
        toks = np.geomspace(sub["tokens_per_step"].min(), sub["tokens_per_step"].max(), 20)
        for g in groups:
            m = sub.groupby("tokens_per_step")[g].mean()
            ax.plot(m.index, 10 ** m.values, "o", color=GROUP_COLORS[g], ms=4,
                    label=f"{g}: exponent {p['coef'][g][3]:+.2f}")
            ax.plot(toks, _line(p["coef"][g], d0, L0, toks), color=GROUP_COLORS[g], lw=0.8)
        ax.set_title(f"(b) tokens per step at dim {d0}, {L0} layers")
        ax.legend()
    else:
        ax.set_title("(b) the ladder does not vary tokens per step")
    ax.set(xscale="log", yscale="log", xlabel="tokens per step", ylabel="gradient RMS (raw)")

    ax = axes[1, 0]
    band, ext = p["band"], p["ext"]
    for g in groups:
        b = band[band["group"] == g]
        ax.fill_between(b["dim"], b["rms_lo"], b["rms_hi"], color=GROUP_COLORS[g], alpha=0.2)
        ax.plot(b["dim"], b["rms"], color=GROUP_COLORS[g], label=g)
        ax.errorbar([ext["dim"]], [ext["raw_rms"][g]], fmt="*", color=GROUP_COLORS[g], ms=9)
    for eps, ls in ((1e-5, "--"), (1e-8, ":")):
        ax.axhline(eps, color="k", ls=ls, lw=0.8, label=f"eps {eps:g}")
    ax.axvspan(resp["dim"].min(), resp["dim"].max(), color="gray", alpha=0.12, label="ladder widths")
    ax.set(xscale="log", yscale="log", xlabel="width (dim)", ylabel="raw gradient RMS",
           title=f"(c) extrapolation at {ext['num_layers']} layers, {ext['tokens_per_step']:,} "
                 f"tokens/step (before clip)")
    ax.legend(ncol=2)

    ax = axes[1, 1]
    prof = p["profile"]
    for g in groups:
        q = prof[prof["group"] == g]
        ax.errorbar(q["depth"], q["rho"], yerr=[q["rho"] - q["rho_lo"], q["rho_hi"] - q["rho"]],
                    fmt="o", ms=2.5, lw=0.6, color=GROUP_COLORS[g], label=g)
    ax.axhline(ext["mean_rho_bound"], color="k", ls="--", lw=0.8,
               label=f"bound on mean rho {ext['mean_rho_bound']:.3f}")
    ax.axhline(1.0, color="gray", ls=":", lw=0.8, label="rho = 1")
    ax.set(yscale="log", xlabel="depth (-1 embedding, 80 head)", ylabel="rho = rms(g)/eps",
           title=f"(d) 70B at eps {ext['eps']:g}: raw norm {ext['raw_grad_norm']:.3g}, clip "
                 f"{ext['clip']:g}, mean rho {ext['mean_rho']:.3f}")
    ax.legend()
    if sharp:
        _sharpness_panels(axes[2], p)
    return style.save(fig, out_dir, "ladder")


def _sharpness_panels(axes, p: dict) -> None:
    resp, sf, s70 = p["resp"], p["sharp"], p["ext"]["sharpness"]
    ax = axes[0]
    base = resp[resp["tokens_per_step"] == p["base_tokens"]]
    dims = np.geomspace(base["dim"].min(), base["dim"].max(), 20)
    ax2 = ax.twinx()
    for L, sub in base.groupby("num_layers"):
        m = sub.groupby("dim")["sharpness"].agg(["median", "min", "max"])
        ax.errorbar(m.index, m["median"], yerr=[m["median"] - m["min"], m["max"] - m["median"]],
                    fmt=MARKERS.get(int(L), "x"), color="k", ms=4, lw=0.8, label=f"{L} layers")
        ax.plot(dims, _line(sf["coef"], dims, L, p["base_tokens"]), color="k", lw=0.8, alpha=0.5)
        st = sub.groupby("dim")["stability"].median()
        ax2.plot(st.index, st.values, MARKERS.get(int(L), "x"), color="#d35400", ms=4, mfc="none")
    ax2.set(yscale="log", ylabel="S = lr lambda_max(PH)/2 (open, orange)")
    ax.set(xscale="log", yscale="log", xlabel="width (dim)", ylabel="lambda_max(H) (late median)",
           title=f"(e) sharpness at {p['base_tokens']} tokens/step; exponents d "
                 f"{sf['coef'][1]:+.2f}, L {sf['coef'][2]:+.2f}, B {sf['coef'][3]:+.2f}")
    ax.legend(loc="upper left")
    ax = axes[1]
    readings = [("batch fall to 4M tokens", s70["pi"])]
    if "at_ladder_tokens" in s70:
        fl = s70["at_ladder_tokens"]
        readings.append((f"stopped at {fl['tokens_per_step']:,.0f} tokens", fl["pi"]))
    for i, (name, pi) in enumerate(readings):
        for j, (phase, label) in enumerate((("warmup_step_1000", "warmup step 1000"), ("peak", "peak lr"))):
            v = pi[phase]
            x = i * 3 + j
            ax.errorbar([x], [v["pi_eps"]], yerr=[[v["pi_eps"] - v["pi_eps_lo"]],
                                                  [v["pi_eps_hi"] - v["pi_eps"]]],
                        fmt="o", color=["#2471a3", "#c0392b"][j], ms=6, capsize=3,
                        label=label if i == 0 else None)
        ax.text(i * 3 + 0.5, 1.2 * max(v["pi_eps_hi"] for v in pi.values()), name, ha="center",
                fontsize=8)
    ax.axhline(s70["threshold"], color="k", ls="--", lw=0.8, label=f"threshold {s70['threshold']:.0f}")
    ax.set(yscale="log", xticks=[], xlim=(-1, 3 * len(readings) - 1),
           ylabel="Pi_eps = (lr / eps) lambda_max(H)",
           title=f"(f) LLaMA2-70B at eps {s70['eps']:g}: two batch readings")
    ax.legend(loc="lower right")


def main(argv: list[str] | None = None) -> int:
    return style.table_figure_main("fig_ladder", __doc__, load, prepare, plot, argv,
                                   table_help="ladder directory (adamspike simulate ladder)",
                                   option="--ladder")


if __name__ == "__main__":
    sys.exit(main())
