"""Verdicts and the report of a claims study, from the arms' files (reads files only).

Input: a directory written by simulate.claims (replication.json: claims, arms; arms/<arm>.parquet:
one row per seed with the sweep table's metrics, or one row per seed x step of a tiny-LLaMA
arm, from which per seed: num_spikes (analysis.report.loss_spikes: window 50, 6 MAD, >= 20 %
over the running median), num_spikes_10 (the same at >= 10 %), final_loss (median of the
last 50 losses), rho_<group> (median over the second half)).

One interval method for every row (analysis.stats): seed k of the treatment arm paired with
seed k of the control arm (a one-cell claim: with its reference value, X of at_least, else
0); BCa bootstrap 95 % interval of the mean difference, exact sign test, exact paired
permutation test (p); Holm-Bonferroni over the tested rows (p_holm). One verdict function
(`verdict`, rules: adamspike.claims.RULES):

    decrease / increase   supported if the interval lies on the claimed side of 0 and
                          p_holm < 0.05; "not supported" if on the other side with p_holm <
                          0.05, or when no seed changed (every difference 0, metric non-zero);
                          inconclusive otherwise, and when the metric is 0 in every run of
                          both arms (nothing to compare: not tested, no p)
    removes               as decrease, and every treatment run at 0; "not supported" if the
                          treatment's mean interval lies above 0 (spikes remain)
    weak                  supported if the interval lies inside +-0.5 x the control mean;
                          not supported if outside; inconclusive otherwise
    at_least X            the mean's interval above X with p_holm < 0.05 (below: not supported)
    within [a, b]         the mean's interval inside [a, b]; disjoint: not supported
    fewer than 10 values  inconclusive (only_spiking rows count the runs with spikes)

Rows on per-step arms with metric num_spikes also get the equal-progress comparison
(analysis.stats.equal_progress). The arms table (`arms_table`) is the mechanism check: the
mean per seed of each arm's metrics (rho per group), so a null result is not a setting that
did nothing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd

from adamspike.claims import MIN_SEEDS
from adamspike.cells import CellStore
from adamspike.tables import md_table
from adamspike.spikes import SpikeParams, loss_spikes
from analysis.stats import bca_interval, correct_rows, equal_progress, paired_test

ALPHA = 0.05
FINAL_WINDOW = 50
COLUMNS = ["id", "source", "claim", "base", "experiment", "metric", "rule", "n_seeds",
           "control_mean", "treatment_mean", "effect", "ci_low", "ci_high", "ci_method", "p",
           "sign_p", "p_holm", "verdict", "equal_progress", "note"]
CI_METHOD = "BCa bootstrap (paired seeds); exact permutation p"


def load(study: str | Path) -> tuple[dict, dict[str, pd.DataFrame]]:
    """(replication.json, {arm: its table}); ValueError naming what is missing."""
    study = Path(study)
    try:
        meta = json.loads((study / "replication.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{study}: not a replication study ({e})") from None
    arms, store = {}, CellStore(study / "cells")
    for a, m in meta["arms"].items():
        try:
            arms[a] = store.read(m["cell"]["kind"], m["cell"]["key"])["rows"]
        except (KeyError, TypeError):
            raise ValueError(f"{study}: arm {a} names no cell (a study from before the "
                             "one cell store; rerun `adamspike replicate`)") from None
        except ValueError as e:              # CorruptCell (a ValueError) names the file
            raise ValueError(f"{e} (arm {a}; rerun `adamspike replicate` with the same "
                             "--out to resume)") from None
    return meta, arms


def seed_steps(table: pd.DataFrame) -> dict[int, pd.DataFrame]:
    """Per seed the steps table (step, loss) the spike detectors read."""
    return {int(k): g[["step", "loss"]].reset_index(drop=True)
            for k, g in table.sort_values(["seed", "step"]).groupby("seed")}


def study_rule(spike_k: float | None) -> SpikeParams:
    """The claims' spike rule: the project's, at the study's MAD multiple `[study] spike_k`
    when it sets one."""
    return SpikeParams.from_table({} if spike_k is None else {"k": spike_k})


def seed_metrics(table: pd.DataFrame, spike_k: float | None = None) -> pd.DataFrame:
    """One row per seed, indexed by seed: the sweep rows as they are, or from a per-step
    arm num_spikes, num_spikes_10, final_loss, rho_<group> (module doc; spike_k: the
    study's MAD multiple, `[study] spike_k`, else the project's)."""
    if "step" not in table:
        return table.set_index("seed")
    rule = study_rule(spike_k)
    rows = []
    rho_cols = [c for c in table.columns if c.startswith("rho_")]
    for k, st in seed_steps(table).items():
        full = table[table["seed"] == k]
        late = full[full["step"] > full["step"].max() // 2]
        rows.append({"seed": k, "num_spikes": len(loss_spikes(st, rule)[0]),
                     "num_spikes_10": len(loss_spikes(st, rule.replace(min_rel_jump=0.1))[0]),
                     "final_loss": float(np.median(st["loss"].to_numpy()[-FINAL_WINDOW:])),
                     **{c: float(np.median(late[c])) for c in rho_cols}})
    return pd.DataFrame(rows).set_index("seed")


def verdict(rule: str, arg: Any, r: Mapping[str, Any], trt: np.ndarray,
            ctl: np.ndarray | None) -> str:
    """The one verdict function (module docstring); r: ci_low, ci_high, p_holm and, for
    removes, treatment_ci_low."""
    lo, hi, p = r["ci_low"], r["ci_high"], r["p_holm"]
    sig = bool(p < ALPHA)
    if ctl is not None and rule != "weak":
        if not (np.any(ctl) or np.any(trt)):
            return "inconclusive: metric 0 in every run of both arms"
        if np.all(trt == ctl):
            return "not supported: no change in any seed"
    if rule in ("decrease", "increase", "removes"):
        down = rule != "increase"
        if (hi < 0 if down else lo > 0) and sig and (rule != "removes" or not np.any(trt)):
            return "supported"
        if rule == "removes" and r["treatment_ci_low"] > 0:
            return "not supported (spikes remain)"
        if (lo > 0 if down else hi < 0) and sig:
            return "not supported (opposite direction)"
        return "inconclusive"
    if rule == "weak":
        base = float(np.mean(ctl))
        if base == 0:
            return "inconclusive: metric 0 in the control arm"
        a, b = -0.5 * base, 0.5 * base
    elif rule == "at_least":
        return "supported" if lo > arg and sig else "not supported" if hi < arg and sig else "inconclusive"
    else:
        a, b = arg
    return "supported" if a < lo and hi < b else "not supported" if hi <= a or lo >= b else "inconclusive"


def _row(c: Mapping[str, Any], meta: Mapping[str, Any], metrics: Mapping[str, pd.DataFrame],
         steps: Mapping[str, dict]) -> dict:
    arms = meta["arms"]
    ta, ca = c.get("treatment_arm"), c.get("control_arm")
    exp = c["experiment"] or (f"{arms[ca]['label']} -> {arms[ta]['label']}" if ca and ta
                              else arms[ta]["label"] if ta else "")
    row = {"id": c["id"], "source": c["source"], "claim": c["claim"], "base": c["base"],
           "experiment": exp, "metric": c["metric"], "rule": c["rule_text"],
           "ci_method": CI_METHOD, "verdict": "inconclusive", "note": c["note"], "_rule": c["rule"]}
    if c["not_run"]:
        return {**row, "n_seeds": 0, "ci_method": "", "note": c["not_run"]}
    mt = metrics[ta]
    mc = metrics[ca] if ca else None
    seeds = sorted(set(mt.index) & (set(mc.index) if mc is not None else set(mt.index)))
    t = mt.loc[seeds, c["metric"]].to_numpy(float)
    if c["only_spiking"]:
        t = t[(mt.loc[seeds, "num_spikes"] > 0).to_numpy() & np.isfinite(t)]
    notes = [c["note"]] if c["note"] else []
    for m in c["also"]:
        vals = [f"{n} {float(df.loc[seeds, m].astype(float).mean()):.4g}"
                for n, df in (("control", mc), ("treatment", mt)) if df is not None and m in df]
        notes += [f"{m}: " + ", ".join(vals)] if vals else []
    row["note"] = "; ".join(notes)
    ref = float(c["arg"]) if c["rule"] == "at_least" else 0.0
    k = mc.loc[seeds, c["metric"]].to_numpy(float) if mc is not None else np.full(len(t), ref)
    row.update(n_seeds=len(t), treatment_mean=float(np.mean(t)) if len(t) else math.nan,
               control_mean=float(k.mean()) if mc is not None else math.nan, _t=t,
               _c=k if mc is not None else None)
    if len(t) < MIN_SEEDS:
        return {**row, "note": "; ".join(notes + [f"{len(t)} values (< {MIN_SEEDS}): not tested"])}
    res = paired_test(t, k)
    shift = ref if mc is None else 0.0
    row.update(effect=res.mean_diff + shift, ci_low=res.ci_low + shift, ci_high=res.ci_high + shift,
               sign_p=res.sign_p, p=res.p, note="; ".join(notes + ([res.note] if res.note else [])),
               treatment_ci_low=bca_interval(t, np.zeros_like(t))[0] if c["rule"] == "removes" else math.nan)
    if c["rule"] in ("within", "weak") or (mc is not None and not (t.any() or k.any())):
        row["p"] = math.nan    # no test of mean 0 behind these verdicts: not in Holm's m
    if mc is not None and c["metric"] == "num_spikes" and ta in steps and ca in steps:
        ep = equal_progress([steps[ca][s] for s in seeds], [steps[ta][s] for s in seeds])
        row["equal_progress"] = ep.verdict
    return row


def claims_table(meta: Mapping[str, Any], arms: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per claim (COLUMNS), Holm over the tested rows, the verdicts."""
    metrics = {a: seed_metrics(t, meta.get("spike_k")) for a, t in arms.items()}
    steps = {a: seed_steps(t) for a, t in arms.items() if "step" in t}
    table = pd.DataFrame([_row(c, meta, metrics, steps) for c in meta["claims"]])
    for col in COLUMNS + ["_t", "_c", "treatment_ci_low"]:
        if col not in table:
            table[col] = math.nan
    table = correct_rows(table, "p", ALPHA)
    table["verdict"] = [verdict(r["_rule"], c["arg"], r, r["_t"], r["_c"])
                        if isinstance(r["_t"], np.ndarray) and r["n_seeds"] >= MIN_SEEDS else r["verdict"]
                        for (_, r), c in zip(table.iterrows(), meta["claims"])]
    return table[COLUMNS]


def arms_table(meta: Mapping[str, Any], arms: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """Per arm: base, label, seeds and the mean per seed of the claims' metrics and rho."""
    used = {m for c in meta["claims"] for m in (c["metric"], *c["also"])}
    rows = []
    for a, t in arms.items():
        m = seed_metrics(t, meta.get("spike_k"))
        cols = [c for c in m.columns if c in used or c.startswith("rho_") or c == "num_spikes_10"]
        rows.append({"arm": meta["arms"][a]["label"], "base": meta["arms"][a]["base"], "seeds": len(m),
                     **{c: float(pd.to_numeric(m[c], errors="coerce").mean()) for c in cols}})
    return pd.DataFrame(rows)


def report_md(study: str | Path) -> tuple[str, pd.DataFrame]:
    """(markdown, claims table) of a finished study: the one report writer."""
    meta, arms = load(study)
    table = claims_table(meta, arms)
    lines = [f"# {meta['title']}", "", meta["description"], ""]
    for name, cal in meta.get("calibration", {}).items():
        lines += [f"Base {name}: per-group eps calibrated so each group's rho = rms(consumed "
                  "gradient) / eps sits at the LLaMA2-70B's ladder estimate at eps 1e-5: " + ", ".join(
                      f"{g} target {cal['targets'].get(g, math.nan):.3g}, eps {e:.3g}, pilot "
                      f"{cal.get('rho', cal['rounds'][-1]['rho']).get(g, math.nan):.3g}"
                      for g, e in cal["eps"].items())
                  + " (reached by the arms: the arms table).", ""]
    rule = study_rule(meta.get("spike_k"))
    lines += [f"Spike rule (num_spikes; num_spikes_10 at a 10 % jump): {rule.describe()}"
              + (" (the study's spike_k)" if meta.get("spike_k") is not None else "") + ".", ""]
    lines += [f"{len(meta['seeds'])} paired seeds per arm. Per claim: treatment - control per "
              "seed (one-cell claims: the value against the rule's reference); BCa bootstrap 95 % "
              "interval of the mean difference, exact paired permutation p, exact sign p, "
              f"{table.attrs.get('multiplicity', 'Holm-Bonferroni')} (p_holm). Verdict rules: "
              "the rule column and analysis/claims.py.", "",
              md_table(table, ["id", "claim", "base", "experiment", "metric", "control_mean",
                               "treatment_mean", "effect", "ci_low", "ci_high", "n_seeds", "p",
                               "sign_p", "p_holm", "verdict", "equal_progress", "rule", "note"],
                       max_rows=None), "",
              "Verdicts: " + ", ".join(f"{k}: {v}" for k, v in table["verdict"].value_counts().items()),
              "", "## Arms: what each arm moved (mean per seed)", "",
              md_table(arms_table(meta, arms), max_rows=None), ""]
    return "\n".join(lines), table
