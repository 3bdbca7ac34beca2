"""Regime map: where each run and the LLaMA2-70B estimate sit in Adam's eps regimes.

Every run analysed by `adamspike analyze --out DIR` (its regime cards:
summary.json and regime_trajectory.csv per run).
Left, the (rho_shallow, rho_deep) plane: each run's trajectory over training (group rho =
the rms of the group's whole consumed gradient over eps, the regime card; shallow = the
first max(1, L // 10) blocks, adamspike.depth_groups; a model without deep blocks, such as
the 1-block MLP, uses its head as "deep"), a dot at its end. Right, the (rho, b2) plane:
each run's median shallow-group rho (bar: 10-90 % over its logged steps; the whole model's
rho for runs without a shallow group), and the deep group's a little to the right. Both
planes mark rho = 1 (below it Adam's update is eps-dominated: momentum SGD with step lr/eps)
and the frozen / scale-invariant bands (rho = 0.1, 10).

The 70B estimate: the per-depth profile of predictions_70b.json when it is a fitted one
(its `source` does not say "assumed"), as group rho at the profile's eps_ref; otherwise the
band the clip bound allows, rho_bar = min(gn, clip) / (sqrt(N) eps) for grad norms 0.1..1
(clip 1, N = 68,976,648,192), at eps 1e-5 and 1e-8, drawn on the diagonal (a global rho
says nothing about shallow vs deep) and at the seed's b2 = 0.95. Megatron log runs among
the inputs appear as their rho_bar band at their own eps.

    python -m figures.fig_regime_map --tables DIR --out DIR
                                     [--predictions-70b FILE] [--num-params N]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from adamspike.depth_groups import depth_group
from adamspike.llama import PRESETS, param_specs
from adamspike.llama import num_params as llama_num_params
from figures import style
from figures._common import RunTables

SEED_B2 = 0.95
GN_BAND = (0.1, 1.0)
MAX_POINTS = 400
RHO_FLOOR = 1e-4   # (rho, b2) plane: smaller values (a converged quadratic) drawn here


def _profile_70b(pred_path: str | Path | None) -> dict | None:
    """Group rho of a fitted 70B per-depth profile, or None (absent, or 'assumed')."""
    if not pred_path or not Path(pred_path).is_file():
        return None
    d = json.loads(Path(pred_path).read_text())
    prof = d.get("profile") or {}
    src = str(prof.get("source", ""))
    rho = prof.get("rho_by_depth")
    if not rho or "assumed" in src.lower():
        return None

    L = int(prof.get("num_layers", 80))
    cfg = PRESETS["llama2-70b"] if L == 80 else None
    numel = {}
    if cfg is not None:
        for s in param_specs(cfg):
            numel[s.depth] = numel.get(s.depth, 0) + s.numel
    out = {}
    for g in ("embed", "shallow", "deep", "head"):
        ds = [int(k) for k in rho if depth_group(int(k), L) == g]
        if not ds:
            continue
        w = np.array([numel.get(k, 1.0) for k in ds], float)
        r = np.array([float(rho[str(k)]) for k in ds])
        out[g] = float(np.sqrt(np.sum(w * r ** 2) / w.sum()))
    band = None
    lo, hi = prof.get("rho_lo_by_depth"), prof.get("rho_hi_by_depth")
    if lo and hi:
        band = {g: (min(float(lo[k]) for k in lo if depth_group(int(k), L) == g),
                    max(float(hi[k]) for k in hi if depth_group(int(k), L) == g))
                for g in out}
    return {"rho": out, "band": band, "eps_ref": prof.get("eps_ref"), "source": src,
            "b2": SEED_B2}


def analysed_runs(root: str | Path) -> list[RunTables]:
    """The run folders of an `adamspike analyze --out` folder (root itself when it is one)."""
    root = Path(root)
    if (root / "summary.json").is_file():
        return [RunTables(root)]
    found = [RunTables(s.parent) for s in sorted(root.glob("*/summary.json"))]
    if not found:
        raise ValueError(f"{root}: no analysed runs (no */summary.json; `adamspike analyze` "
                         "first)")
    return found


def rho_bar(grad_norm, clip: float, num_params: int, eps: float) -> np.ndarray:
    """min(gn, clip) / (sqrt(N) eps): the mean rho of a clipped gradient (the formula of
    the regime card's rho_bar, for the 70B band)."""
    return np.minimum(np.asarray(grad_norm, float), clip) / (math.sqrt(num_params) * eps)


def prepare(runs: list[RunTables], predictions_70b: str | Path | None = None,
            num_params: int | None = None) -> dict:
    """runs: analysed runs (`analysed_runs`) -> {"runs": [{name, b2, traj (shallow, deep arrays),
    shallow/deep summaries, log}], "p70": fitted profile or None, "bands_70b": {eps: (lo,
    hi)}}. num_params: N of the 70B band (default LLaMA2-70B's); a log's own N is the
    one `adamspike analyze --num-params` used)."""

    items = []
    for a in runs:
        card = a.summary.get("regime_card")
        if not card:
            continue
        name = a.summary.get("name") or a.path.name
        groups = pd.DataFrame(card.get("groups") or [])
        if card.get("kind") == "log":
            if groups.empty:
                continue
            g = groups[groups["is_run_eps"]] if groups["is_run_eps"].any() else groups.iloc[:1]
            r = g.iloc[0]
            items.append({"name": name, "b2": card.get("b2"), "log": True,
                          "rho": (r["rho_bar_q10"], r["rho_bar_median"], r["rho_bar_q90"])})
            continue
        tr = a.table("regime_trajectory")
        piv = tr.pivot_table(index="step", columns="group", values="rho")
        deep = "deep" if "deep" in piv else ("head" if "head" in piv else None)
        sh = "shallow" if "shallow" in piv else None
        item = {"name": name, "b2": card.get("b2"), "log": False, "deep_label": deep}
        if sh and deep:
            p = piv[[sh, deep]].dropna()
            if len(p) > MAX_POINTS:
                p = p.iloc[np.linspace(0, len(p) - 1, MAX_POINTS).astype(int)]
            item["traj"] = (p[sh].to_numpy(), p[deep].to_numpy())
        for key, g in (("shallow", sh or (tr["group"].iloc[0] if len(tr) else None)),
                       ("deep", deep)):
            if g is None:
                continue
            r = tr.loc[tr["group"] == g, "rho"].to_numpy(float)
            r = r[np.isfinite(r) & (r > 0)]
            if len(r):
                item[key] = (float(np.quantile(r, 0.1)), float(np.median(r)),
                             float(np.quantile(r, 0.9)))
        items.append(item)
    n = int(num_params) if num_params else llama_num_params(PRESETS["llama2-70b"])
    bands = {eps: tuple(float(x) for x in rho_bar(np.array(GN_BAND), 1.0, n, eps))
             for eps in (1e-5, 1e-8)}
    if not items:
        raise ValueError("no run with a regime card (telemetry or a log's grad norm)")
    return {"runs": items, "p70": _profile_70b(predictions_70b), "bands_70b": bands,
            "num_params": n}


def plot(data: dict, out_dir: str | Path) -> list[Path]:
    style.apply()

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11.0, 4.6))
    cmap = plt.get_cmap("tab10")
    b2s = []
    for i, it in enumerate(data["runs"]):
        c = cmap(i % 10)
        if it.get("traj") is not None:
            x, y = it["traj"]
            lab = it["name"] + ("" if it.get("deep_label") == "deep" else " (head as deep)")
            a1.plot(x, y, "-", color=c, alpha=0.6, lw=0.9, label=lab)
            a1.plot(x[-1:], y[-1:], "o", color=c, ms=4)
        b2 = it.get("b2")
        if b2 is None:
            continue
        y = -math.log10(1 - b2)
        b2s.append(b2)
        if it["log"]:
            lo, med, hi = it["rho"]
            a2.errorbar([med], [y], xerr=[[med - lo], [hi - med]], fmt="s", color=c,
                        label=f"{it['name']} (log, rho_bar)", capsize=2)
            continue
        for key, dy, mk in (("shallow", 0.0, "o"), ("deep", 0.04, "^")):
            if key in it:
                lo, med, hi = (max(v, RHO_FLOOR) for v in it[key])
                low = " (< 1e-4: at the edge)" if it[key][1] < RHO_FLOOR else ""
                a2.errorbar([med], [y + dy], xerr=[[med - lo], [hi - med]], fmt=mk, color=c,
                            capsize=2, label=f"{it['name']} {key}{low}")
    y95 = -math.log10(1 - SEED_B2)
    p70 = data["p70"]
    if p70 is not None:
        r = p70["rho"]
        if "shallow" in r and "deep" in r:
            a1.plot([r["shallow"]], [r["deep"]], "*", color="k", ms=12,
                    label=f"70B profile (eps {p70['eps_ref']:g})")
            if p70["band"]:
                (sl, sh), (dl, dh) = p70["band"]["shallow"], p70["band"]["deep"]
                a1.add_patch(plt.Rectangle((sl, dl), sh - sl, dh - dl, color="k", alpha=0.12))
        for g, mk in (("shallow", "*"), ("deep", "P")):
            if g in r:
                a2.plot([r[g]], [y95], mk, color="k", ms=10, label=f"70B {g} (profile)")
    for (eps, (lo, hi)), ls in zip(sorted(data["bands_70b"].items(), reverse=True),
                                   ("-", "--")):
        lab = f"70B rho_bar, eps {eps:g} (gn 0.1-1, clip 1)"
        a1.plot([lo, hi], [lo, hi], ls, color="k", lw=3.5, alpha=0.35, label=lab)
        a2.plot([lo, hi], [y95, y95], ls, color="k", lw=3.5, alpha=0.35, label=lab)
    for ax in (a1, a2):
        ax.set_xscale("log")
        ax.axvline(1.0, color=style.COLORS["eps"], lw=1.0)
        for v in (0.1, 10.0):
            ax.axvline(v, color=style.COLORS["eps"], lw=0.6, ls=":")
    a1.set_yscale("log")
    a1.axhline(1.0, color=style.COLORS["eps"], lw=1.0)
    for v in (0.1, 10.0):
        a1.axhline(v, color=style.COLORS["eps"], lw=0.6, ls=":")
    a1.set_xlabel("rho shallow group (rms g / eps)")
    a1.set_ylabel("rho deep group")
    a1.set_title("(rho_shallow, rho_deep): trajectories; rho = 1 purple")
    ticks = sorted({*b2s, SEED_B2})
    a2.set_yticks([-math.log10(1 - b) for b in ticks])
    a2.set_yticklabels([f"{b:g}" for b in ticks])
    a2.set_xlim(left=RHO_FLOOR / 2)
    a2.set_xlabel("rho (median, bar 10-90 %)")
    a2.set_ylabel("b2 (axis: -log10(1 - b2))")
    a2.set_title("(rho, b2): o shallow, ^ deep")
    a1.legend(fontsize=6, loc="best")
    a2.legend(fontsize=6, loc="best")
    return style.save(fig, out_dir, "regime_map")


def main(argv: list[str] | None = None) -> int:

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tables", required=True, metavar="DIR",
                    help="`adamspike analyze --out` folder (its runs' regime cards)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--predictions-70b", help="predictions_70b.json (its profile)")
    ap.add_argument("--num-params", type=int,
                    help="N of the 70B band (default LLaMA2-70B)")
    args = ap.parse_args(argv)
    try:
        files = plot(prepare(analysed_runs(args.tables), args.predictions_70b, args.num_params),
                     args.out)
    except (OSError, ValueError) as e:   # json.JSONDecodeError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
