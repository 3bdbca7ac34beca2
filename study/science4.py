"""`adamspike science4`: the 70B answer under the written plan (docs/plan/science4_v*.toml).

    adamspike science4 --out DIR [--compute] [--cells STORE] [--map MAP_DIR]
                       [--executor local|ray] [--jobs N] [--address HOST:PORT]

What it writes (DIR): science4.md (the report, with the plan's sha256), science4.json, and
the tables behind it: sharpness_rungseeds.csv (every rung-seed with its QC),
sharpness_versions.csv (the law and the 70B's lambda / S / label under each reading),
sharpness_hits.csv (the plan's new rungs: predicted, measured, hit or miss),
null_cells.csv (in-band spikes per cell and class against their noise nulls),
public_record.csv (expected visible spikes of public runs under the shipped model).

Inputs: the shipped batch-sharpness summary (v4, power iteration) and the Science 4 cells
shipped with the package (adamspike/data/llama2_70b/science4: the Lanczos rung-seeds and
the in-band map lanes), or with `--compute` the plan's rung cells computed into `--cells`
(one cell store; local worker processes or Ray; resumable) and `--map` a phase-map folder
(`adamspike phase-map --config configs/phase_map_science4.toml`). This module only wires
the packages together: the computation is simulate.sharpness, the reading
analysis.sharpness and analysis.spike_null.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import os
import json
import math
import shutil
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from adamspike import package_data
from adamspike import spike_rate as SR
from adamspike.cells import CellStore, run_cells
from adamspike.config import ConfigError, cli_main, read_toml
from adamspike.depth_groups import depth_group
from adamspike.llama import num_params, param_specs, preset
from adamspike.plan import load_plan, plan_history
from adamspike.rundir import atomic_write_bytes, check_out, claim_out
from adamspike.spikes import detect_spikes
from adamspike.tables import md_table
from adamspike.train_config import RunConfig
from analysis import one_s as OS
from analysis import phase_map as PMA
from analysis import rate_threshold as RT
from analysis import sharpness as SH
from analysis.claims import load as load_claims
from analysis.phase_map import poisson_interval
from analysis.spike_null import cells_table, class_params
from analysis.stats import holm, sign_test
from simulate.predict import load_profile, mechanism_inputs
from simulate.sharpness import cell, plan_cells

SHIPPED = package_data.DATA / "llama2_70b" / "science4"
LANES_FILE = "map_lanes.parquet"
CELLS_FILE = "map_cells.csv"
RATE_ROWS_FILE = "rate_rows.parquet"
LAW_FILE = "law.json"    # the sharpness law under the plan's QC, read by `predict`
ONE_S_FILE = "one_s.csv"  # the One-S cells' checkpoints, labelled with their map cells
RECORD_FILE = "public_record.json"   # the shipped rate model's record on public runs, read by `predict`
RECORD = Path(__file__).resolve().parent.parent / "configs" / "public_record.toml"


def _fmt(x: float, d: int = 3) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{x:.{d}g}"


# ------------------------------------------------------------------------ sharpness
def sharpness_versions(plan: Mapping[str, Any], summary_v4: Mapping[str, Any],
                       cells: Sequence[tuple[dict, dict]], rho_min: float) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """The rung-seed table and, per reading, the law and the 70B's lambda / S / label:
    v4 as shipped (every seed averaged in), v4 without the failed seed (one seed where
    it was), v4 under the plan's QC (>= min_seeds passing), and v5 = v4's passing seeds
    with the plan's Lanczos rung-seeds (reruns replacing failed first passes)."""
    ms = int(plan["sharpness"]["qc"]["min_seeds"])
    v4 = SH.shipped_rows(summary_v4, plan)
    new = SH.cell_rows(cells, plan)
    readings = [("v4 as shipped (no QC)", v4.assign(**{"pass": True}), 1),
                ("v4, failed seed dropped", v4, 1),
                (f"v4 under plan QC (>= {ms} passing seeds)", v4, ms)]
    if len(new):
        readings.append((f"v5: v4 + Lanczos rungs under plan QC", pd.concat([v4, new],
                         ignore_index=True), ms))
    rows, laws = [], {}
    for name, tab, m in readings:
        rungs = SH.rung_table(tab, m)
        law = SH.fit_law(rungs)
        laws[name] = law
        r = SH.reading_70b(law, plan, rho_min)
        rows.append({"reading": name, "rungs_in_law": int(rungs["enters"].sum()),
                     "max_layers": int(rungs.loc[rungs["enters"], "layers"].max())
                     if rungs["enters"].any() else 0,
                     **({k: r[k] for k in ("depth_exponent", "depth_se", "lr_exponent", "lr_se",
                                           "lambda_inf", "lambda_lo", "lambda_hi", "pi_eps",
                                           "S_after", "S_lo", "S_hi", "label")} if r else
                        {"label": "no law (too few rungs)"})})
    allrows = pd.concat([v4, new], ignore_index=True) if len(new) else v4
    # the plan's new rungs are judged on their own Lanczos measurements only
    hits = SH.hits(plan, SH.rung_table(new, ms) if len(new) else
                   SH.rung_table(v4.iloc[:0], ms))
    return allrows, pd.DataFrame(rows), {"hits": hits, "laws": laws}


def sharpness_md(rows: pd.DataFrame, versions: pd.DataFrame, hits: pd.DataFrame,
                 plan: Mapping[str, Any]) -> list[str]:
    q = plan["sharpness"]["qc"]
    failed = rows[~rows["pass"]]
    L = ["## Sharpness under the convergence QC", "",
         f"QC (plan [sharpness.qc]): Lanczos residual < {q['max_residual']:g} and theta_1 > 0 at "
         f"every evaluation size, a > 0 and lambda_inf > 0 in the 1/n fit; the shipped "
         f"power-iteration rung-seeds: last-product change <= {q['shipped_max_change']:g}. A rung "
         f"enters the law with >= {q['min_seeds']} passing seeds; a failed rung-seed is rerun "
         f"once ({q['rerun_iters']} Lanczos steps, another start), never averaged in.", ""]
    if len(failed):
        key = ["source", "dim", "layers", "lr", "eps", "steps", "seed"]
        reruns = rows[rows["rerun"]].set_index(key)["pass"]
        failed = failed.assign(rerun_result=[
            ("rerun itself" if r["rerun"] else
             ("rerun passes" if reruns.loc[k].all() else "rerun fails")
             if (k := tuple(r[c] for c in key)) in reruns.index else "not rerun")
            for _, r in failed.iterrows()])
        L += ["Rung-seeds that failed (a Lanczos first pass is replaced by its rerun; a "
              "power-iteration seed is measured again by Lanczos below):", "",
              md_table(failed, key + ["lambda_inf", "why", "rerun_result"]), ""]
        lz = rows[rows["source"] == "Lanczos"]
        for r in failed[failed["source"] != "Lanczos"].itertuples():
            m = lz[(lz["dim"] == r.dim) & (lz["layers"] == r.layers) & np.isclose(lz["lr"], r.lr)
                   & (lz["steps"] == r.steps) & (lz["seed"] == r.seed)]
            if len(m):    # the same rung-seed measured again by Lanczos (the plan's rerun)
                x = m.iloc[-1]
                L += [f"Measured again by Lanczos, ({r.dim}, {r.layers}) seed {r.seed}: "
                      f"lambda_inf {x['lambda_inf']:.3g}, largest residual {x['max_residual']:.2g}, "
                      f"smallest Ritz value {x['check']:.3g}: "
                      + ("passes" if x["pass"] else f"fails ({x['why']})")
                      + (f" (the Hessian has a negative eigenvalue of magnitude {abs(x['check']):.3g}: "
                         "power iteration follows the largest magnitude, whatever its sign; "
                         "Lanczos separates the ends of the spectrum)."
                         if x["check"] < 0 else "."), ""]
    else:
        L += ["No rung-seed failed.", ""]
    L += ["The law log10 lambda_inf = c0 + c_d log10 dim + c_L log10 layers + c_lr log10 lr and "
          "the 70B's reading (dim 8192, 80 layers, lr 1.5e-4, eps 1e-5; S after the warmup; "
          "90 % regression prediction intervals) under each reading:", "",
          md_table(versions, [c for c in ("reading", "rungs_in_law", "max_layers", "depth_exponent",
                                           "depth_se", "lr_exponent", "lr_se", "lambda_inf", "lambda_lo",
                                           "lambda_hi", "pi_eps", "S_after", "S_lo", "S_hi", "label")
                              if c in versions]), ""]
    L += ["The plan's new rungs (predictions written in the plan before they ran; hit = the "
          "median over passing seeds inside the written 90 % interval):", "",
          md_table(hits, list(hits.columns)), ""]
    return L


# ------------------------------------------------------------------------ nulls
def lanes_from_map(map_dir: Path, name: str = "map") -> pd.DataFrame:
    """A phase-map folder's lanes as one table (map, lr_mult, b2, batch_mult, seed, step,
    loss); `name` is the map's folder name (map, map_train, map_heldout, ...)."""
    meta = json.loads((map_dir / "map.json").read_text())
    parts = []
    for c in meta["cells"]:
        df = PMA.read_cell(map_dir, c)
        if df is not None:
            df = df[["seed", "step", "loss"]]
            parts.append(df.assign(lr_mult=c["lr_mult"], b2=c["b2"], batch_mult=c["batch_mult"]))
    if not parts:
        raise ConfigError(f"{map_dir}: no finished cell")
    return pd.concat(parts, ignore_index=True).assign(map=name)[
        ["map", "lr_mult", "b2", "batch_mult", "seed", "step", "loss"]]


def null_table(lanes: pd.DataFrame, plan: Mapping[str, Any]) -> pd.DataFrame:
    if "map" not in lanes:          # lanes shipped before the map column existed
        lanes = lanes.assign(map="map")
    cells = []
    for (m, lr, b2, bm), g in lanes.groupby(["map", "lr_mult", "b2", "batch_mult"], sort=True):
        ls = [d.sort_values("step")["loss"].to_numpy(float) for _, d in g.groupby("seed")]
        cells.append(({"map": m, "lr_mult": lr, "b2": b2, "batch_mult": bm, "seeds": len(ls)}, ls))
    return cells_table(cells, plan)


def null_md(tab: pd.DataFrame, plan: Mapping[str, Any]) -> list[str]:
    n = plan["spikes"]["null"]
    v, s = plan["spikes"]["visible"], plan["spikes"]["secondary"]
    L = ["## In-band spikes against their noise nulls", "",
         f"Visible class: >= {v['k']:g} local-noise sigmas and >= {1 + v['min_rel_jump']:g}x the "
         f"running median (window {v['window']}), lasting >= {v['min_duration']} steps; "
         f"secondary: k {s['k']:g}, >= {s['min_rel_jump']:.0%}. Nulls: a Student-t fitted to "
         f"each lane's residuals about its centred {n['trend_window']}-step median, and the "
         f"residuals shuffled; {n['replicates']} replicate cells each; a cell spikes when its "
         f"count beats both (Monte-Carlo p < {n['alpha']:g}). Rates per 1k steps, exact Poisson "
         "95 % intervals; durations in steps (censored: cut off by the lane's end).", "",
         md_table(tab, ["map", "lr_mult", "b2", "batch_mult", "seeds", "class", "spikes", "rate_per_1k",
                        "rate_lo", "rate_hi", "null_t_per_1k", "p_t", "null_shuffle_per_1k",
                        "p_shuffle", "median_duration", "null_t_median_duration",
                        "median_height", "censored", "beats_null"]), ""]
    return L


# ------------------------------------------------------------------------ rate model
def map_folder(cfg: str, base: str = "map") -> str:
    """configs/phase_map_science4<suffix>.toml runs into the folder <base><suffix> beside the
    in-band map's own folder <base> (`--map ROOT/map` -> ROOT/map_train, ...; the full
    study's phase_map_science4 -> phase_map_science4_train, ...)."""
    return base + Path(cfg).stem[len("phase_map_science4"):]


def plan_maps(plan: Mapping[str, Any], base: str = "map") -> dict[str, list[str]]:
    """The plan's maps by role as folder names (map_folder)."""
    def name(cfg: str) -> str:
        return map_folder(cfg, base)
    return {"training": [name(c) for c in plan["rate_model"]["training"]["maps"]],
            "heldout": [name(c) for c in plan["heldout"]["maps"]],
            "matched": [name(c) for c in plan["match"].get("cells", {}).get("maps", [])]}


def rate_rows_from_maps(map_dir: Path, plan: Mapping[str, Any]) -> tuple[pd.DataFrame, list[str]]:
    """Lane-phase rows of every plan map found beside the in-band map folder `map_dir`,
    and the maps not found."""
    root = Path(map_dir).parent
    parts, missing = [], []
    for role, names in plan_maps(plan, Path(map_dir).name).items():
        for n in names:
            d = root / n
            if PMA.has_cells(d):
                parts.append(RT.map_rows(d, plan, n).assign(role=role))
            else:
                missing.append(n)
    return (pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()), missing


SEED_RUN = "seed report, LLaMA2-70B on 1024 x 910B (eps 1e-5)"   # configs/public_record.toml


def record_run(name: str) -> dict | None:
    """The public record's run of that name (configs/public_record.toml), None if absent."""
    return next((r for r in read_toml(RECORD)["run"] if r["name"] == name), None)


def reported(run: Mapping[str, Any]) -> int | None:
    """A record run's visible-spike count: `reported`, else `reported_at_least`, else None."""
    k = run.get("reported", run.get("reported_at_least"))
    return None if k is None else int(k)


def pooled_visible_md(rows: pd.DataFrame) -> list[str]:
    """The visible-spike rate of all maps' lane-steps pooled, in the 70B's rho band and out
    of it, with exact Poisson 95 % intervals, beside the seed run's own count (the record's
    first run): the number a model that can say zero has to meet."""
    L = []
    for band, part in (("in the 70B's rho band", rows[rows["cell_in_band"]]),
                       ("out of band", rows[~rows["cell_in_band"]])):
        if not len(part):
            continue
        k, n = int(part["spikes"].sum()), float(part["steps"].sum())
        lo, hi = poisson_interval(k, n / 1000.0)
        L.append(f"- Visible spikes {band}, every map's lanes pooled: {k} in {n:,.0f} lane-steps "
                 f"({part['source'].nunique()} maps, lr x{', x'.join(f'{v:g}' for v in sorted(part['lr_mult'].unique()))}): "
                 f"{1000 * k / n:.3g} per 1k steps, 95 % [{lo:.3g}, {hi:.3g}].")
    seed = record_run(SEED_RUN)
    if seed is not None:
        k = reported(seed) or 0
        lo, hi = poisson_interval(k, seed["horizon_steps"] / 1000.0)
        L.append(f"- The seed's 70B run: {k} visible spike(s) in {seed['horizon_steps']:,} steps "
                 f"({'at least, ' if 'reported' not in seed else ''}configs/public_record.toml): "
                 f"{1000 * k / seed['horizon_steps']:.3g} per 1k steps, 95 % [{lo:.3g}, {hi:.3g}].")
        band = rows[rows["cell_in_band"]]
        if len(band):
            t = seed_rate_test(int(band["spikes"].sum()), float(band["steps"].sum()), k,
                               float(seed["horizon_steps"]), 0.05)
            L.append(f"- In band against the seed run (descriptive, not a plan test: most of "
                     f"these toys differ from the 70B in S or in the update size; the plan's "
                     f"test on the toys that match every quantity is in the table of matches "
                     f"below; exact conditional binomial): P[K <= k] = {t['p_lower']:.3g}, "
                     f"P[K >= k] = {t['p_higher']:.3g}.")
    return L


def rate_model_section(rows: pd.DataFrame | None, missing: Sequence[str],
                       plan: Mapping[str, Any], S70: Mapping[str, float] | None,
                       out: Path) -> list[str]:
    """The plan's held-out test of the threshold model (analysis/rate_threshold.py)."""
    H = ["## A rate model that can say zero, on a held-out map", ""]
    if rows is None or rows.empty or not (rows["role"] == "heldout").any():
        return H + ["Not run: the plan's maps " + ", ".join(f"`{m}`" for m in missing)
                    + " are missing (`adamspike phase-map --config configs/phase_map_science4"
                    "<suffix>.toml --out ROOT/map<suffix>`, then `--map ROOT/map`).", ""], None
    train = rows[rows["role"] == "training"]
    held_all = rows[rows["role"] == "heldout"]
    held = held_all[held_all["cell_in_band"]]
    excluded = held_all[~held_all["cell_in_band"]].groupby(["source", "lr_mult", "batch_mult"]).size()
    r = RT.judge(train.reset_index(drop=True), held.reset_index(drop=True), plan,
              seed=int(plan["spikes"]["null"]["seed"]))
    r["bins"].to_csv(out / "rate_bins.csv", index=False)
    keep = {k: v for k, v in r.items() if k != "bins"}
    atomic_write_bytes(out / "rate_model.json", json.dumps(keep, indent=1, default=float).encode())
    th = r["models"]["threshold"]
    cells = (rows.groupby(["role", "source", "lr_mult", "batch_mult", "init_std", "dim", "layers"])
             .agg(lanes=("seed", "nunique"), S_median=("S", "median"), spikes=("spikes", "sum"),
                  steps=("steps", "sum"), in_band=("cell_in_band", "all"),
                  rho_shallow=("rho_shallow", "median"), rho_deep=("rho_deep", "median"))
             .reset_index())
    cells.to_csv(out / "rate_cells.csv", index=False)
    L = H + [f"Rows: lane-phases (warmup / after) of the plan's maps; the count is the plan's "
             f"VISIBLE class. Training: {r['train_rows']} rows of {r['train_cells']} cells, "
             f"{r['train_spikes']} visible spikes. Held out (the third map, in-band cells only): "
             f"{r['held_rows']} rows of {r['held_cells']} cells, {r['observed']} visible spikes"
             + (f"; excluded as out of band (rho alone, before any count): "
                + ", ".join(f"{s} lr x{lr:g} batch x{b:g}" for (s, lr, b) in excluded.index)
                if len(excluded) else "") + "."
             + (f" Maps not found: {', '.join(missing)}." if missing else ""), "",
             md_table(cells, ["role", "source", "lr_mult", "batch_mult", "init_std", "dim",
                              "layers", "lanes", "S_median", "rho_shallow", "rho_deep",
                              "in_band", "spikes", "steps"]), ""]
    L += pooled_visible_md(rows) + [""]
    if r["train_dropped_no_S"]:
        L.append(f"{r['train_dropped_no_S']} training rows have no positive tracker S (the "
                 "tracker's signed power iteration settled on a negative eigenvalue larger in "
                 "magnitude than the top positive one, or no evaluation): S is not measured "
                 f"there, so they cannot enter an S model; they hold {r['train_dropped_spikes']} "
                 "of the training's visible spikes.")
    if math.isfinite(th["S_c"]):
        L.append(f"Threshold model: S_c = {_fmt(th['S_c'])} (the smallest S of a training row with "
                 f"a visible spike: the maximum-likelihood boundary; cell bootstrap: finite in "
                 f"{r['S_c_boot']['finite_share']:.0%} of draws, 90 % [{_fmt(r['S_c_boot']['p5'])}, "
                 f"{_fmt(r['S_c_boot']['p95'])}]); {th['spiking_rows']} training rows spike.")
    else:
        L.append("Threshold model: no visible spike in any training row with a measured S, so "
                 "S_c = inf: the model says zero everywhere.")
    if r["models"]["lr_eps"].get("no_finite_mle"):
        L.append(f"The lr/eps GLM: {r['models']['lr_eps']['no_finite_mle']}.")
    L += ["", "Held-out Poisson deviance (lower is better; inf: a spike where the model said "
          "zero) and expected visible spikes in all held-out rows [cell-bootstrap 90 %]:", "",
          md_table(pd.DataFrame([{"model": m, "deviance": r["deviance"][m],
                                  "expected": r["total_expected"][m],
                                  "expected_lo": r["total_expected_interval"][m][0],
                                  "expected_hi": r["total_expected_interval"][m][1],
                                  "observed": r["observed"]} for m in RT.MODELS])), "",
          "Per S bin (threshold model; judged where >= "
          f"{plan['heldout']['min_expected_per_bin']:g} are expected):", "",
          md_table(r["bins"], ["S_lo", "S_hi", "rows", "observed", "threshold_expected",
                               "threshold_expected_lo", "threshold_expected_hi",
                               "constant_expected", "lr_eps_expected", "s_bins_expected",
                               "judged", "holds"]), "",
          f"**Verdict under the plan: {r['verdict']}** ({r['why']})."]
    if S70 and math.isfinite(th["S_c"]):
        lo, hi = S70["lo"], S70["hi"]
        where = ("entirely below S_c: the model says zero for the 70B" if hi < th["S_c"] else
                 "entirely above S_c" if lo >= th["S_c"] else "straddles S_c: the model "
                 "cannot say whether the 70B's rate is zero")
        L.append(f"The 70B at the seed's setting ({S70['reading']}): S after the warmup "
                 f"{_fmt(S70['S'])} [{_fmt(lo)}, {_fmt(hi)}], {where}.")
    return L + [""], r


def one_s_section(tab: pd.DataFrame | None, S70: Mapping[str, float] | None,
                  out: Path) -> tuple[list[str], dict | None]:
    """The calibration of the 70B's S estimator against the toys' tracker operator
    (analysis/one_s.py) and the 70B's S carried onto the toys' scale."""
    H = ["## One S: the 70B's estimator against the toys' tracker", ""]
    if tab is None or tab.empty:
        return H + ["Not measured: no `one_s` cells (simulate/one_s.py; `adamspike science4 "
                    "--compute --map ROOT/map` runs them for the plan's in-band map).", ""], None
    cal = OS.calibration(tab)
    cells = OS.per_cell(tab)
    cells.to_csv(out / "one_s_cells.csv", index=False)
    L = H + ["Per map cell and checkpoint (medians over lanes): S_P = lr lambda_max(P^1/2 H "
             "P^1/2) / 2 of the step's minibatch (Lanczos: the operator the tracker follows), "
             "S_70 = lr lambda_max(H_full) / (38 min_g eps_g (1 + rho_g)) (the 70B's reading "
             "applied to the toy: full data = 32 held-out batches of the lane's data).", "",
             md_table(cells, ["map", "lr_mult", "batch_mult", "step", "lanes", "S_P", "S_70",
                              "ratio", "lambda_full", "lambda_batch"]), ""]
    if not math.isfinite(cal["ratio"]):
        return L + ["No checkpoint with both S positive: no calibration.", ""], None
    L.append(f"Calibration S_P / S_70: median {_fmt(cal['ratio'])} [{_fmt(cal['lo'])}, "
             f"{_fmt(cal['hi'])}] (90 %, bootstrap over {cal['lanes']} lanes; {cal['n']} "
             f"checkpoints, spread {cal['spread_decades']:.2f} decades; {cal['dropped']} "
             "left out with a non-positive S).")
    S_cal = None
    if S70:
        S_cal = {"reading": S70["reading"] + ", on the toys' scale (One S)",
                 "S": S70["S"] * cal["ratio"], "lo": S70["lo"] * cal["lo"],
                 "hi": S70["hi"] * cal["hi"]}
        L.append(f"The 70B's S after the warmup on the toys' scale: {_fmt(S_cal['S'])} "
                 f"[{_fmt(S_cal['lo'])}, {_fmt(S_cal['hi'])}] (the reading's prediction "
                 "interval times the calibration's interval).")
    return L + [""], S_cal


# ------------------------------------------------------------------------ toys matched
GROUPS = ("embed", "shallow", "deep", "head")


def theta_rms_init(cfg) -> float:
    """rms over all coordinates of the parameters at init (normal weights at their std,
    norm gains at 1): the scale a relative update is taken against."""
    specs = param_specs(cfg)
    ss = sum(p.numel * (1.0 if p.init == "ones" else p.init_std ** 2) for p in specs)
    return math.sqrt(ss / sum(p.numel for p in specs))


def map_summary(map_dir: Path) -> pd.DataFrame:
    """Per cell of a phase-map folder: lr, weight decay, parameters, rms(theta) at init,
    each group's median rho, the median tracker S and the median rms of the applied update
    (update_norm / sqrt(N))."""
    meta = json.loads((map_dir / "map.json").read_text())
    rows = []
    for c in meta["cells"]:
        df = PMA.read_cell(map_dir, c)
        if df is None:
            continue
        cfg = RunConfig.from_dict(c["config"])
        llama = cfg.model.llama()
        n = num_params(llama)
        rows.append({"lr_mult": c["lr_mult"], "b2": c["b2"], "batch_mult": c["batch_mult"],
                     "dim": llama.dim, "layers": llama.num_layers,
                     "init_std": cfg.model.init_std,
                     "lr": cfg.optim.lr, "weight_decay": cfg.optim.weight_decay,
                     "num_params": n, "theta_rms_init": theta_rms_init(llama),
                     **{f"rho_{g}": float(df[f"rho_{g}"].median()) for g in GROUPS},
                     "S_median": float(df["S"].median()),
                     "update_rms": float(df["update_norm"].median()) / math.sqrt(n)})
    return pd.DataFrame(rows)


def reference_70b(pred: Mapping[str, Any], S_after: float) -> dict:
    """The 70B's side of the match: rho per group and the unit-lr update rms per depth of
    the shipped profile at the seed's setting, lr after the warmup, weight decay 0.1,
    rms(theta) at init (std 0.02), and S after the warmup from the plan-QC reading."""
    seed = next(x for x in pred["settings"] if x["id"].startswith("eps1e-05-b2_0.95-lr0.00015"))
    prof = pred["profile"]
    L = int(prof["num_layers"])
    numel = {int(k): float(v) for k, v in prof["numel_by_depth"].items()}
    by = {g: [] for g in GROUPS}
    upd = 0.0
    for r in seed["per_depth"]:
        by[depth_group(int(r["depth"]), L)].append((numel[int(r["depth"])], r["rho"]))
        upd += numel[int(r["depth"])] * r["update_rms"] ** 2
    rho = {g: math.sqrt(sum(n * v * v for n, v in xs) / sum(n for n, _ in xs)) for g, xs in by.items() if xs}
    lr = 1.5e-4
    cfg = preset("llama2-70b")
    return {"lr": lr, "weight_decay": 0.1, **{f"rho_{g}": v for g, v in rho.items()},
            "S_median": S_after, "theta_rms_init": theta_rms_init(cfg),
            "update_rms": LR_AFTER * lr * math.sqrt(upd / sum(numel.values()))}


LR_AFTER = 0.55     # median lr after the warmup, a fraction of the peak (simulate.predict)


def s70_after_warmup(one_s: pd.DataFrame | None) -> pd.DataFrame:
    """Per map cell, the 70B's S estimator on the toy (One-S cells) after the warmup: the
    median over lanes and over the cell's checkpoints after its first (simulate.one_s.map_cells
    puts the first at the end of the warmup, then half-way and the last step)."""
    cols = ["map", "lr_mult", "batch_mult", "S_70", "S_70_checkpoints"]
    if one_s is None or one_s.empty:
        return pd.DataFrame(columns=cols)
    first = one_s.groupby(["map", "lr_mult", "batch_mult"])["step"].transform("min")
    after = one_s[one_s["step"] > first]
    return (after.groupby(["map", "lr_mult", "batch_mult"])
            .agg(S_70=("S_70", "median"), S_70_checkpoints=("S_70", "size")).reset_index())


def match_reading(versions: pd.DataFrame, plan: Mapping[str, Any]) -> dict | None:
    """The law reading whose S after the warmup is the 70B's S in the match: the one plan
    [match] s_reading names (v4), else the newest reading (v3 named none); None when that
    reading has no finite S."""
    want = plan["match"].get("s_reading")
    rows = versions[versions["reading"] == want] if want else versions.iloc[-1:]
    if want and not len(rows):
        raise ConfigError(f"plan [match] s_reading {want!r}: no such law reading "
                          f"(have {list(versions['reading'])})")
    row = rows.iloc[-1].to_dict()
    return row if np.isfinite(row.get("S_after", math.nan)) else None


def match_table(cells: pd.DataFrame, ref: Mapping[str, Any], factor: float,
                s70: pd.DataFrame | None = None) -> pd.DataFrame:
    """Each toy cell against the 70B: ratios toy / 70B of each group's rho, S, the relative
    update rms(update) / rms(theta) and lr * wd; `matches` lists the quantities within
    `factor` (plan [match]). With `s70` (s70_after_warmup; plan v3: one estimator) a cell's
    S is the 70B's estimator measured on it (`S_estimator` S_70), the tracker's ratio kept
    beside it (`S_tracker_ratio`, not matched on); cells without One-S cells keep the
    tracker S (`S_estimator` tracker)."""
    rows = []
    rel70 = ref["update_rms"] / ref["theta_rms_init"]
    if s70 is not None and len(s70) and "map" in cells:
        cells = cells.merge(s70, on=["map", "lr_mult", "batch_mult"], how="left")
    for _, c in cells.iterrows():
        ratios = {f"rho_{g}": c[f"rho_{g}"] / ref[f"rho_{g}"] for g in GROUPS if f"rho_{g}" in ref}
        one = "S_70" in c and pd.notna(c["S_70"])
        ratios["S"] = (c["S_70"] if one else c["S_median"]) / ref["S_median"]
        ratios["rel_update"] = (c["update_rms"] / c["theta_rms_init"]) / rel70
        ratios["lr_wd"] = (c["lr"] * c["weight_decay"]) / (ref["lr"] * ref["weight_decay"])
        ok = [k for k, v in ratios.items() if 1 / factor <= v <= factor]
        toy = {k: c[k] for k in ("map", "dim", "layers", "init_std") if k in c and pd.notna(c[k])}
        seen = {k: c[k] for k in ("visible_spikes", "steps") if k in c and pd.notna(c[k])}
        est = ({"S_estimator": "S_70" if one else "tracker",
                "S_tracker_ratio": c["S_median"] / ref["S_median"]} if s70 is not None else {})
        rows.append({**toy, "lr_mult": c["lr_mult"], "b2": c["b2"], "batch_mult": c["batch_mult"],
                     **{f"{k}_ratio": v for k, v in ratios.items()}, **est,
                     "matches": ", ".join(ok) or "none",
                     "all_match": len(ok) == len(ratios), **seen})
    return pd.DataFrame(rows)


def seed_rate_test(k: int, n: float, k0: int, n0: float, alpha: float) -> dict:
    """Plan v3 [match.test]: k visible spikes in n toy lane-steps against the seed run's k0
    in n0 steps. Under equal rates, conditional on k + k0, K ~ Binomial(k + k0, n / (n + n0));
    "lower" when P[K <= k] < alpha, "higher" when P[K >= k] < alpha."""
    m, q = k + k0, n / (n + n0)
    p_lower = float(stats.binom.cdf(k, m, q)) if m else 1.0
    p_higher = float(stats.binom.sf(k - 1, m, q)) if m else 1.0
    verdict = ("lower than the seed run's rate" if p_lower < alpha else
               "higher than the seed run's rate" if p_higher < alpha else
               "not distinguishable from the seed run's rate")
    return {"k": int(k), "n": float(n), "k0": int(k0), "n0": float(n0), "p_lower": p_lower,
            "p_higher": p_higher, "verdict": verdict}


def _unmatched(match: pd.DataFrame) -> str:
    """Which quantities the toys match and which none does (from the table)."""
    qs = [c[:-len("_ratio")] for c in match.columns
          if c.endswith("_ratio") and c != "S_tracker_ratio"]
    hit = {q: int(match["matches"].str.split(", ").apply(lambda m: q in m).sum()) for q in qs}
    never = [q for q in qs if hit[q] == 0]
    said = ", ".join(f"{q} in {hit[q]} of {len(match)}" for q in qs)
    if not never:
        return (f"Each quantity is matched somewhere ({said}), never all at once: the toy that "
                "matches all of them is still to be found.")
    side = {q: ("too large" if (match[f"{q}_ratio"] > 1).all() else "too small"
                if (match[f"{q}_ratio"] < 1).all() else "on both sides") for q in never}
    return (f"Matched: {said}. Left unmatched in every cell: "
            + ", ".join(f"{q} ({side[q]})" for q in never)
            + ". The toys do not stand for the 70B on these until a model reaches the 70B's S "
              "with them in range; the visible-spike answer is undetermined there.")


def _matched_cells(rows: pd.DataFrame) -> str:
    return ", ".join(f"{getattr(r, 'map', 'map')} lr x{r.lr_mult:g} batch x{r.batch_mult:g}"
                     for r in rows.itertuples()) or "none"


def matched_test(rows: pd.DataFrame, test: Mapping[str, Any] | None) -> dict:
    """Visible spikes of `rows` pooled: count, lane-steps, rate per 1k with its exact
    Poisson 95 % interval, and plan [match.test] against the seed run (when the plan has one)."""
    k, n = float(rows["visible_spikes"].sum()), float(rows["steps"].sum())
    lo, hi = poisson_interval(int(k), n / 1000.0)
    out = {"cells": _matched_cells(rows), "k": int(k), "n": n, "rate": 1000 * k / n,
           "lo": lo, "hi": hi}
    if test:
        run = record_run(test["seed_run"])
        out.update(seed_rate_test(int(k), n, reported(run), float(run["horizon_steps"]),
                                  float(test["alpha"])))
    return out


def _seed_test_line(rows: pd.DataFrame, test: Mapping[str, Any] | None) -> str:
    t = matched_test(rows, test)
    line = (f"{t['k']} in {t['n']:,.0f} lane-steps, {t['rate']:.3g} [{t['lo']:.3g}, "
            f"{t['hi']:.3g}] per 1k.")
    if "verdict" in t:
        line += (f" Against the seed run ({t['k0']} in {t['n0']:,.0f} steps; plan "
                 f"[match.test], exact conditional binomial): P[K <= k] = {t['p_lower']:.3g}, "
                 f"P[K >= k] = {t['p_higher']:.3g}: **{t['verdict']}**.")
    return line


def tested_cells(match: pd.DataFrame, plan: Mapping[str, Any], test_maps: Sequence[str]) -> pd.DataFrame:
    """The cells plan [match.test] pools: those matching every quantity, of the test's own
    maps when it names them (v4), else all of them (v3)."""
    full = match[match["all_match"]]
    if plan["match"].get("test", {}).get("maps") and "map" in full:
        return full[full["map"].isin(list(test_maps))]
    return full


def match_md(match: pd.DataFrame, plan: Mapping[str, Any], reading: str,
             by_reading: Mapping[str, tuple[float, pd.DataFrame]] | None = None,
             test_maps: Sequence[str] = ()) -> list[str]:
    """The match table; the cells that match every quantity; plan [match.test] on them
    (v4: only the cells of the test's own maps, the new lanes; other all-matched cells are
    described with their own test, not pooled); which cells match under each law reading."""
    f = plan["match"]["factor"]
    one = "S_estimator" in match
    L = ["## Toys matched to the 70B, group by group", "",
         f"Ratios toy / 70B (plan [match]: a quantity matches within {f:g}x). rho per depth "
         "group (medians over the toy's steps; the 70B's shipped profile at eps 1e-5); S: "
         + ("the 70B's estimator measured on the toy (One-S cells, median after the warmup; "
            "plan v3: one estimator) where `S_estimator` is S_70, the toy's tracker S where "
            "it says tracker (`S_tracker_ratio`: the tracker's, not matched on), " if one else
            "the toy's tracker S (median) ")
         + f"against the 70B's S after the warmup under '{reading}'"
         + (" (plan [match] s_reading)" if plan["match"].get("s_reading") else "")
         + ("" if one else " (two estimators: the calibration between them is open, below)")
         + "; relative update: rms of the applied update / rms(theta) at init (the 70B: lr "
           "after the warmup x the profile's unit-lr update rms); lr x weight decay at the "
           "peak lr.", "",
         md_table(match, list(match.columns)), ""]
    full = match[match["all_match"]]
    test = plan["match"].get("test")
    counted = len(full) and "visible_spikes" in full
    if not len(full):
        L.append("No toy cell matches every quantity. " + _unmatched(match))
    elif test and test.get("maps") and "map" in full:
        tested = tested_cells(match, plan, test_maps)
        other = full[~full.index.isin(tested.index)]
        L.append(f"Cells where every quantity matches: {_matched_cells(full)}.")
        if counted:
            L.append("")
            L.append(f"- **The test (plan v{plan['plan']['version']} [match.test]: the cells "
                     f"of {', '.join(test_maps)}, lanes no earlier test saw):** "
                     + (f"{_matched_cells(tested)}: " + _seed_test_line(tested, test)
                        if len(tested) else "no cell of these maps matches every quantity: "
                        "not tested (their counts are in the table)."))
            if len(other):
                L.append(f"- Earlier versions' matched cells, on their own (seen before this "
                         f"version, not pooled with the test): {_matched_cells(other)}: "
                         + _seed_test_line(other, test))
    else:
        L.append(f"Cells where every quantity matches: {_matched_cells(full)}."
                 + (" Visible spikes where every quantity matches: "
                    + _seed_test_line(full, test) if counted else ""))
    if by_reading and len(by_reading) > 1:
        L += ["", "The 70B's S differs by law reading, and so does which toy matches (the match "
              f"uses '{reading}'):", "",
              md_table(pd.DataFrame([{"reading": r, "S_after_70B": s_after,
                                      "cells_matching_all": _matched_cells(t[t["all_match"]])}
                                     for r, (s_after, t) in by_reading.items()]),
                       ["reading", "S_after_70B", "cells_matching_all"])]
    return L + [""]


# ------------------------------------------------------------------------ public record
def public_record(plan: Mapping[str, Any], lam_reading: Mapping[str, Any] | None,
                  threshold: Mapping[str, Any] | None = None, calib: float = 1.0) -> pd.DataFrame:
    """Expected spikes of each public run under the shipped mechanism model (its own class:
    the toys' k = 4, >= 10 % spikes) with the shipped sharpness law and, when given, the
    plan-QC law, beside what was reported; Poisson log-likelihoods against a constant rate
    fitted to the same record (runs with a count; at-least counts as P(N >= k))."""

    runs = read_toml(RECORD)["run"]
    model = SR.load_model(package_data.DATA / "llama2_70b" / "spike_rate_model.json")
    prof_v4 = load_profile("llama2-70b")
    # v4 = the batch-sharpness reading as Science 3 shipped it: without the plan-QC law that
    # predict now reads from the package data (the "qc" column carries that reading)
    prof_v4["ladder"]["llama2_70b"]["sharpness"].pop("law", None)
    profiles = {"v4": prof_v4}
    if lam_reading and math.isfinite(lam_reading.get("lambda_inf", math.nan)):
        p = copy.deepcopy(prof_v4)
        fd = p["ladder"]["llama2_70b"]["sharpness"]["full_data"]
        fd.update(lambda_max=lam_reading["lambda_inf"], lambda_max_lo=lam_reading["lambda_lo"],
                  lambda_max_hi=lam_reading["lambda_hi"], lr_exponent=lam_reading["lr_exponent"],
                  lr_ref=plan["sharpness"]["target"]["lr"])
        profiles["qc"] = p
    rows = []
    for r in runs:
        row = {"run": r["name"], "eps": r.get("eps"), "b2": r.get("b2"), "lr": r.get("lr"),
               "horizon_steps": r["horizon_steps"], "hardware": r.get("hardware", ""),
               "reported": reported(r),
               "at_least": "reported_at_least" in r and "reported" not in r,
               "assumed": r.get("assumed", ""), "source": r["source"]}
        if r.get("optimizer") != "adamw":
            row["note"] = f"{r.get('optimizer')}: outside an Adam model's domain"
            rows.append(row)
            continue
        cand = {"optim.eps": r["eps"], "optim.lr": r["lr"], "optim.b2": r["b2"]}
        H, W = float(r["horizon_steps"]), float(min(r["warmup_steps"], r["horizon_steps"]))
        for tag, prof in profiles.items():
            exp = {}
            for which in ("mid", "lo", "hi"):
                tot = 0.0
                for phase, steps in (("warmup", W), ("after", H - W)):
                    m = mechanism_inputs(prof, cand, phase, which)
                    x = np.array([[math.log10(m["stability"]), m["warmup"]]])
                    ri = model.rate_interval(x)
                    rate = {"mid": ri["rate"], "lo": ri["lo"], "hi": ri["hi"]}[which][0]
                    tot += float(rate) * steps / 1000.0
                    if which == "mid" and phase == "after":
                        row[f"S_after_{tag}"] = m["stability"]
                exp[which] = tot
            row[f"expected_{tag}"], row[f"expected_lo_{tag}"], row[f"expected_hi_{tag}"] = \
                exp["mid"], min(exp.values()), max(exp.values())
        if threshold is not None:     # the model that can say zero, on the visible class
            prof = profiles.get("qc", prof_v4)
            exp = {}
            for which in ("mid", "lo", "hi"):
                ph = [(mechanism_inputs(prof, cand, phase, which), steps)
                      for phase, steps in (("warmup", W), ("after", H - W))]
                x = pd.DataFrame({"S": [m["stability"] * calib for m, _ in ph],
                                  "warmup": [m["warmup"] for m, _ in ph],
                                  "lr": r["lr"], "eps_median": r["eps"]})
                rt = RT.rates(threshold, x)["threshold"].to_numpy()
                exp[which] = float(sum(v * st / 1000.0 for v, (_, st) in zip(rt, ph)))
            row["expected_threshold"] = exp["mid"]
            row["expected_lo_threshold"], row["expected_hi_threshold"] = \
                min(exp.values()), max(exp.values())
        rows.append(row)
    df = pd.DataFrame(rows)
    counted = df[df["reported"].notna() & df["expected_v4"].notna()] if "expected_v4" in df else df.iloc[:0]
    if len(counted):
        k = counted["reported"].to_numpy(float)
        at_least = counted["at_least"].to_numpy(bool)
        H = counted["horizon_steps"].to_numpy(float)
        k_exact = k[~at_least]
        const = (k_exact.sum() + k[at_least].sum()) / H.sum()   # MLE-ish: at-least counts as k

        def loglik(mu):
            mu = np.maximum(mu, 1e-300)
            ll = np.where(at_least, np.log(np.maximum(stats.poisson.sf(k - 1, mu), 1e-300)),
                          stats.poisson.logpmf(k, mu))
            return ll
        df.loc[counted.index, "loglik_const"] = loglik(const * H)
        df.loc[counted.index, "expected_const"] = const * H
        for tag in [*profiles, *(["threshold"] if "expected_threshold" in df else [])]:
            df.loc[counted.index, f"loglik_{tag}"] = loglik(counted[f"expected_{tag}"].to_numpy(float))
    return df


def record_md(df: pd.DataFrame) -> list[str]:
    tags = [t for t in ("v4", "qc", "threshold") if f"expected_{t}" in df]
    cols = ["run", "eps", "b2", "lr", "horizon_steps", "reported"]
    for t in tags:
        cols += [c for c in (f"S_after_{t}", f"expected_{t}", f"expected_lo_{t}",
                             f"expected_hi_{t}") if c in df]
    cols += ["expected_const"] + [f"loglik_{t}" for t in tags] + ["loglik_const"]
    L = ["## The public record as a test", "",
         "Expected spikes over each run's horizon under the shipped mechanism model (rate = "
         "f(S, warmup), trained on the toys' k = 4 / >= 10 % class; the 70B profile's rho and "
         "sharpness law, the run's eps, b2, lr and warmup), once with the shipped law (v4) and "
         "once with the plan-QC law (qc); the interval combines the model's rate interval and "
         "the law's range. `threshold`: the model that can say zero (trained on the plan's "
         "visible class, the 70B's S carried onto the toys' scale by One S where measured; "
         "its interval is the law's range only). `reported`: visible spikes the authors reported (at least, where "
         "they only said spikes happened). Log-likelihoods (Poisson; at-least counts as P(N >= "
         "k)) against a constant rate fitted to the same record.", "",
         md_table(df, [c for c in cols if c in df]), ""]
    if "loglik_const" in df:
        tot = {c: float(df[c].sum()) for c in df if c.startswith("loglik_")}
        L += ["Total log-likelihood over the runs with a count: " + ", ".join(
            f"{k.removeprefix('loglik_')} {v:.1f}" for k, v in tot.items())
            + ". A model that expects 0 where spikes were reported has likelihood 0 there "
              "(shown floored at log 1e-300 = -691 per such run).", ""]
    notes = df[df.get("note", pd.Series(dtype=object)).notna()] if "note" in df else df.iloc[:0]
    for _, r in notes.iterrows():
        L.append(f"- {r['run']}: {r['note']}.")
    L += ["- Assumptions per run (values the sources do not give) are in public_record.csv "
          "(`assumed`); sources in configs/public_record.toml.", ""]
    meta = df[df["run"].str.startswith("Meta")]
    seed = df[df["run"].str.startswith("seed report, LLaMA2")]
    if len(meta) and len(seed) and "expected_v4" in df:
        L += [f"Meta's LLaMA2-70B and the seed's run share the optimizer recipe, so the model "
              f"gives them the same rate: {_fmt(float(seed['expected_v4'].iloc[0]))} spikes expected "
              f"in the seed's 1543 steps, {_fmt(float(meta['expected_v4'].iloc[0]))} in Meta's ~500k "
              "(0 reported). The model cannot tell them apart: what differs between them is outside "
              "its inputs (hardware numerics: 910B vs A100, bf16 kernels; data; the schedule actually "
              "run; init; the seed stack's AdamW differs from torch's only in its first ~50 steps, "
              "below). A run "
              "that would separate them: the seed's recipe on the 910B stack with the probe's "
              "per-group telemetry for the first 2000 steps, against the same steps on GPUs.", ""]
    return L


def record_summary(df: pd.DataFrame) -> dict:
    """What `predict` says beside the shipped rate model's numbers (RECORD_FILE): the model
    file it was computed with (sha256), the runs with a count, the total log-likelihoods
    of the shipped model (v4) and of the constant rate fitted to the same record, that
    constant rate, and the expected visible spikes of Meta's LLaMA2-70B run."""
    model = package_data.DATA / "llama2_70b" / "spike_rate_model.json"
    counted = df[df["loglik_const"].notna()] if "loglik_const" in df else df.iloc[:0]
    out = {"model_sha256": hashlib.sha256(model.read_bytes()).hexdigest(),
           "runs_counted": int(len(counted)),
           "spikes_reported": float(counted["reported"].sum()) if len(counted) else 0.0,
           "steps": float(counted["horizon_steps"].sum()) if len(counted) else 0.0,
           "loglik": {c.removeprefix("loglik_"): float(counted[c].sum())
                      for c in counted if c.startswith("loglik_")}}
    out["const_rate_per_1k"] = 1000 * out["spikes_reported"] / out["steps"] if out["steps"] else None
    # the reading predict uses: the plan-QC law ("qc") where one is shipped, else v4
    out["reading"] = "qc" if "qc" in out["loglik"] else "v4"
    meta = df[df["run"].str.startswith("Meta")]
    tag = out["reading"]
    if len(meta) and f"expected_{tag}" in df:
        m = meta.iloc[0]
        out["meta_llama2_70b"] = {"horizon_steps": float(m["horizon_steps"]),
                                  "reported": float(m["reported"]),
                                  "S_after": float(m[f"S_after_{tag}"]),
                                  "expected": float(m[f"expected_{tag}"]),
                                  "expected_interval": [float(m[f"expected_lo_{tag}"]),
                                                        float(m[f"expected_hi_{tag}"])]}
    return out


# ------------------------------------------------------------------------ claims
EPS_FACTOR = {"*0.001": 1000.0, "*0.1": 10.0}    # an eps treatment's expected rho ratio


def claims_under_plan(study_dir: Path, plan: Mapping[str, Any]) -> pd.DataFrame:
    """The seed's claims (a finished `adamspike replicate` folder) under the plan's rule:
    per claim the visible (and secondary) spikes per seed in each arm, the exact two-sided
    sign test of the paired differences, Holm over the claims, the verdict ("supported":
    fewer visible spikes, p_holm < alpha; "refuted": more; else "undetermined"), and each
    group's rho ratio treatment / control against the ratio the 70B's eps change gives."""
    meta, arms = load_claims(study_dir)
    a = float(plan["claims"]["alpha"])
    cls = {c: class_params(plan, c) for c in ("visible", "secondary")}

    def counts(table: pd.DataFrame, c: str) -> np.ndarray:
        return np.array([len(detect_spikes(g.sort_values("step")["loss"].to_numpy(float), params=cls[c]))
                         for _, g in table.groupby("seed", sort=True)])
    rows = []
    for cl in meta["claims"]:
        t, c = arms[cl["treatment_arm"]], arms[cl["control_arm"]]
        row = {"id": cl["id"], "claim": cl["claim"], "seeds": int(t["seed"].nunique())}
        for name in ("visible", "secondary"):
            ct, cc = counts(t, name), counts(c, name)
            row[f"{name}_control"], row[f"{name}_treatment"] = int(cc.sum()), int(ct.sum())
            if name == plan["claims"]["spike_class"]:
                p, n_pos, n_neg = sign_test(ct - cc)
                row.update(p=p, seeds_more=n_pos, seeds_fewer=n_neg)
        eps_mult = str(cl["treatment"].get("optim.eps", ""))
        want = EPS_FACTOR.get(eps_mult, math.nan)
        for g in GROUPS:
            col = f"rho_{g}"
            if col in t and col in c:
                got = float(t[col].median() / c[col].median())
                row[f"{col}_ratio"] = got
                row[f"{col}_off"] = got / want if math.isfinite(want) else math.nan
        rows.append(row)
    df = pd.DataFrame(rows)
    df["p_holm"] = holm(df["p"].to_numpy(float))
    vis = plan["claims"]["spike_class"]
    df["verdict"] = ["supported" if r.p_holm < a and r[f"{vis}_treatment"] < r[f"{vis}_control"]
                     else "refuted" if r.p_holm < a and r[f"{vis}_treatment"] > r[f"{vis}_control"]
                     else "undetermined" for _, r in df.iterrows()]
    return df


def claims_md(df: pd.DataFrame, plan: Mapping[str, Any]) -> list[str]:
    c = plan["claims"]
    cols = ["id", "seeds", "visible_control", "visible_treatment", "secondary_control",
            "secondary_treatment", "seeds_more", "seeds_fewer", "p", "p_holm", "verdict"]
    off = [x for x in df.columns if x.endswith("_off")]
    return ["## The seed's eps claims under the plan's rule", "",
            f"Rule (plan [claims], fixed before the run): `{c['rule']}` of the {c['spike_class']} "
            f"class, paired seeds, exact two-sided sign test, {c['correction']} over the claims, "
            f"alpha {c['alpha']:g}: supported (fewer), refuted (more), else undetermined. "
            "configs/claims_science4.toml's arms (lr x256, the in-band edge toy).", "",
            md_table(df, cols), "",
            "How far each arm moved every group's rho from the 70B's: the ratio treatment / "
            "control over the ratio the eps change gives the 70B (1000 for eps 1e-5 -> 1e-8, "
            "10 for -> 1e-6; 1 = as the 70B's would move):", "",
            md_table(df, ["id"] + [x for x in df.columns if x.endswith("_ratio")] + off), "",
            "Science 3's verdicts on the same three claims (rule `removes`, chosen after its "
            "40-seed run, k = 4 class): not supported (spikes remain) for all three; kept in "
            "docs/results/science3_2026-12-05.md.", ""]


# ------------------------------------------------------------------------ report
def plan_versions_md(plan: Mapping[str, Any]) -> list[str]:
    """Every version of the plan with its hash, and each later version's changes with the
    reason (the list of changes after data)."""
    L = []
    for v in plan_history(plan["plan"]["name"]):
        meta = v["plan"]
        rel = Path(v["_path"]).relative_to(Path(v["_path"]).parents[2])
        L.append(f"- `{rel}` version {meta['version']}, written {meta.get('written', '?')}, "
                 f"sha256 `{v['_sha256']}`"
                 + (f": supersedes `{meta['supersedes']}`. Reason: {' '.join(str(meta['reason']).split())}"
                    if meta.get("supersedes") else ": the first version."))
        L += [f"  - change: {c}" for c in meta.get("changes", [])]
    return L


def report(out: Path, plan: Mapping[str, Any], parts: Mapping[str, list[str]]) -> str:
    L = ["# Science 4: the 70B answer under a written plan", "",
         f"Plan: `{Path(plan['_path']).relative_to(Path(plan['_path']).parents[2])}` "
         f"version {plan['plan']['version']}, sha256 `{plan['_sha256']}`. Every verdict below "
         "is computed under this version; the sections a later version did not change read "
         "the same under every version. The versions, and every change after data with its "
         "reason:", "", *plan_versions_md(plan), ""]
    for name in ("sharpness", "nulls", "ones", "ratemodel", "match", "claims", "record", "adamw",
                 "open"):
        L += parts.get(name, [])
    return "\n".join(L) + "\n"


def adamw_md() -> list[str]:
    return ["## Which AdamW the seed ran", "",
            "AscendSpeed's AdamW on torch_npu's `npu_apply_adam_w` kernel (sources with file and "
            "commit: docs/results/seed_stack_adamw.md): eps outside sqrt(v_hat) as in torch, "
            "decoupled weight decay, fp32 m, v and master weights; its bias corrections run one "
            "step ahead (1 - b^(t+1) at step t). Both backends carry it as "
            "`optim.bias_correction_offset = 1`. Effect against torch's AdamW: the update x0.735 "
            "and the effective eps x1.40 at step 1, within 0.3 % from step 30: it cannot separate "
            "the seed's run (spikes within 1543 steps) from Meta's (none), and rho, S and Pi_eps "
            "need no correction.", ""]


def open_items_md(plan: Mapping[str, Any], *, label: str | None, rate: Mapping[str, Any] | None,
                  one_s: Mapping[str, Any] | None, claims: pd.DataFrame | None,
                  match: pd.DataFrame | None, missing_maps: Sequence[str]) -> list[str]:
    """What this report leaves undetermined and the run that would decide each, from the
    results above (nothing here is written ahead of them)."""
    L = ["## Undetermined, and the run that would decide it", ""]
    if label and label.startswith("undetermined"):
        L.append(f"- **The 70B's mechanism label** ({label}): the law's prediction interval of "
                 "S after the warmup straddles the edge S = 1. A measured full-data lambda_max(H) "
                 "of the 70B itself (Lanczos at a checkpoint of the seed's recipe; no toy law "
                 "carried over 2-3 decades of size) would decide it.")
    if rate is None:
        L.append("- **Rate model that can say zero**: not judged: the plan's maps "
                 + ", ".join(missing_maps) + " are missing here.")
    elif rate["verdict"] == "undetermined":
        L.append(f"- **Rate model that can say zero**: undetermined ({rate['why']}). Held-out "
                 "in-band cells where >= 5 visible spikes are expected per S bin would decide "
                 "it; the toys here show none in band (pooled rate above), so in band the model "
                 "has nothing to be wrong about at this size.")
    if one_s is None:
        L.append("- **One S**: not measured (`adamspike science4 --compute --map ROOT/map`).")
    elif one_s["hi"] / max(one_s["lo"], 1e-300) > 100:
        L.append(f"- **One S**: the 70B's S on the toys' scale is {_fmt(one_s['S'])} "
                 f"[{_fmt(one_s['lo'])}, {_fmt(one_s['hi'])}]: over two decades wide. One-S "
                 "cells at more lr multipliers between x1 and x64 (where the two estimators "
                 "still agree within a decade) would narrow it.")
    if claims is not None and len(claims) and (claims["verdict"] == "undetermined").all():
        L.append("- **The seed's eps claims under the plan's rule**: undetermined in every arm "
                 f"({int(claims['visible_control'].sum())} visible spikes in the control arms): "
                 "arms whose control shows visible spikes in band would decide them; no toy here "
                 "does.")
    if missing_maps and any("matched" in m for m in missing_maps):
        L.append("- **Toys matched on every group** (plan v3 [match.cells]): the matched map "
                 "has not run here: `adamspike phase-map --config "
                 "configs/phase_map_science4_matched.toml --no-check --out ROOT/map_matched`, then "
                 "`adamspike science4 --compute --map ROOT/map` (its One-S cells) decides it.")
    elif match is not None and len(match) and not match["all_match"].any():
        f = float(plan["match"]["factor"])
        but_s = match[match["matches"].apply(
            lambda m: set(m.split(", ")) >= {"rel_update", "lr_wd"} and "S" not in m)]
        law = package_data.sharpness_law("llama2-70b")
        if len(but_s) and law is not None and (but_s["S_ratio"] > 0).any():
            best = but_s.loc[but_s["S_ratio"].idxmax()]
            c_layers = float(law["coef"][2])
            grow = (1 / f / float(best["S_ratio"])) ** (1 / c_layers) if c_layers > 0 else math.inf
            L.append(f"- **Toys matched on every group**: every quantity but S matches in "
                     f"{len(but_s)} cell(s) (the toy at lr x{', x'.join(f'{v:g}' for v in but_s['lr_mult'])}); "
                     f"S is left, at {_fmt(float(best['S_ratio']))}x the 70B's at best (lr "
                     f"x{best['lr_mult']:g}). The law's depth term (lambda ~ layers^{c_layers:.2f}) "
                     f"puts the S of a toy with ~{grow:.0f}x its depth ({grow * float(best['layers']):.0f} "
                     "layers) at that lr at 1/3 of the 70B's, the match's edge; that toy's "
                     "visible spikes would decide whether they survive where everything matches.")
        else:
            L.append("- **Toys matched on every group**: no cell matches all at once (table "
                     "above); a toy that reaches the 70B's S with the relative update and lr x wd "
                     "in range would decide whether visible spikes survive there.")
    return L + ([""] if len(L) > 2 else ["Nothing left open by the sections above.", ""])


def run(out: Path, *, compute: bool = False, cells_dir: Path | None = None,
        map_dir: Path | None = None, executor: str | None = None, jobs: int = 1,
        address: str | None = None, progress: bool = True,
        claims_dir: Path | None = None) -> dict:

    plan = load_plan("science4")
    out.mkdir(parents=True, exist_ok=True)
    summary_v4 = json.loads((package_data.ladder_dir("llama2-70b") / "batch_sharpness.json").read_text())
    store_dir = cells_dir or (out / "cells")
    if compute:
        store = CellStore(store_dir)
        first = plan_cells(plan)
        got = run_cells(store, first, executor=executor, jobs=jobs, address=address,
                        progress=progress, desc="sharpness rungs")
        failed = [c for c, p in zip(first, got) if not SH.qc_cell(p, plan)["pass"]]
        if failed:
            again = {(c.config["dim"], c.config["layers"], c.config["lr"], c.config["seed"],
                      c.config["steps"]): c for c in plan_cells(plan, rerun=True)}
            run_cells(store, [again[(c.config["dim"], c.config["layers"], c.config["lr"],
                                     c.config["seed"], c.config["steps"])] for c in failed],
                      executor=executor, jobs=jobs, address=address, progress=progress,
                      desc="sharpness reruns")
        cells = SH.read_cells(store_dir)
        if map_dir:     # One S on the in-band map's lanes (simulate/one_s.py)
            from simulate.one_s import map_cells
            run_cells(store, map_cells(json.loads((Path(map_dir) / "map.json").read_text())),
                      executor=executor, jobs=jobs, address=address, progress=progress,
                      desc="one-S cells")
            mc = plan["match"]["cells"]
            for cfg, n in zip(mc["maps"], plan_maps(plan, Path(map_dir).name)["matched"]):
                d = Path(map_dir).parent / n        # plan v3-v4 [match.cells]
                if PMA.has_cells(d):
                    lanes_n = int(mc.get("one_s_lanes_by_map", {}).get(cfg, mc["one_s_lanes"]))
                    run_cells(store, map_cells(json.loads((d / "map.json").read_text()), lanes_n),
                              executor=executor, jobs=jobs, address=address,
                              progress=progress, desc=f"one-S cells ({n})")
    else:
        cells = SH.read_cells(cells_dir if cells_dir else SHIPPED / "cells")
    # rho_min of the 70B (the profile's most dormant group at eps 1e-5), as predict reads it
    pred = json.loads((package_data.DATA / "llama2_70b" / "predictions.json").read_text())
    seed = next(s for s in pred["settings"] if s["id"].startswith("eps1e-05-b2_0.95-lr0.00015"))
    rho_min = 10 ** seed["features"]["log10_rho_min"]
    rows, versions, extra = sharpness_versions(plan, summary_v4, cells, rho_min)
    atomic_write_bytes(out / "sharpness_rungseeds.csv", rows.to_csv(index=False).encode())
    atomic_write_bytes(out / "sharpness_versions.csv", versions.to_csv(index=False).encode())
    atomic_write_bytes(out / "sharpness_hits.csv", extra["hits"].to_csv(index=False).encode())
    # the law `predict` uses (adamspike.sharpness_law): the last reading under the plan's QC
    qc_name = next((n for n in reversed(list(extra["laws"])) if "plan QC" in n
                    and extra["laws"][n] is not None), None)
    if qc_name:
        t = plan["sharpness"]["target"]
        law_doc = {"schema": "adamspike.sharpness_law", "reading": qc_name,
                   "plan": Path(plan["_path"]).name, "plan_sha256": plan["_sha256"],
                   "target": {"dim": t["dim"], "layers": t["layers"]},
                   **{k: v for k, v in extra["laws"][qc_name].items()}}
        atomic_write_bytes(out / LAW_FILE, json.dumps(law_doc, indent=1).encode())
        # the shipped law (what `predict` reads) re-derived from the shipped cells: same?
        # (rtol 1e-9: the same fit on the same cells; only BLAS rounding may differ)
        shipped = package_data.sharpness_law("llama2-70b")
        if shipped is not None:
            same = (shipped.get("reading") == law_doc["reading"]
                    and np.allclose(shipped["coef"], law_doc["coef"], rtol=1e-9, atol=0)
                    and np.allclose(shipped["cov"], law_doc["cov"], rtol=1e-9, atol=0))
            parts_law = (f"The law `predict` reads (package data science4/{LAW_FILE}, "
                         f"'{shipped.get('reading')}') "
                         + ("is re-derived here from the cells: the same coefficients and "
                            "covariance." if same else
                            "differs from the one derived here (cells added since it shipped: "
                            "`adamspike science4 --ship` refreshes it)."))
        else:
            parts_law = ("No law is shipped yet: `predict` reads the batch-sharpness reading "
                         "(v4); `adamspike science4 --ship` ships this one.")
    else:
        parts_law = "No law under the plan's QC (too few passing rungs)."
    parts = {"sharpness": sharpness_md(rows, versions, extra["hits"], plan) + [parts_law, ""]}
    if map_dir:     # the map's cell tables, which package-data ships (adamspike.package_data)
        lanes, summ = lanes_from_map(map_dir), map_summary(map_dir)
        lanes.to_parquet(out / LANES_FILE, index=False)
        summ.to_csv(out / CELLS_FILE, index=False)
    else:
        lanes = pd.read_parquet(SHIPPED / LANES_FILE) if (SHIPPED / LANES_FILE).exists() else None
        summ = pd.read_csv(SHIPPED / CELLS_FILE) if (SHIPPED / CELLS_FILE).exists() else None
    nulls = None
    if lanes is not None:
        nulls = null_table(lanes, plan)
        atomic_write_bytes(out / "null_cells.csv", nulls.to_csv(index=False).encode())
        parts["nulls"] = null_md(nulls, plan)
    else:
        parts["nulls"] = ["## In-band spikes against their noise nulls", "",
                          "No map lanes: run `adamspike phase-map --config "
                          "configs/phase_map_science4.toml --out M` and pass `--map M`.", ""]
    # the rate model's rows: from the plan's map folders beside --map, else shipped
    rate_missing: list[str] = []
    if map_dir:
        rate_rows, rate_missing = rate_rows_from_maps(Path(map_dir), plan)
        if not rate_rows.empty:
            rate_rows.to_parquet(out / RATE_ROWS_FILE, index=False)
            extra_lanes = [lanes_from_map(Path(map_dir).parent / n, n)
                           for ns in plan_maps(plan, Path(map_dir).name).values() for n in ns
                           if n != Path(map_dir).name
                           and PMA.has_cells(Path(map_dir).parent / n)]
            if extra_lanes:      # every map's rates beside their nulls
                more = null_table(pd.concat(extra_lanes, ignore_index=True), plan)
                nulls = pd.concat([nulls, more], ignore_index=True) if nulls is not None else more
                atomic_write_bytes(out / "null_cells.csv", nulls.to_csv(index=False).encode())
                parts["nulls"] = null_md(nulls, plan)
    else:
        rate_rows = (pd.read_parquet(SHIPPED / RATE_ROWS_FILE)
                     if (SHIPPED / RATE_ROWS_FILE).exists() else None)
        rate_missing = [] if rate_rows is not None else sum(plan_maps(plan).values(), [])
    last = versions.iloc[-1]
    S70 = None
    if np.isfinite(last.get("S_after", math.nan)):
        S70 = {"reading": str(last["reading"]), "S": float(last["S_after"]),
               "lo": float(last.get("S_lo", math.nan)),
               "hi": float(last.get("S_hi", math.nan))}
    # One S: the cells in the store when computing, else the shipped table
    one_tab = None
    if map_dir and (store_dir / "one_s").is_dir():
        one_tab = OS.read_table(store_dir, {n: Path(map_dir).parent / n
                                            for ns in plan_maps(plan, Path(map_dir).name).values() for n in ns})
        if not one_tab.empty:
            one_tab.to_csv(out / ONE_S_FILE, index=False)
    elif (SHIPPED / ONE_S_FILE).exists():
        one_tab = pd.read_csv(SHIPPED / ONE_S_FILE)
    parts["ones"], S70_cal = one_s_section(one_tab, S70, out)
    parts["ratemodel"], rate_fit = rate_model_section(rate_rows, rate_missing, plan,
                                                      S70_cal or S70, out)
    calib = (S70_cal["S"] / S70["S"]) if S70_cal and S70 else 1.0
    if map_dir and summ is not None:       # every plan map's toys, with their visible spikes
        more = [map_summary(Path(map_dir).parent / n).assign(map=n)
                for ns in plan_maps(plan, Path(map_dir).name).values() for n in ns
                if n != Path(map_dir).name
                and PMA.has_cells(Path(map_dir).parent / n)]
        summ = pd.concat([summ.assign(map=Path(map_dir).name), *more], ignore_index=True)
        if rate_rows is not None and not rate_rows.empty:
            seen = (rate_rows.groupby(["source", "lr_mult", "b2", "batch_mult"])
                    .agg(visible_spikes=("spikes", "sum"), steps=("steps", "sum")).reset_index()
                    .rename(columns={"source": "map"}))
            summ = summ.merge(seen, on=["map", "lr_mult", "b2", "batch_mult"], how="left")
        summ.to_csv(out / CELLS_FILE, index=False)
    match, matched = None, None
    ref = match_reading(versions, plan)
    if summ is not None and ref is not None:
        s70 = s70_after_warmup(one_tab) if plan["match"].get("s_estimator") == "S_70" else None
        factor = float(plan["match"]["factor"])
        by_reading = {str(v["reading"]): (float(v["S_after"]), match_table(
            summ, reference_70b(pred, float(v["S_after"])), factor, s70))
            for _, v in versions.iterrows() if np.isfinite(v.get("S_after", math.nan))}
        match = by_reading[str(ref["reading"])][1]      # the plan's reading: one of them
        atomic_write_bytes(out / "match.csv", match.to_csv(index=False).encode())
        base = Path(map_dir).name if map_dir else "map"
        test_maps = [map_folder(c, base) for c in plan["match"].get("test", {}).get("maps", [])]
        parts["match"] = match_md(match, plan, str(ref["reading"]), by_reading=by_reading,
                                  test_maps=test_maps)
        tested = tested_cells(match, plan, test_maps)
        if len(tested) and "visible_spikes" in tested:
            matched = {**matched_test(tested, plan["match"].get("test")),
                       "reading": str(ref["reading"]), "S_after_70B": float(ref["S_after"])}
    qc_read = versions[versions["reading"].str.startswith("v5")]
    if not len(qc_read):
        qc_read = versions[versions["reading"].str.contains("plan QC")]
    lam = None
    if len(qc_read) and "lambda_inf" in qc_read and np.isfinite(qc_read["lambda_inf"].iloc[0]):
        lam = qc_read.iloc[0].to_dict()
    record = public_record(plan, lam, rate_fit["models"] if rate_fit else None, calib)
    atomic_write_bytes(out / "public_record.csv", record.to_csv(index=False).encode())
    parts["record"] = record_md(record)
    atomic_write_bytes(out / RECORD_FILE, json.dumps(record_summary(record), indent=1).encode())
    if claims_dir:
        cdf = claims_under_plan(claims_dir, plan)
        atomic_write_bytes(out / "claims.csv", cdf.to_csv(index=False).encode())
    elif (SHIPPED / "claims.csv").exists():
        cdf = pd.read_csv(SHIPPED / "claims.csv")
    else:
        cdf = None
    if cdf is not None:
        parts["claims"] = claims_md(cdf, plan)
    parts["adamw"] = adamw_md()
    parts["open"] = open_items_md(
        plan, label=str(last["label"]) if "label" in last and pd.notna(last["label"]) else None,
        rate=rate_fit, one_s=S70_cal, claims=cdf, match=match, missing_maps=rate_missing)
    text = report(out, plan, parts)
    atomic_write_bytes(out / "science4.md", text.encode())
    summary = {"plan": plan["_path"], "plan_sha256": plan["_sha256"],
               "versions": versions.to_dict("records"),
               "hits": extra["hits"].to_dict("records"),
               "nulls": None if nulls is None else nulls.to_dict("records"),
               "plan_version": int(plan["plan"]["version"]),
               "rate_model": None if rate_fit is None else {
                   k: rate_fit[k] for k in ("verdict", "why", "S_c", "observed", "held_cells",
                                            "train_spikes", "train_dropped_spikes")},
               "S_70b_toy_scale": S70_cal, "matched_toy_test": matched}
    atomic_write_bytes(out / "science4.json", json.dumps(summary, indent=1, default=str).encode())
    return summary


def ship(store_dir: Path, out: Path, dest: Path = SHIPPED) -> list[Path]:
    """Copy the plan's verified sharpness cells and the tables run() wrote into OUT (map
    lanes, map cells, claims) into the package data and add them to its manifest, so the
    standard study re-derives the answer from them."""
    (dest / "cells" / "sharpness_rung").mkdir(parents=True, exist_ok=True)
    written = []
    for cfg, _ in SH.read_cells(store_dir):
        c = cell(cfg["dim"], cfg["layers"], cfg["lr"], cfg["seed"], steps=cfg["steps"],
                 eps=cfg["eps"], eval_tokens=cfg["eval_tokens"], iters=cfg["iters"],
                 start=cfg["start"], track=cfg["track"])
        src = Path(store_dir) / c.kind / f"{c.key}.json"
        shutil.copyfile(src, dest / "cells" / c.kind / src.name)
        written.append(dest / "cells" / c.kind / src.name)
    for f in (LANES_FILE, CELLS_FILE, "claims.csv", RATE_ROWS_FILE, LAW_FILE, ONE_S_FILE,
              RECORD_FILE):
        if (out / f).exists():
            shutil.copyfile(out / f, dest / f)
            written.append(dest / f)
    package_data.add_files("llama2-70b", written, "Science 4's cells and tables "
                           "(adamspike science4 --ship)")
    if (dest / LAW_FILE).exists() and dest == SHIPPED:
        # predictions.json from the law just shipped (predict reads it: simulate.predict._with_law)
        from simulate.predict import main as predict_main
        pred = package_data.predictions_path("llama2-70b")
        if pred is not None:
            # predict never overwrites a predictions file (pre-registration): the shipped one
            # is replaced deliberately, through a new file moved over it
            fresh = pred.with_name(pred.name + ".new")
            fresh.unlink(missing_ok=True)
            if predict_main(["--profile", "llama2-70b", "--out", str(fresh)]):
                raise ConfigError("adamspike predict failed on the shipped data")
            os.replace(fresh, pred)
            package_data.add_files("llama2-70b", [pred], "predictions.json from Science 4's "
                                   "sharpness law under the plan's QC")
            written.append(pred)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adamspike science4", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--compute", action="store_true",
                    help="compute the plan's sharpness cells (missing ones) into --cells")
    ap.add_argument("--cells", help="cell store folder (default: OUT/cells with --compute, "
                                    "else the cells shipped with the package)")
    ap.add_argument("--map", help="phase-map folder with the in-band cells (default: the "
                                  "shipped lanes)")
    ap.add_argument("--claims", help="a finished `adamspike replicate --claims "
                                     "configs/claims_science4.toml` folder (default: the "
                                     "shipped claims table)")
    ap.add_argument("--executor", choices=("local", "ray"),
                    help="where missing cells run (default: $ADAMSPIKE_EXECUTOR, else local)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--address", help="Ray cluster address (with --executor ray)")
    ap.add_argument("--ship", action="store_true",
                    help="copy the computed cells and map lanes into the package data")
    ap.add_argument("--no-progress", action="store_true")

    def body(a) -> int:
        if a.jobs < 1:
            raise ConfigError(f"--jobs: must be >= 1, got {a.jobs}")
        for flag, v in (("--map", a.map), ("--cells", None if a.compute else a.cells),
                        ("--claims", a.claims)):
            if v and not Path(v).is_dir():
                raise ConfigError(f"{flag} {v}: not a directory")
        out = Path(a.out)
        # new, empty or science4's own (a rerun rewrites its files; --compute resumes the
        # cell store under it), writable: refused before anything is computed
        claim_out(check_out(out, owner="science4"), "science4")
        s = run(out, compute=a.compute, cells_dir=Path(a.cells) if a.cells else None,
                map_dir=Path(a.map) if a.map else None, executor=a.executor, jobs=a.jobs,
                address=a.address, progress=not a.no_progress,
                claims_dir=Path(a.claims) if a.claims else None)
        if a.ship:
            ship(Path(a.cells) if a.cells else out / "cells", out)
        print((out / "science4.md").read_text(), end="")
        return 0 if s else 1
    return cli_main(ap, None if argv is None else list(argv), body, "adamspike science4")
