"""The phase map's tables and report, from the files simulate/phase_map.py wrote (reads files
only).

Per lane (seed of a cell): spikes by adamspike.spikes.detect_spikes on the loss with the
map's [spikes] rule (window, k, min_rel_jump); height = peak / running median - 1; a
non-finite loss is a spike of every class. Exposure: the lane's steps after the rule's
history (min_history) in thousands. Each cell also counts the spikes of the project's default rule (k = 6), beside the map's.
The cell's detection floor: the median over lanes of max(k 1.4826 MAD(loss - the running
median of the previous `window` steps) / median loss, min_rel_jump), the smallest relative
jump the rule can call a spike on that lane's noise. Per cell and height class h (>= 10 %,
>= 50 %, >= 2x):

    rate_h = spikes of height >= h / exposure   (per 1k steps; exact Poisson 95 % interval,
                                                 Garwood: chi2 quantiles)

At each onset t (spikes of the lowest class) and at its control (the same step of the next
seed of the cell, in order, whose loss has no spike start within `lead` steps of t; the
schedule, hence lr and the sharpness's phase, is matched), over the window [t - lead, t - 1]:

    S_before   max of the stability number S (Program.stability; S >= 1: past Adam's edge);
               per cell its median at onsets and at controls
    crossed    S_before >= 1
    wake       a wake-up of any depth group: rho_g >= 1 at a step whose `dormant_steps`
               preceding steps all had rho_g < 1 (mechanism B: a dormant group whose
               gradient regrows past its eps)

Per cell: the fraction crossed at onsets and at controls, the wake-up lift
P(wake | onset) / P(wake | control) with a paired bootstrap 95 % interval (2000 resamples of
the onset-control pairs), and the attribution: "A" (eps-band / adaptive edge of stability)
when at least half the onsets crossed and more onsets than controls did ("A, not specific"
when at least half crossed but the controls crossed as often: the cell lives at the edge);
"B" (dormancy and wake-up) when the lift's interval lies above 1; both, "neither", "no
spikes", or too few onsets (fewer than MIN_PAIRS pairs) to attribute.

In band: every depth group's cell-median rho within a factor 3 of its 70B target (a cell
whose calibration failed, e.g. where every pilot diverged, is reported but marked out).

Boundary: per (b2, batch_mult), over the in-band cells' lanes, a logistic fit of "the lane
spiked (>= the lowest class)" on log10 S_lane (the lane's 90th percentile of S after the first tenth of its steps) gives
S_50, the S at which half the lanes spike; "not reached" when no lane spiked (or every one).

The curvature checks (`agreement`: Spearman rank correlation, median ratio with IQR):
stability_check.csv's tracker S_tracker and online proxy S_secant against cold power
iteration S_power, and the cells' S_secant against their tracker S. The proxy's median
ratio is what scales a run's S_secant (fullscale.megatron_probe) to S.

    adamspike phase-map ... (study/cli.py) calls `write_report(DIR)`: DIR/phase_map.csv,
    DIR/onsets.csv, DIR/phase_map.md.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd
from scipy import optimize, stats

from adamspike.cells import CellStore
from adamspike.rundir import atomic_write_bytes
from adamspike.spikes import SpikeParams, detect_spikes
from adamspike.tables import md_table

DEFAULTS = {"window": 50, "k": 6.0, "min_rel_jump": 0.1, "heights": [0.1, 0.5, 1.0],
            "lead": 50, "dormant_steps": 20}
NUM_BOOT = 2000
MIN_PAIRS = 5          # onset-control pairs below which no cell is attributed
IN_BAND_DECADES = math.log10(3)   # a cell is in the 70B's band: every group within 3x


def poisson_interval(k: int, exposure: float, level: float = 0.95) -> tuple[float, float]:
    """Exact (Garwood) interval of a Poisson rate: k events over `exposure`."""
    a = 1 - level
    lo = stats.chi2.ppf(a / 2, 2 * k) / 2 if k > 0 else 0.0
    hi = stats.chi2.ppf(1 - a / 2, 2 * k + 2) / 2
    return lo / exposure, hi / exposure


def settings(meta: Mapping[str, Any]) -> dict:
    return {**DEFAULTS, **meta.get("spikes", {})}


def spike_params(st: Mapping[str, Any]) -> SpikeParams:
    """The map's spike rule from its settings (`settings`)."""
    return SpikeParams.from_table(st, name="[spikes] {}".format)


def wakeups(rho: np.ndarray, dormant_steps: int) -> np.ndarray:
    """(steps, groups) rho -> (steps,) bool: some group wakes up at this step (module
    docstring)."""
    below = np.nan_to_num(rho, nan=np.inf) < 1.0
    T = len(rho)
    out = np.zeros(T, bool)
    run = np.zeros(rho.shape[1], int)
    for t in range(T):
        out[t] = bool(np.any(~below[t] & (run >= dormant_steps)))
        run = np.where(below[t], run + 1, 0)
    return out


def _window_stats(S: np.ndarray, wake: np.ndarray, steps: np.ndarray, t: int, lead: int) -> dict:
    sel = (steps >= t - lead) & (steps <= t - 1)
    s = S[sel]
    s = s[np.isfinite(s)]
    s_before = float(s.max()) if s.size else math.nan
    return {"S_before": s_before, "crossed": bool(s_before >= 1.0) if s.size else False,
            "wake": bool(wake[sel].any())}


def cell_ref(c: dict, out: Path) -> dict:
    """A map.json cell's {kind, key} in the map's cell store (ValueError for a map written
    before the one cell store)."""
    ref = c.get("cell")
    if not isinstance(ref, dict) or "kind" not in ref or "key" not in ref:
        raise ValueError(f"{out}/map.json: cell {c.get('id')} names no stored cell (a map from "
                         "before the one cell store: `python -m study.legacy_cells "
                         f"{out}` adopts its cells)")
    return ref


def has_cells(out: str | Path) -> bool:
    """Whether a map folder holds any cell (in the store, or legacy files that
    `study.legacy_cells` adopts: reading those says so)."""
    cells = Path(out) / "cells"
    return (Path(out) / "map.json").is_file() and (
        any((cells / "phase_map_cell").glob("*.json")) or any(cells.glob("*.parquet")))


def read_cell(out: str | Path, c: dict) -> pd.DataFrame | None:
    """A map.json cell's table (verified), or None when it is not stored yet (a map still
    running); CorruptCell (a ValueError) names a damaged one."""
    out = Path(out)
    ref, store = cell_ref(c, out), CellStore(out / "cells")
    if not store.has(ref["kind"], ref["key"]):
        return None
    return store.read(ref["kind"], ref["key"])["rows"]


def analyze(out: str | Path) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """(cells table, onsets table, summary) of a map directory."""
    out = Path(out)
    meta = json.loads((out / "map.json").read_text())
    st = settings(meta)
    p = spike_params(st)
    heights, lead, dormant = [float(h) for h in st["heights"]], int(st["lead"]), int(st["dormant_steps"])
    cells, onsets, lanes, frames = [], [], [], []
    for c in meta["cells"]:
        df = read_cell(out, c)               # CorruptCell (a ValueError) names a damaged one
        if df is None:
            continue                         # not run yet: a map still running
        frames.append(df.filter(["seed", "S", "S_secant"]).assign(cell=c["id"]))
        rho_cols = [k for k in df.columns if k.startswith("rho_")]
        per = {}
        for seed, d in df.groupby("seed", sort=True):
            d = d.sort_values("step")
            steps = d["step"].to_numpy()
            sp = detect_spikes(d["loss"].to_numpy(), steps, p)
            strict = detect_spikes(d["loss"].to_numpy(), steps, p.replace(k=SpikeParams().k))
            S = d["S"].to_numpy()
            wake = wakeups(d[rho_cols].to_numpy(), dormant)
            tail = S[int(len(S) * 0.1):]
            tail = tail[np.isfinite(tail)]
            loss = pd.Series(d["loss"].to_numpy())
            med = loss.rolling(p.window, min_periods=p.history).median().shift(1)
            mad = (loss - med).abs().median()
            per[int(seed)] = {"steps": steps, "spikes": sp, "S": S, "wake": wake,
                              "num_strict": len(strict),
                              "floor": max(p.k * 1.4826 * mad / float(med.median()), p.min_rel_jump)
                              if np.isfinite(mad) and float(med.median()) > 0 else math.nan,
                              "S_lane": float(np.percentile(tail, 90)) if tail.size else math.nan,
                              "diverged": bool(~np.isfinite(d["loss"].to_numpy()).all()),
                              "rho": d[rho_cols].median().to_dict()}
        seeds = sorted(per)
        T = int(df["step"].max())
        exposure = len(seeds) * max(T - p.history, 1) / 1000.0
        row = {k: c[k] for k in ("id", "lr_mult", "b2", "batch_mult", "lr", "global_batch_size")}
        row.update({"num_seeds": len(seeds), "num_steps": T, "exposure_ksteps": exposure})
        for h in heights:
            k = int(sum(((per[s]["spikes"]["height"] >= h) | per[s]["spikes"]["nonfinite"]).sum()
                        for s in seeds))
            lo, hi = poisson_interval(k, exposure)
            tag = f"{round(h * 100)}"
            row.update({f"spikes_{tag}": k, f"rate_{tag}": k / exposure,
                        f"rate_{tag}_lo": lo, f"rate_{tag}_hi": hi})
        row["diverged_lanes"] = int(sum(per[s]["diverged"] for s in seeds))
        row["default_k_spikes"] = int(sum(per[s]["num_strict"] for s in seeds))
        row["detect_floor"] = float(np.nanmedian([per[s]["floor"] for s in seeds]))
        s_all = np.concatenate([per[s]["S"] for s in seeds])
        s_all = s_all[np.isfinite(s_all)]
        row["S_median"] = float(np.median(s_all)) if s_all.size else math.nan
        row["S_p90"] = float(np.percentile(s_all, 90)) if s_all.size else math.nan
        row["frac_S_above_1"] = float(np.mean(s_all >= 1.0)) if s_all.size else math.nan
        for col in rho_cols:
            row[col] = float(np.median([per[s]["rho"][col] for s in seeds]))
        off = [abs(math.log10(max(row[f"rho_{g}"], 1e-300) / t)) for g, t in meta["targets"].items()
               if f"rho_{g}" in row and t > 0]
        row["band_off_decades"] = max(off) if off else math.nan
        row["in_band"] = bool(off) and max(off) <= IN_BAND_DECADES
        # onsets and their time-matched controls
        pairs = []
        for i, s in enumerate(seeds):
            L = per[s]
            for _, spk in L["spikes"].iterrows():
                t = int(spk["start"])
                on = _window_stats(L["S"], L["wake"], L["steps"], t, lead)
                ctrl = None
                for s2 in seeds[i + 1:] + seeds[:i]:
                    starts = per[s2]["spikes"]["start"].to_numpy()
                    if not np.any(np.abs(starts - t) <= lead):
                        ctrl = s2
                        break
                rec = {"cell": c["id"], "lr_mult": c["lr_mult"], "b2": c["b2"],
                       "batch_mult": c["batch_mult"], "seed": s, "start": t,
                       "height": float(spk["height"]), "nonfinite": bool(spk["nonfinite"]),
                       **on, "control_seed": ctrl}
                if ctrl is not None:
                    cs = _window_stats(per[ctrl]["S"], per[ctrl]["wake"], per[ctrl]["steps"], t, lead)
                    rec.update({f"control_{k}": v for k, v in cs.items()})
                    pairs.append((on["wake"], cs["wake"], on["crossed"], cs["crossed"],
                                  on["S_before"], cs["S_before"]))
                onsets.append(rec)
        row["num_onsets"] = sum(len(per[s]["spikes"]) for s in seeds)
        row["num_pairs"] = len(pairs)
        row.update(attribution(pairs, row["num_onsets"]))
        cells.append(row)
        lanes += [{"b2": c["b2"], "batch_mult": c["batch_mult"], "lr_mult": c["lr_mult"],
                   "in_band": row["in_band"],
                   "S_lane": per[s]["S_lane"], "spiked": bool(len(per[s]["spikes"]))}
                  for s in seeds]
    table = pd.DataFrame(cells)
    summary = {"boundary": boundary(pd.DataFrame(lanes)), "meta": meta, "settings": st,
               "curvature_checks": tracker_check(out, frames)}
    return table, pd.DataFrame(onsets), summary


def attribution(pairs: list[tuple], num_onsets: int, seed: int = 0) -> dict:
    """Crossed fractions, wake-up lift with its paired bootstrap interval, the verdict."""
    if not num_onsets:
        return {"frac_crossed_onset": math.nan, "frac_crossed_control": math.nan,
                "wake_onset": math.nan, "wake_control": math.nan, "wake_lift": math.nan,
                "wake_lift_lo": math.nan, "wake_lift_hi": math.nan, "mechanism": "no spikes"}
    a = np.array(pairs, float).reshape(-1, 6)
    if not len(a):
        return {"frac_crossed_onset": math.nan, "frac_crossed_control": math.nan,
                "wake_onset": math.nan, "wake_control": math.nan, "wake_lift": math.nan,
                "wake_lift_lo": math.nan, "wake_lift_hi": math.nan,
                "mechanism": "undecided: no control step free of spikes"}

    def lift(x):
        c = x[:, 1].mean()
        return x[:, 0].mean() / c if c > 0 else (math.inf if x[:, 0].mean() > 0 else math.nan)

    rng = np.random.default_rng(seed)
    boot = np.array([lift(a[rng.integers(0, len(a), len(a))]) for _ in range(NUM_BOOT)])
    boot = boot[~np.isnan(boot)]
    # inverted_cdf: no interpolation between an infinite lift (control rate 0) and the rest
    lo, hi = (np.percentile(boot, [2.5, 97.5], method="inverted_cdf") if boot.size
              else (math.nan, math.nan))
    fc_on, fc_ctl = a[:, 2].mean(), a[:, 3].mean()
    is_a = fc_on >= 0.5 and fc_on > fc_ctl
    is_b = bool(lo > 1)
    mech = "A+B" if is_a and is_b else "A" if is_a else "B" if is_b else "neither"
    if mech == "neither" and fc_on >= 0.5:   # at the edge before the onsets, and elsewhere too
        mech = "A, not specific (the controls were at the edge as often)"
    if len(a) < MIN_PAIRS:
        mech = f"too few onsets to attribute ({len(a)} < {MIN_PAIRS})"
    return {"frac_crossed_onset": fc_on, "frac_crossed_control": fc_ctl,
            "S_before_onset": float(np.nanmedian(a[:, 4])), "S_before_control": float(np.nanmedian(a[:, 5])),
            "wake_onset": a[:, 0].mean(), "wake_control": a[:, 1].mean(), "wake_lift": lift(a),
            "wake_lift_lo": float(lo), "wake_lift_hi": float(hi), "mechanism": mech}


def boundary(lanes: pd.DataFrame) -> list[dict]:
    """Per (b2, batch_mult): S_50 of a logistic fit of spiked on log10 S_lane."""
    rows = []
    if lanes.empty:
        return rows
    for (b2, bm), d in lanes.groupby(["b2", "batch_mult"], sort=True):
        d = d[np.isfinite(d["S_lane"]) & (d["S_lane"] > 0) & d["in_band"]]
        y = d["spiked"].to_numpy(float)
        x = np.log10(d["S_lane"].to_numpy(float))
        base = {"b2": float(b2), "batch_mult": float(bm), "num_lanes": int(len(d)),
                "num_spiked": int(y.sum()),
                "S_lane_range": [float(10 ** x.min()), float(10 ** x.max())] if len(x) else None}
        if not len(d) or y.min() == y.max():
            rows.append({**base, "S_50": None,
                         "note": "not reached: " + ("no lane spiked" if not y.sum() else "every lane spiked")})
            continue

        def nll(w):
            z = w[0] + w[1] * x
            return float(np.sum(np.logaddexp(0, z) - y * z) + 1e-3 * w[1] ** 2)

        w = optimize.minimize(nll, [0.0, 1.0], method="Nelder-Mead").x
        x50 = -w[0] / w[1] if w[1] > 0 else math.nan
        inside = bool(np.isfinite(x50) and x.min() - 1 <= x50 <= x.max() + 1)
        rows.append({**base, "slope": float(w[1]), "S_50": float(10 ** x50) if inside else None,
                     "note": "" if inside else ("no increase of spiking with S" if not w[1] > 0
                                                else "S_50 beyond a decade outside the measured S")})
    return rows


def agreement(x: np.ndarray, ref: np.ndarray) -> dict:
    """How a reading x follows a reference: points (both finite), Spearman rank correlation,
    and the ratio x / ref over the points where both are positive (median, IQR)."""
    x, ref = np.asarray(x, float), np.asarray(ref, float)
    ok = np.isfinite(x) & np.isfinite(ref)
    x, ref = x[ok], ref[ok]
    if x.size < 3:
        return {"num_points": int(x.size)}
    ratio = x[(x > 0) & (ref > 0)] / ref[(x > 0) & (ref > 0)]
    return {"num_points": int(x.size), "spearman": float(stats.spearmanr(x, ref).statistic),
            "median_ratio": float(np.median(ratio)) if ratio.size else math.nan,
            "ratio_iqr": [float(q) for q in np.percentile(ratio, [25, 75])] if ratio.size else None}


def tracker_check(out: Path, cells: list[pd.DataFrame]) -> dict:
    """The curvature readings against their references: stability_check.csv's tracker and
    online proxy against cold power iteration ("tracker", "secant"), and over every cell's
    evaluation rows the proxy against the tracker ("secant_cells"), and per lane the medians
    over its run ("secant_lanes": how a run's regime card reads it)."""
    res = {}
    path = out / "stability_check.csv"
    if path.exists():
        d = pd.read_csv(path)
        res["tracker"] = agreement(d["S_tracker"], d["S_power"])
        if "S_secant" in d:
            res["secant"] = agreement(d["S_secant"], d["S_power"])
    pairs = [df[["cell", "seed", "S_secant", "S"]].dropna() for df in cells if "S_secant" in df]
    if pairs:
        both = pd.concat(pairs)
        res["secant_cells"] = agreement(both["S_secant"], both["S"])
        lanes = both.groupby(["cell", "seed"])[["S_secant", "S"]].median()
        res["secant_lanes"] = agreement(lanes["S_secant"], lanes["S"])
    return res


def _fmt_rate(r: Mapping[str, Any], tag: str) -> str:
    return f"{r[f'rate_{tag}']:.2f} [{r[f'rate_{tag}_lo']:.2f}, {r[f'rate_{tag}_hi']:.2f}]"


def report_md(table: pd.DataFrame, onsets: pd.DataFrame, summary: dict) -> str:
    meta, st = summary["meta"], summary["settings"]
    tags = [f"{round(float(h) * 100)}" for h in st["heights"]]
    lines = [f"# {meta.get('title') or 'Phase map'}", "",
             f"Config `{meta['config_file']}`"
             f"{' (sizes: ' + ', '.join(meta['sets']) + ')' if meta.get('sets') else ''}: "
             f"{len(meta['seeds'])} paired seeds per cell, grid lr_mult {meta['grid']['lr_mult']}, "
             f"b2 {meta['grid']['b2']}, batch_mult {meta['grid']['batch_mult']}; stability number "
             f"S = lr lambda_max(P H) / 2 every {meta['curvature_every']} steps (S = 1: Adam's "
             "edge of stability; Pi_eps = 38 S at b1 0.9). Spike rule: "
             f"{spike_params(st).describe()}. "
             f"Targets (70B rho per group at eps 1e-5): "
             + ", ".join(f"{g} {v:.3g}" for g, v in meta["targets"].items()) + ".", ""]
    if table.empty:
        return "\n".join(lines + ["No cell has run yet."]) + "\n"
    band = table[table["in_band"]]
    total = int(band[f"spikes_{tags[0]}"].sum())
    lines += [f"**In the 70B's band: {total} spike(s) of height >= {tags[0]} % in "
              f"{int(band['num_seeds'].sum())} lanes x {int(table['num_steps'].max())} steps** "
              f"({len(band)} of {len(table)} cells in band"
              + (f"; S above 1 in {100 * band['frac_S_above_1'].mean():.0f} % of their "
                 "evaluations" if band['frac_S_above_1'].notna().any() else "")
              + f"); out of band: {int(table[f'spikes_{tags[0]}'].sum()) - total} spike(s).",
              ""]
    cols = ["lr_mult", "b2", "batch_mult", "in_band", "S_median", "S_p90", "frac_S_above_1",
            "detect_floor"]
    cols += [c for c in table.columns if c.startswith("rho_")]
    show = table[cols].copy()
    for t in tags:
        show[f"rate >= {t} % /1k [95 %]"] = [_fmt_rate(r, t) for r in table.to_dict("records")]
    show["diverged"] = table["diverged_lanes"]
    show[f"spikes at k {SpikeParams().k:g}"] = table["default_k_spikes"]
    show["mechanism"] = table["mechanism"]
    lines += ["## Cells", "", md_table(show), ""]
    att = table[table["num_onsets"] > 0]
    if len(att):
        a = att[["lr_mult", "b2", "batch_mult", "num_onsets", "num_pairs", "frac_crossed_onset",
                 "frac_crossed_control", "S_before_onset", "S_before_control", "wake_onset", "wake_control", "wake_lift",
                 "wake_lift_lo", "wake_lift_hi", "mechanism"]]
        lines += ["## Attribution (onsets against time-matched controls)", "",
                  md_table(a), ""]
    lines += ["## Boundary", ""]
    for b in summary["boundary"]:
        where = f"b2 {b['b2']:g}, batch x{b['batch_mult']:g}"
        if b["S_50"] is None:
            lines.append(f"- {where}: {b['note']} ({b['num_spiked']} of {b['num_lanes']} lanes "
                         f"spiked; S_lane {b['S_lane_range']})")
        else:
            lines.append(f"- {where}: S_50 = {b['S_50']:.3g} ({b['num_spiked']} of "
                         f"{b['num_lanes']} lanes spiked)")
    checks = summary["curvature_checks"]
    what = {"tracker": "the tracker (3 warm-started products) against cold power iteration "
                       "(30 products), the same operator and parameters",
            "secant": "the online proxy S_secant (consecutive gradients and updates, no "
                      "Hessian product) against the same cold power iteration",
            "secant_cells": "the online proxy against the tracker over every cell's "
                            "evaluations",
            "secant_lanes": "the online proxy against the tracker, each lane's median over "
                            "its run"}
    if checks:
        lines += ["", "## Curvature readings against power iteration", ""]
        for key, text in what.items():
            c = checks.get(key)
            if c:
                iqr = c.get("ratio_iqr")
                lines.append(f"- {text}: {c['num_points']} evaluations, Spearman "
                             f"{c.get('spearman', math.nan):.2f}, median ratio "
                             f"{c.get('median_ratio', math.nan):.3g}"
                             + (f" (IQR {iqr[0]:.3g}-{iqr[1]:.3g})" if iqr else "") + ".")
    return "\n".join(lines) + "\n"


def write_report(out: str | Path) -> dict:
    out = Path(out)
    table, onsets, summary = analyze(out)
    atomic_write_bytes(out / "phase_map.csv", table.to_csv(index=False).encode())
    atomic_write_bytes(out / "onsets.csv", onsets.to_csv(index=False).encode())
    atomic_write_bytes(out / "phase_map.md", report_md(table, onsets, summary).encode())
    slim = {k: v for k, v in summary.items() if k != "meta"}
    atomic_write_bytes(out / "phase_map.json", json.dumps(slim, indent=2, default=repr).encode())
    return summary
