"""A spike-rate model that can say zero, judged on a held-out map against three competitors
(issue "Science 4" item 5; the plan's [rate_model] and [heldout], docs/plan/science4_v2.toml).

Rows. One per lane-phase of a phase map (simulate/phase_map.py writes the lanes): phase
"warmup" = steps 1 .. warmup_steps, "after" = the rest. A row carries its exposure n (steps),
its count k of the plan's VISIBLE spikes (adamspike.spikes on the lane's loss with the
class's parameters; a spike belongs to the phase of its start), the tracker's S (median of
Program.stability's S_t over the phase's evaluations), lr, the median of the cell's four
group eps, and each depth group's median rho.

Models, each a rate per 1000 steps mu_i / (n_i / 1000):

    threshold   exp(b0 + b1 w_i) 1[S_i >= S_c] (S_i / S_c)^g          (can say zero)
    constant    sum k / sum n
    lr_eps      exp(c0 + c1 log10(lr_i / eps_i) + c2 w_i)            (Poisson GLM)
    s_bins      sum k / sum n of the training rows in S_i's bin (plan [rate_model] s_bins;
                a bin without training rows takes the constant rate)

with w the warmup indicator. The GLMs use the project's penalised IRLS
(adamspike.spike_rate.poisson_irls, ridge 0.1 on standardised slopes).

The threshold's maximum-likelihood S_c. For a candidate S_c, rows below it have mu = 0:
a row with k > 0 there makes the likelihood zero, a row with k = 0 contributes log 1 = 0.
Raising S_c removes zero-count rows from the GLM part, which can only raise its maximised
log-likelihood (each such row adds -mu <= 0 at any beta). So the profile likelihood is
non-decreasing in S_c up to the smallest S of a row with k > 0, and infeasible above it:
the MLE is S_c = min{S_i : k_i > 0} (a boundary estimate; its uncertainty comes from the
bootstrap). With no spike in the training rows S_c = inf: the model says zero everywhere.

Intervals: bootstrap by CELL (the resampling unit: lanes of a cell share calibration,
config and batches), `bootstrap_draws` draws, each refitting every model; percentiles.

Held-out judgement (plan [heldout]): the Poisson deviance D = 2 sum [k log(k / mu) - (k -
mu)] of every model on the held-out rows (a row with k > 0 where a model says mu = 0 makes
its D infinite: it fails, never floored); per S bin the observed count against the expected
with the exact Poisson 95 % interval of the observed count divided by the expected, judged
only in bins with >= min_expected_per_bin expected. The model passes when its D is below
every competitor's and every judged bin's interval holds 1; no judged bin: "undetermined".
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from adamspike.spike_rate import RIDGE, poisson_irls
from adamspike.spikes import detect_spikes
from analysis.phase_map import read_cell
from analysis.spike_null import class_params

GROUPS = ("embed", "shallow", "deep", "head")
MODELS = ("threshold", "constant", "lr_eps", "s_bins")


# --------------------------------------------------------------------------- rows
def map_rows(map_dir: Path, plan: Mapping[str, Any], source: str) -> pd.DataFrame:
    """The lane-phase rows of one phase-map folder (module doc), with the cell's in-band
    flag: every group's median rho over the cell's lanes within band_factor of the map's
    targets (the 70B's rho at eps 1e-5)."""
    map_dir = Path(map_dir)
    meta = json.loads((map_dir / "map.json").read_text())
    params = class_params(plan, plan["rate_model"]["spike_class"])
    factor = float(plan["heldout"]["band_factor"])
    targets = meta["targets"]
    rows = []
    for c in meta["cells"]:
        df = read_cell(map_dir, c)           # verified; None: not run yet
        if df is None:
            continue
        cfg = c["config"]
        warm = int(cfg["optim.warmup_steps"])
        eps_med = float(np.median([float(v) for v in c["eps"].values()]))
        cell_rho = {g: float(df[f"rho_{g}"].median()) for g in GROUPS if f"rho_{g}" in df}
        in_band = all(t > 0 and cell_rho.get(g, math.nan) > 0
                      and abs(math.log10(cell_rho[g] / t)) <= math.log10(factor)
                      for g, t in targets.items())
        for seed, d in df.groupby("seed", sort=True):
            d = d.sort_values("step")
            spk = detect_spikes(d["loss"].to_numpy(float), d["step"].to_numpy(np.int64),
                                params=params)
            for phase, sel in (("warmup", d["step"] <= warm), ("after", d["step"] > warm)):
                dp = d[sel]
                lo, hi = int(dp["step"].min()), int(dp["step"].max())
                mine = spk[(spk["start"] >= lo) & (spk["start"] <= hi)]
                S = dp["S"].dropna()
                rows.append({"source": source, "cell": c["id"], "lr_mult": c["lr_mult"],
                             "b2": c["b2"], "batch_mult": c["batch_mult"],
                             "init_std": float(cfg.get("model.init_std") or math.nan),
                             "dim": int(cfg["model.dim"]), "layers": int(cfg["model.num_layers"]),
                             "lr": float(c["lr"]), "eps_median": eps_med, "seed": int(seed),
                             "phase": phase, "warmup": int(phase == "warmup"),
                             "steps": int(len(dp)), "S": float(S.median()) if len(S) else math.nan,
                             "spikes": int(len(mine)),
                             "heights": ";".join(f"{h:.3g}" for h in mine["height"]),
                             "durations": ";".join(str(int(v)) for v in mine["duration"]),
                             **{f"rho_{g}": float(dp[f"rho_{g}"].median()) for g in cell_rho},
                             "cell_in_band": bool(in_band)})
    if not rows:
        raise ValueError(f"{map_dir}: no finished cell")
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- models
NO_FINITE_MLE = ("every training count is 0: the likelihood keeps rising as the intercept "
                 "falls, so the fit has no finite maximum; its limit, rate 0, stands for it")


def _glm(X: np.ndarray, k: np.ndarray, n: np.ndarray) -> dict:
    """Penalised Poisson GLM log mu = log(n / 1000) + c0 + z c (z standardised X). With no
    count above 0 there is no finite maximum (IRLS would walk the intercept down until its
    iteration cap): the model is its limit, rate 0, and says so (`no_finite_mle`)."""
    mean, std = X.mean(0), X.std(0)
    std = np.where(std > 0, std, 1.0)
    if not (np.asarray(k) > 0).any():
        return {"beta": None, "mean": mean.tolist(), "std": std.tolist(),
                "no_finite_mle": NO_FINITE_MLE}
    Z = np.column_stack([np.ones(len(X)), (X - mean) / std])
    beta, H = poisson_irls(Z, k, np.log(n / 1000.0), RIDGE)
    return {"beta": beta.tolist(), "mean": mean.tolist(), "std": std.tolist()}


def _glm_rate(m: Mapping[str, Any], X: np.ndarray) -> np.ndarray:
    if m["beta"] is None:          # no finite MLE: the limit, rate 0
        return np.zeros(len(X))
    Z = np.column_stack([np.ones(len(X)), (X - np.asarray(m["mean"])) / np.asarray(m["std"])])
    return np.exp(np.minimum(Z @ np.asarray(m["beta"]), 700.0))


def _lr_eps_x(rows: pd.DataFrame) -> np.ndarray:
    return np.column_stack([np.log10(rows["lr"] / rows["eps_median"]), rows["warmup"]])


def fit_models(rows: pd.DataFrame, s_bins: Sequence[float]) -> dict:
    """Every model fitted on the training rows (module doc)."""
    k = rows["spikes"].to_numpy(float)
    n = rows["steps"].to_numpy(float)
    S = rows["S"].to_numpy(float)
    const = 1000.0 * k.sum() / n.sum()
    out: dict[str, Any] = {"constant": {"rate": const}}
    spiking = S[k > 0]
    if len(spiking) == 0:
        out["threshold"] = {"S_c": math.inf, "glm": None, "spiking_rows": 0}
    else:
        S_c = float(spiking.min())
        above = S >= S_c
        X = np.column_stack([rows["warmup"].to_numpy(float)[above], np.log(S[above] / S_c)])
        out["threshold"] = {"S_c": S_c, "glm": _glm(X, k[above], n[above]),
                            "rows_above": int(above.sum()), "spiking_rows": int((k > 0).sum())}
    out["lr_eps"] = _glm(_lr_eps_x(rows), k, n)
    edges = np.asarray(s_bins, float)
    b = np.clip(np.digitize(S, edges) - 1, 0, len(edges) - 2)
    out["s_bins"] = {"edges": edges.tolist(),
                     "rate": [1000.0 * k[b == i].sum() / n[b == i].sum() if (b == i).any()
                              else const for i in range(len(edges) - 1)]}
    return out


def rates(models: Mapping[str, Any], rows: pd.DataFrame) -> pd.DataFrame:
    """Each model's rate per 1000 steps on `rows` (columns = MODELS)."""
    S = rows["S"].to_numpy(float)
    out = pd.DataFrame(index=rows.index)
    th = models["threshold"]
    if th["glm"] is None:
        out["threshold"] = 0.0
    else:
        above = S >= th["S_c"]
        r = np.zeros(len(rows))
        X = np.column_stack([rows["warmup"].to_numpy(float)[above], np.log(S[above] / th["S_c"])])
        if above.any():
            r[above] = _glm_rate(th["glm"], X)
        out["threshold"] = r
    out["constant"] = models["constant"]["rate"]
    out["lr_eps"] = _glm_rate(models["lr_eps"], _lr_eps_x(rows))
    edges = np.asarray(models["s_bins"]["edges"])
    b = np.clip(np.digitize(S, edges) - 1, 0, len(edges) - 2)
    out["s_bins"] = np.asarray(models["s_bins"]["rate"])[b]
    return out


def deviance(k: np.ndarray, mu: np.ndarray) -> float:
    """Poisson deviance; inf when a count > 0 meets mu = 0 (module doc)."""
    k, mu = np.asarray(k, float), np.asarray(mu, float)
    if ((mu <= 0) & (k > 0)).any():
        return math.inf
    with np.errstate(divide="ignore", invalid="ignore"):
        term = np.where(k > 0, k * np.log(k / np.where(mu > 0, mu, 1.0)), 0.0)
    return float(2.0 * (term - (k - mu)).sum())


# --------------------------------------------------------------------------- bootstrap
def bootstrap(train: pd.DataFrame, held: pd.DataFrame, s_bins: Sequence[float], draws: int,
              seed: int) -> dict:
    """Cell bootstrap: draws of the training CELLS with replacement, every model refitted;
    per draw S_c and each model's expected held-out count per S bin and in total."""
    cells = train["cell"].unique()
    groups = {c: train.index[train["cell"] == c].to_numpy() for c in cells}
    rng = np.random.default_rng(seed)
    edges = np.asarray(s_bins, float)
    hb = np.clip(np.digitize(held["S"].to_numpy(float), edges) - 1, 0, len(edges) - 2)
    n_h = held["steps"].to_numpy(float) / 1000.0
    S_c, expected = [], {m: [] for m in MODELS}
    for _ in range(int(draws)):
        pick = rng.choice(cells, size=len(cells), replace=True)
        rows = train.loc[np.concatenate([groups[c] for c in pick])].reset_index(drop=True)
        m = fit_models(rows, s_bins)
        S_c.append(m["threshold"]["S_c"])
        r = rates(m, held)
        for name in MODELS:
            mu = r[name].to_numpy() * n_h
            expected[name].append([mu[hb == i].sum() for i in range(len(edges) - 1)] + [mu.sum()])
    return {"S_c": np.asarray(S_c), "expected": {k: np.asarray(v) for k, v in expected.items()}}


# --------------------------------------------------------------------------- judgement
def judge(train: pd.DataFrame, held: pd.DataFrame, plan: Mapping[str, Any],
          seed: int = 0) -> dict:
    """The plan's held-out test (module doc): models, deviances, per-bin table, verdict."""
    rm, ho = plan["rate_model"], plan["heldout"]
    s_bins = rm["s_bins"]
    no_S = ~(np.isfinite(train["S"]) & (train["S"] > 0))
    train_dropped = train[no_S]
    train = train[~no_S].reset_index(drop=True)
    dropped = held[~(np.isfinite(held["S"]) & (held["S"] > 0))]
    held = held[np.isfinite(held["S"]) & (held["S"] > 0)].reset_index(drop=True)
    models = fit_models(train, s_bins)
    r = rates(models, held)
    k = held["spikes"].to_numpy(float)
    n_h = held["steps"].to_numpy(float) / 1000.0
    dev = {m: deviance(k, r[m].to_numpy() * n_h) for m in MODELS}
    boot = bootstrap(train, held, s_bins, int(rm["bootstrap_draws"]), seed)
    edges = np.asarray(s_bins, float)
    hb = np.clip(np.digitize(held["S"].to_numpy(float), edges) - 1, 0, len(edges) - 2)
    level, need = float(ho["level"]), float(ho["min_expected_per_bin"])
    bins = []
    for i in range(len(edges) - 1):
        sel = hb == i
        obs = int(k[sel].sum())
        row = {"S_lo": edges[i], "S_hi": edges[i + 1], "rows": int(sel.sum()), "observed": obs}
        a = 1 - level
        o_lo = stats.chi2.ppf(a / 2, 2 * obs) / 2 if obs > 0 else 0.0
        o_hi = stats.chi2.ppf(1 - a / 2, 2 * obs + 2) / 2
        for m in MODELS:
            e = float((r[m].to_numpy() * n_h)[sel].sum())
            lo, hi = np.percentile(boot["expected"][m][:, i], [5, 95])
            row[f"{m}_expected"] = e
            row[f"{m}_expected_lo"], row[f"{m}_expected_hi"] = float(lo), float(hi)
            if m == "threshold":
                row["judged"] = e >= need
                row["ratio_lo"] = o_lo / e if e > 0 else math.nan
                row["ratio_hi"] = o_hi / e if e > 0 else math.nan
                row["holds"] = bool(e >= need and o_lo / e <= 1.0 <= o_hi / e) if e > 0 else None
        bins.append(row)
    bins = pd.DataFrame(bins)
    judged = bins[bins["judged"]]
    beats = all(dev["threshold"] < dev[m] for m in MODELS if m != "threshold")
    if judged.empty:
        verdict = "undetermined"
        why = (f"fewer than {need:g} visible spikes expected in every S bin of the held-out rows "
               f"(threshold model: {bins['threshold_expected'].sum():.3g} in all)")
    elif beats and bool(judged["holds"].all()):
        verdict, why = "pass", "deviance below every competitor's and every judged bin holds 1"
    else:
        verdict = "fail"
        why = ("deviance not below every competitor's" if not beats else
               "observed/expected outside its Poisson interval in a judged bin")
    sc = boot["S_c"]
    fin = sc[np.isfinite(sc)]
    return {"models": models, "deviance": dev, "bins": bins, "verdict": verdict, "why": why,
            "beats_competitors": beats,
            "S_c": models["threshold"]["S_c"],
            "S_c_boot": {"finite_share": float(len(fin) / len(sc)) if len(sc) else math.nan,
                         "p5": float(np.percentile(fin, 5)) if len(fin) else math.nan,
                         "p50": float(np.percentile(fin, 50)) if len(fin) else math.nan,
                         "p95": float(np.percentile(fin, 95)) if len(fin) else math.nan},
            "total_expected": {m: float(np.sum(r[m].to_numpy() * n_h)) for m in MODELS},
            "total_expected_interval": {m: [float(v) for v in np.percentile(
                boot["expected"][m][:, -1], [5, 95])] for m in MODELS},
            "observed": int(k.sum()), "train_rows": int(len(train)),
            "train_spikes": int(train["spikes"].sum()), "train_cells": int(train["cell"].nunique()),
            "train_dropped_no_S": int(len(train_dropped)),
            "train_dropped_spikes": int(train_dropped["spikes"].sum()),
            "held_rows": int(len(held)), "held_cells": int(held["cell"].nunique()),
            "held_dropped_no_S": int(len(dropped))}
