"""The replication table in the matched regime, from the arms' files (reads files only).

Input: a directory written by simulate.matched_replication (replication.json: calibration,
arms, claims, seeds; arms/<arm>.parquet: per seed and step loss, grad_norm, update_norm and
rho per depth group). Per arm and seed:

    num_spikes       loss spikes by the report's rule (analysis.report.loss_spikes: window
                     50, 6 MAD, >= 20 % over the running median)
    num_spikes_10    the same detector at >= 10 % (the smaller jumps of the toys)
    final_loss       trailing median of the last 50 losses
    rho_<group>      median rho of the group over the second half of the run

Per claim (treatment arm vs control arm, seed k paired with seed k): the paired tests of
analysis.stats (BCa interval of the mean difference, exact sign test, exact paired
permutation test) on num_spikes, Holm-Bonferroni over the claims, and the equal-progress
comparison (analysis.stats.equal_progress: spikes before the pair's common loss target and
the final loss). Verdicts:

    decrease / increase   supported if the interval lies on the claimed side of 0 and the
                          Holm-adjusted p < 0.05; not supported if it lies on the other side
                          with p_holm < 0.05; inconclusive otherwise, and "no spikes" when
                          both arms have 0 spikes in every seed (nothing to reduce: the claim
                          cannot be tested in this regime at this length)
    weak                  supported if the interval of the mean difference lies inside
                          +-0.5 x the control mean; not supported if it lies outside;
                          inconclusive otherwise (and "no spikes" as above)

Mechanism rows check that each arm moved what it was meant to move (rho per group against
the base arm, paired), so a null result is not a setting that did nothing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd

from analysis.report import SpikeParams, loss_spikes, md_table
from analysis.stats import MIN_SEEDS, equal_progress, paired_test, correct_rows

ALPHA = 0.05
FINAL_WINDOW = 50


def load(study: str | Path) -> tuple[dict, dict[str, pd.DataFrame]]:
    """(replication.json, {arm: its table}); ValueError naming what is missing."""
    study = Path(study)
    try:
        meta = json.loads((study / "replication.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{study}: not a matched replication ({e})") from None
    arms = {}
    for a in meta["arms"]:
        path = study / "arms" / f"{a['name']}.parquet"
        if not path.exists():
            raise ValueError(f"{path}: missing (the study did not finish; rerun "
                             "`adamspike replicate matched` with the same --out to resume)")
        arms[a["name"]] = pd.read_parquet(path)
    return meta, arms


def seed_steps(table: pd.DataFrame) -> dict[int, pd.DataFrame]:
    """Per seed the steps table (step, loss) the spike detectors read."""
    return {int(k): g[["step", "loss"]].reset_index(drop=True)
            for k, g in table.sort_values(["seed", "step"]).groupby("seed")}


def seed_metrics(table: pd.DataFrame) -> pd.DataFrame:
    """One row per seed: num_spikes, num_spikes_10, final_loss, rho_<group> (module doc)."""
    rows = []
    rho_cols = [c for c in table.columns if c.startswith("rho_")]
    for k, st in seed_steps(table).items():
        full = table[table["seed"] == k]
        late = full[full["step"] > full["step"].max() // 2]
        sp20 = loss_spikes(st, SpikeParams())[0]
        sp10 = loss_spikes(st, SpikeParams(min_rel_jump=0.1))[0]
        rows.append({"seed": k, "num_spikes": len(sp20), "num_spikes_10": len(sp10),
                     "final_loss": float(np.median(st["loss"].to_numpy()[-FINAL_WINDOW:])),
                     **{c: float(np.median(late[c])) for c in rho_cols}})
    return pd.DataFrame(rows).set_index("seed")


def _verdict(rule: str, r: Mapping[str, Any], control: np.ndarray, treatment: np.ndarray) -> str:
    if not (control.any() or treatment.any()):
        return "inconclusive: no spikes in either arm"
    lo, hi, p = r["ci_low"], r["ci_high"], r["p_holm"]
    if rule in ("decrease", "increase"):
        sign = -1 if rule == "decrease" else 1
        if (hi < 0 if sign < 0 else lo > 0) and p < ALPHA:
            return "supported"
        if (lo > 0 if sign < 0 else hi < 0) and p < ALPHA:
            return "not supported (opposite direction)"
        return "inconclusive"
    base = float(control.mean())
    if base == 0:
        return "inconclusive: no spikes in the control arm"
    if -0.5 * base < lo and hi < 0.5 * base:
        return "supported"
    if hi <= -0.5 * base or lo >= 0.5 * base:
        return "not supported"
    return "inconclusive"


def _rho_text(m: pd.DataFrame, groups: list[str]) -> str:
    return "/".join(f"{m[f'rho_{g}'].median():.3g}" for g in groups)


def arm_metrics(arms: Mapping[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """`seed_metrics` of every arm."""
    return {a: seed_metrics(t) for a, t in arms.items()}


def claims_table(meta: Mapping[str, Any], arms: Mapping[str, pd.DataFrame],
                 metrics: Mapping[str, pd.DataFrame] | None = None) -> pd.DataFrame:
    """One row per claim: regime, n_seeds, the paired test, interval, Holm p, verdict and
    the equal-progress comparison (metrics: `arm_metrics(arms)` when already computed)."""
    metrics = arm_metrics(arms) if metrics is None else metrics
    steps = {a: seed_steps(t) for a, t in arms.items()}
    groups = [c[4:] for c in next(iter(metrics.values())).columns if c.startswith("rho_")]
    rows = []
    for c in meta["claims"]:
        mc, mt = metrics[c["control"]], metrics[c["treatment"]]
        seeds = sorted(set(mc.index) & set(mt.index))
        ctl, trt = mc.loc[seeds, "num_spikes"].to_numpy(float), mt.loc[seeds, "num_spikes"].to_numpy(float)
        res = paired_test(trt, ctl, min_seeds=MIN_SEEDS)
        ep = equal_progress([steps[c["control"]][k] for k in seeds],
                            [steps[c["treatment"]][k] for k in seeds], min_seeds=MIN_SEEDS)
        rows.append({
            "id": c["id"], "source": c["source"], "claim": c["claim"],
            "experiment": f"{c['control']} -> {c['treatment']}",
            "regime": (f"matched; rho {'/'.join(g[:1] for g in groups)} "
                       f"{_rho_text(mc.loc[seeds], groups)} -> {_rho_text(mt.loc[seeds], groups)}"),
            "rule": c["rule"], "n_seeds": len(seeds), "steps": int(arms[c["control"]]["step"].max()),
            "control_spikes": float(ctl.mean()), "treatment_spikes": float(trt.mean()),
            "spikes_10pct": f"{mc.loc[seeds, 'num_spikes_10'].mean():.3g} -> "
                            f"{mt.loc[seeds, 'num_spikes_10'].mean():.3g}",
            "mean_diff": res.mean_diff, "ci_low": res.ci_low, "ci_high": res.ci_high,
            "sign_p": res.sign_p, "p": res.p, "test": "paired permutation (exact); BCa interval",
            "final_loss": f"{mc.loc[seeds, 'final_loss'].mean():.4g} -> {mt.loc[seeds, 'final_loss'].mean():.4g}",
            "equal_progress": ep.verdict, "note": res.note,
            "_ctl": ctl, "_trt": trt})
    table = correct_rows(pd.DataFrame(rows), "p", ALPHA)
    table["verdict"] = [_verdict(r["rule"], r, r["_ctl"], r["_trt"]) for _, r in table.iterrows()]
    return table.drop(columns=["_ctl", "_trt"])


def mechanism_table(meta: Mapping[str, Any], arms: Mapping[str, pd.DataFrame],
                    base: str = "base", metrics: Mapping[str, pd.DataFrame] | None = None
                    ) -> pd.DataFrame:
    """Per arm against the base arm: median rho per group (late half) and final loss,
    paired ratio / difference with its BCa interval for the shallow rho and the loss."""
    metrics = arm_metrics(arms) if metrics is None else metrics
    mb = metrics[base]
    groups = [c[4:] for c in mb.columns if c.startswith("rho_")]
    rows = []
    for a, m in metrics.items():
        seeds = sorted(set(m.index) & set(mb.index))
        row = {"arm": a, "description": next((x.get("description", "") for x in meta["arms"]
                                              if x["name"] == a), "")}
        for g in groups:
            row[f"rho_{g}"] = float(m.loc[seeds, f"rho_{g}"].median())
        row["final_loss"] = float(m.loc[seeds, "final_loss"].mean())
        row["spikes"] = int(m.loc[seeds, "num_spikes"].sum())
        row["spikes_10pct"] = int(m.loc[seeds, "num_spikes_10"].sum())
        if a != base and "rho_shallow" in m:
            r = paired_test(np.log10(m.loc[seeds, "rho_shallow"]), np.log10(mb.loc[seeds, "rho_shallow"]),
                            min_seeds=MIN_SEEDS)
            row["log10_rho_shallow_vs_base"] = f"{r.mean_diff:+.3g} [{r.ci_low:.3g}, {r.ci_high:.3g}]"
            r = paired_test(m.loc[seeds, "final_loss"], mb.loc[seeds, "final_loss"], min_seeds=MIN_SEEDS)
            row["final_loss_vs_base"] = f"{r.mean_diff:+.3g} [{r.ci_low:.3g}, {r.ci_high:.3g}]"
        rows.append(row)
    return pd.DataFrame(rows)


def report_md(study: str | Path) -> tuple[str, pd.DataFrame]:
    """(markdown, claims table) of a finished study."""
    meta, arms = load(study)
    metrics = arm_metrics(arms)   # spike detection once per arm and seed
    table = claims_table(meta, arms, metrics)
    mech = mechanism_table(meta, arms, metrics=metrics)
    spec, cal = meta["spec"], meta["calibration"]
    groups = list(cal["eps"])
    reached = mech.loc[mech["arm"] == "base"].iloc[0]
    base = meta["base"]
    lines = [
        "# Replication in the matched regime", "",
        f"Tiny LLaMA dim {base['model.dim']}, {base['model.num_layers']} layers, Zipf-Markov "
        f"vocab {base['model.vocab_size']} (exponent {base['data.zipf_exponent']}), "
        f"batch {base['train.global_batch_size']} x {base['train.seq_len']} tokens, AdamW "
        f"b1 {base['optim.b1']} b2 {base['optim.b2']}, wd {base['optim.weight_decay']}, clip "
        f"{base['optim.grad_clip']}, lr {base['optim.lr']:g} warmup {base['optim.warmup_steps']} "
        f"+ {base['optim.schedule']}, {base['train.dtype']} compute; {spec['num_steps']} steps, "
        f"{spec['seeds']} paired seeds per arm, one vmapped program per arm (simulate.seeds).", "",
        "Per-group eps calibrated so each group's rho = rms(consumed gradient) / eps sits at the "
        "LLaMA2-70B's ladder estimate at eps 1e-5: " + ", ".join(
            f"{g} target {cal['targets'].get(g, math.nan):.3g}, eps {cal['eps'][g]:.3g}, "
            f"reached {reached[f'rho_{g}']:.3g}" for g in groups) + ".", "",
        "Claims: paired differences (treatment - control) of the number of loss spikes per "
        "run (>= 20 % rule); BCa 95 % interval, exact paired permutation p, exact sign p, "
        f"Holm-Bonferroni over the {len(table)} rows (p_holm). equal_progress: spikes before "
        "the pair's common loss target and the final loss (analysis.stats).", "",
        md_table(table, ["id", "claim", "experiment", "regime", "n_seeds", "steps",
                         "control_spikes", "treatment_spikes", "spikes_10pct", "mean_diff",
                         "ci_low", "ci_high", "p", "sign_p", "p_holm", "verdict",
                         "final_loss", "equal_progress"]), "",
        "Verdicts: " + ", ".join(f"{k}: {v}" for k, v in table["verdict"].value_counts().items()),
        "", "## Mechanism check: what each arm moved (vs base, paired over seeds)", "",
        md_table(mech, list(mech.columns)), ""]
    return "\n".join(lines), table
