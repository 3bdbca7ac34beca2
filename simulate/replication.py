"""`adamspike sweep replicate`: test each literature claim on spiking toy problems.

    adamspike sweep replicate --out DIR [--quick] [--seeds 5]

One row per claim (DIR/replication.csv, replication.md): the claim and its source, the
experiment (problem and settings: a control and a treatment cell, or one cell), the
per-seed metric, the measured effect at toy scale with a 95% confidence interval over the
seeds, and a verdict by the row's stated rule.

Problems (simulate.sweep_problems, real runs through `simulate.sweep.run_cells`, resumable
under DIR/cells/):
  mlp        Bai's 2-layer FNN on sin x + sin 4x (simulate.mlp "sin"), full batch unless
             stated, lr 1e-2, b = (0.9, 0.999), eps 1e-8: it spikes tens of times per run.
  mlp_deep   a 4 x 64 tanh MLP (simulate.mlp "deep", init gain 0.5): gradients shrink toward
             the input, so the first layer is the "shallow layer" nearest eps.
  quadratic  1/2 theta^2 (simulate.quadratic), lr 1e-2, gradient noise 1e-9 (so seeds
             differ), eps* = 2.63e-4.
  llama      the JAX tiny LLaMA (simulate.llama_train, configs/toy_spike.toml: copy task, lr
             1e-2, b2 0.999, eps 1e-8, no clipping), 1500 steps; runs one after another,
             ~40 s each on one core. Full replication only: its two claims share the
             control cell, so 3 cells x 5 seeds = 15 runs, measured 602 s (5 seeds). Spikes
             are late and rare (control seeds 0-4: 0, 2, 1, 0, 0 spikes, first at steps 826
             and 1310; seed 3 never learns the copy task, final loss 2.96), so shorter runs
             would leave the control with nothing to remove or reduce. In --quick (CI) the
             two llama rows say "not run" (verdict inconclusive): even a 1-seed version costs
             minutes, not the < 20 s --quick can spare.
Each claim is tested where the toy problems spike; the seed report's own setting (b2 = 0.95)
does not spike in these toys, so its eps claims are tested at b2 = 0.999 (said per row).

The llama rows:
  report.glm_shrink  embed_grad_shrink 0.1 (x = a*x + (1-a)*x.detach() on the embedding
             output, GLM-130B) vs 1. Measured (5 seeds): spikes 0.6 -> 0.4 per run, difference
             -0.2, CI [-1.0, 0.6]: inconclusive (too few spikes in either arm); the shrink
             did make seed 3 learn (final loss 2.96 -> 2.08).
  report.batch_skip  the trainer's spike guard (simulate.guard, the torch trainer's policy:
             online analysis.spikes detector window 50, k 6, +20%; roll back to the last
             good in-memory snapshot, one every 25 steps; skip max(200, batches read since
             the snapshot) batches; <= 3 rollbacks per incident, then abort) vs no guard.
             "Avoids the spike" is measured on the kept trace (rolled-back steps replaced by
             their re-runs, as the run directory holds them) with the same detector: it is
             0 by construction unless the guard gives up (an abort puts its spike back into
             the trace), so the row tests whether rollback + skip ends every incident within
             the retries, against the spikes the control keeps; the note adds the final
             loss (did skipping cost training?) and the rollbacks per run (did the spike
             recur after a rollback?). Measured (5 seeds): 0.6 -> 0 spikes, difference -0.6,
             CI [-1.4, 0.0]: inconclusive, because 3 of 5 control seeds never spike. The
             guard fired where the control spikes: seed 1 at step 1310 (rolled back to 1300,
             no spike after); seed 2 at 826 (back to 800), and the spike recurred at 838 on
             the new batches (back to 825), none after: 3 rollbacks in 2 incidents, no abort.
             The final loss was unchanged (2.264 vs 2.267 mean), and bumps below the +20%
             threshold stay in the kept trace (max loss after step 300: 2.33 and 2.40 over a
             ~2.085 baseline). In this toy the data are i.i.d. synthetic sequences and the
             spike is the optimizer's (b2 = 0.999 second-moment lag), so skipping batches only
             re-rolls the data order; nothing here says the skipped batches were bad.

Confidence intervals: percentile bootstrap, 2000 resamples (seeded): of the difference of
means (treatment - control; seeds resampled within each arm), of a relative difference
((treatment - control) / control mean) for "weak" claims, or of the mean for one-cell claims.
Verdict rules (`RULES`):
  decrease / increase  supported if the CI excludes 0 in the claimed direction; not supported
                       if it excludes 0 in the other direction or every seed of both arms
                       gives the same non-zero value; else inconclusive (also when the metric
                       is 0 in every run of both arms: nothing to compare).
  removes              supported if every treatment run has the metric at 0 and the
                       difference CI is < 0; not supported if the CI of the treatment mean
                       lies above 0 (spikes remain); else inconclusive.
  weak                 supported if the relative CI lies inside (-0.5, 0.5); not supported if
                       it lies outside; else inconclusive.
  at_least X           supported if CI low > X; not supported if CI high < X; else inconclusive.
  within [a, b]        supported if the CI lies inside; not supported if disjoint; else
                       inconclusive.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from adamspike.config import ConfigError

NUM_BOOT = 2000
RULES = {
    "decrease": "CI of (treatment - control) entirely < 0",
    "removes": "every treatment run at 0 and CI of (treatment - control) entirely < 0",
    "increase": "CI of (treatment - control) entirely > 0",
    "weak": "CI of (treatment - control) / control inside (-0.5, 0.5)",
    "at_least": "CI of the mean entirely > {x}",
    "within": "CI of the mean inside [{a}, {b}]",
}
COLUMNS = ["id", "source", "claim", "problem", "experiment", "metric", "rule", "n_seeds",
           "control_mean", "treatment_mean", "effect", "ci_low", "ci_high", "ci_method",
           "verdict", "note"]


@dataclass
class Claim:
    id: str
    source: str
    claim: str
    problem: str                       # "mlp" | "quadratic" | "llama"
    metric: str                        # a sweep-table column
    rule: str                          # key of RULES
    treatment: dict                    # cell overrides on the problem's base
    control: dict | None = None        # None: one-cell claim
    experiment: str = ""
    arg: Any = None                    # X for at_least, (a, b) for within
    only_spiking: bool = False         # one-cell metric over runs with >= 1 spike
    note: str = ""
    base: str = ""                     # key of base_cells (default: the problem)
    also: tuple[str, ...] = ()         # more sweep-table columns: arm means go in the note


def base_cells(quick: bool) -> dict[str, dict]:
    """Base settings of each problem (full parameter dicts are filled in by the problem)."""
    mlp = {"kind": "sin", "width": 64 if quick else 128, "steps": 2000 if quick else 4000,
           "lr": 1e-2, "eps": 1e-8, "b1": 0.9, "b2": 0.999}
    quad = {"steps": 20000, "lr": 1e-2, "eps": 1e-8, "b2": 0.999,
            "noise": 1e-9}
    deep = {"kind": "deep", "width": 32 if quick else 64, "depth": 4, "init_gain": 0.5,
            "steps": 1000 if quick else 4000, "lr": 1e-2, "eps": 1e-8, "b1": 0.9, "b2": 0.999}
    bases = {"mlp": mlp, "mlp_deep": deep, "quadratic": quad}
    if not quick:   # ~40 s per run on one core: not in --quick (see the module docstring)
        bases["llama"] = {"steps": LLAMA_STEPS, "b2": 0.999, "eps": 1e-8, "lr": 1e-2}
    return bases


LLAMA_STEPS = 1500
GUARD_NOTE = ("num_spikes counts spikes in the kept trace (rolled-back steps replaced by their "
              "re-runs; an abort puts its spike back), with the detector the guard runs online, "
              "so it is 0 by construction unless the guard gives up: the row tests whether "
              "rollback + skip ends every incident within the retries")


def claims() -> list[Claim]:
    b2note = "the report's b2 = 0.95 does not spike in this toy; tested at b2 = 0.999"
    return [
        Claim("report.shallow_eps", "seed report (LLaMA2-70B); Molybog 2023",
              "shallow-layer gradients near eps are tied to spikes", "mlp", "num_spikes",
              "increase", {"eps": 3e-4}, {"eps": 1e-8},
              "eps 1e-8 -> 3e-4 moves the first layer from rho ~ 3e4 to rho ~ 1", note=b2note),
        Claim("report.shallow_eps_deep", "seed report (LLaMA2-70B); Molybog 2023",
              "shallow-layer gradients near eps are tied to spikes (deep net)", "mlp",
              "num_spikes", "increase", {"eps": 1e-4}, {"eps": 1e-8},
              "deep tanh MLP (4 x 64, init gain 0.5: the first layer has the smallest "
              "gradients); eps 1e-8 -> 1e-4 moves it from rho ~ 2e4 to rho ~ 1", base="mlp_deep",
              note=b2note),
        Claim("report.batch_weak", "seed report", "batch size affects spikes only weakly", "mlp",
              "num_spikes", "weak", {"batch": 32}, {"batch": 0},
              "full batch (256 points) -> minibatch 32"),
        Claim("report.lower_eps", "seed report", "lowering eps alone avoids spikes", "mlp",
              "num_spikes", "removes", {"eps": 1e-8}, {"eps": 1e-5}, "eps 1e-5 -> 1e-8",
              note=b2note),
        Claim("report.eps_lower_b2", "seed report", "changing eps and lowering b2 avoids spikes",
              "mlp", "num_spikes", "removes", {"eps": 1e-8, "b2": 0.95}, {"eps": 1e-5},
              "(eps 1e-5, b2 0.999) -> (eps 1e-8, b2 0.95)"),
        Claim("report.recovers", "seed report", "the loss recovers after a spike", "mlp",
              "recovered_frac", "at_least", {}, None, "baseline (spiking) runs", arg=0.5,
              only_spiking=True),
        Claim("report.batch_skip", "seed report; PaLM", "rollback + skipping batches avoids the spike",
              "llama", "num_spikes", "removes", {"guard": True}, {},
              "tiny LLaMA (configs/toy_spike.toml, 1500 steps): spike guard off -> on (online "
              "detector window 50, k 6, +20%; roll back to the last good in-memory snapshot, "
              "every 25 steps; skip 200 batches; <= 3 retries per incident)",
              note=GUARD_NOTE, also=("final_loss", "guard_rollbacks", "guard_aborted")),
        Claim("report.lower_lr", "seed report", "a lower learning rate reduces spikes", "mlp",
              "num_spikes", "decrease", {"lr": 3e-3}, {}, "lr 1e-2 -> 3e-3"),
        Claim("report.glm_shrink", "seed report; GLM-130B", "GLM embedding-gradient shrink (a=0.1) helps",
              "llama", "num_spikes", "decrease", {"embed_grad_shrink": 0.1}, {},
              "tiny LLaMA (configs/toy_spike.toml, 1500 steps): embed_grad_shrink 1 -> 0.1",
              also=("final_loss", "max_spike_height")),
        Claim("molybog.bimodal", "Molybog 2023", "r turns bimodal (BC > 5/9) before spikes", "mlp",
              "pre_bimodality", "at_least", {}, None,
              "max BC of layers.0.weight in the 8 steps before each spike", arg=5 / 9,
              only_spiking=True),
        Claim("molybog.large_batch", "Molybog 2023", "larger batches give more spikes", "mlp",
              "num_spikes", "increase", {"batch": 0}, {"batch": 32}, "minibatch 32 -> full batch 256"),
        Claim("wortsman.lead", "Wortsman 2023a", "rms_t leads loss spikes by 1-8 steps", "mlp",
              "lead_rms_t", "within", {}, None,
              "steps from the shallow rms_t maximum (32-step window) to the spike start",
              arg=(1, 8), only_spiking=True),
        Claim("wortsman.update_clip", "Wortsman 2023a", "StableAdamW update clipping removes spikes",
              "mlp", "num_spikes", "removes", {"update_clip": True}, {}, "update clipping off -> on"),
        Claim("bai.eps_star", "Bai 2025", "eps >= eps* removes spikes", "quadratic", "num_spikes",
              "removes", {"eps": 2.8e-4}, {"eps": 2.5e-4},
              "eps 2.5e-4 -> 2.8e-4 around eps* = 2.63e-4"),
        Claim("bai.eps_large_fnn", "Bai 2025", "a large eps (0.1) removes the FNN's spikes", "mlp",
              "num_spikes", "removes", {"eps": 0.1}, {}, "eps 1e-8 -> 0.1"),
        Claim("bai.lower_b2", "Bai 2025", "lower b2 shrinks spikes", "quadratic", "max_spike_height",
              "decrease", {"b2": 0.95}, {}, "b2 0.999 -> 0.95 (height in decades)"),
    ]


# ----------------------------------------------------------------------------- statistics

def bootstrap_ci(treat: np.ndarray, control: np.ndarray | None, kind: str,
                 rng: np.random.Generator) -> tuple[float, float, float]:
    """(estimate, low, high), 95% percentile bootstrap; kind: diff | rel | mean."""
    t = np.asarray(treat, float)
    c = None if control is None else np.asarray(control, float)

    def stat(ti, ci):
        if kind == "mean":
            return ti.mean()
        d = ti.mean() - ci.mean()
        if kind == "rel":
            return d / ci.mean() if ci.mean() != 0 else (math.inf if d > 0 else -math.inf if d < 0 else 0.0)
        return d

    est = stat(t, c)
    boots = np.empty(NUM_BOOT)
    for i in range(NUM_BOOT):
        ti = t[rng.integers(0, len(t), len(t))]
        ci = None if c is None else c[rng.integers(0, len(c), len(c))]
        boots[i] = stat(ti, ci)
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return float(est), float(lo), float(hi)


def verdict(rule: str, lo: float, hi: float, arg: Any = None, degenerate: bool = False) -> str:
    """Apply a RULES rule to a CI (see module docstring)."""
    if any(map(math.isnan, (lo, hi))):
        return "inconclusive"
    if rule in ("decrease", "increase"):
        want_low = rule == "decrease"
        if (hi < 0) if want_low else (lo > 0):
            return "supported"
        if ((lo > 0) if want_low else (hi < 0)) or degenerate:
            return "not supported"
        return "inconclusive"
    if rule == "weak":
        if -0.5 < lo and hi < 0.5:
            return "supported"
        if hi <= -0.5 or lo >= 0.5:
            return "not supported"
        return "inconclusive"
    if rule == "at_least":
        return "supported" if lo > arg else "not supported" if hi < arg else "inconclusive"
    if rule == "within":
        a, b = arg
        if a <= lo and hi <= b:
            return "supported"
        return "not supported" if hi < a or lo > b else "inconclusive"
    raise ValueError(f"unknown rule {rule!r}")


def evaluate(c: Claim, treat: pd.DataFrame, control: pd.DataFrame | None,
             rng: np.random.Generator) -> dict:
    """One table row from the runs of the claim's cell(s)."""
    row = _evaluate(c, treat, control, rng)
    also = []
    for m in c.also:
        arms = [("control", control), ("treatment", treat)] if control is not None \
            else [("mean", treat)]
        vals = [f"{name} {float(df[m].astype(float).mean()):.4g}" for name, df in arms
                if df is not None and m in df]
        if vals:
            also.append(f"{m}: " + ", ".join(vals))
    if also:
        row["note"] = "; ".join(x for x in (row["note"], "; ".join(also)) if x)
    return row


def _evaluate(c: Claim, treat: pd.DataFrame, control: pd.DataFrame | None,
              rng: np.random.Generator) -> dict:
    rule_text = RULES[c.rule].format(x=f"{c.arg:.3g}" if c.rule == "at_least" else "",
                                     a=c.arg[0] if c.rule == "within" else "",
                                     b=c.arg[1] if c.rule == "within" else "")
    row = {"id": c.id, "source": c.source, "claim": c.claim, "problem": c.problem,
           "experiment": c.experiment, "metric": c.metric, "rule": rule_text,
           "ci_method": f"percentile bootstrap, {NUM_BOOT} resamples", "note": c.note}
    t = treat[c.metric].to_numpy(float)
    if c.only_spiking:
        t = t[(treat["num_spikes"] > 0).to_numpy() & np.isfinite(t)]
    if control is None:
        row.update(n_seeds=int(len(t)), control_mean=math.nan)
        if len(t) < 2:
            return {**row, "treatment_mean": float(np.mean(t)) if len(t) else math.nan,
                    "effect": math.nan, "ci_low": math.nan, "ci_high": math.nan,
                    "verdict": "inconclusive",
                    "note": (c.note + "; " if c.note else "") + f"{len(t)} run(s) with spikes"}
        est, lo, hi = bootstrap_ci(t, None, "mean", rng)
        return {**row, "treatment_mean": est, "effect": est, "ci_low": lo, "ci_high": hi,
                "verdict": verdict(c.rule, lo, hi, c.arg)}
    k = control[c.metric].to_numpy(float)
    kind = "rel" if c.rule == "weak" else "diff"
    est, lo, hi = bootstrap_ci(t, k, kind, rng)
    if c.rule == "removes":
        _, t_lo, _ = bootstrap_ci(t, None, "mean", rng)
        v = ("supported" if np.all(t == 0) and hi < 0 else
             "not supported" if t_lo > 0 else "inconclusive")
        return {**row, "n_seeds": int(min(len(t), len(k))), "control_mean": float(k.mean()),
                "treatment_mean": float(t.mean()), "effect": est, "ci_low": lo, "ci_high": hi,
                "verdict": v}
    degenerate = bool(len(t) and np.all(t == t[0]) and np.all(k == t[0]))
    if degenerate and t[0] == 0:   # e.g. no spikes in either arm: nothing to compare
        row["note"] = (c.note + "; " if c.note else "") + f"{c.metric} = 0 in every run of both arms"
        degenerate = None
    return {**row, "n_seeds": int(min(len(t), len(k))), "control_mean": float(k.mean()),
            "treatment_mean": float(t.mean()), "effect": est, "ci_low": lo, "ci_high": hi,
            "verdict": "inconclusive" if degenerate is None else verdict(c.rule, lo, hi, c.arg, degenerate)}


# ----------------------------------------------------------------------------- running

def _full_cell(problem, overrides: dict) -> dict:
    cell = {k: p.default for k, p in problem.params.items()}
    for k, v in overrides.items():
        if k not in cell:
            raise ConfigError(f"{problem.name}: unknown parameter {k!r} in a claim")
        cell[k] = problem.params[k].check(k, v)
    if problem.check is not None:
        problem.check(cell)
    return cell


def replicate(out: str | Path, quick: bool = False, num_seeds: int = 5, progress: bool = True,
              claim_list: list[Claim] | None = None,
              runners: dict[str, Callable] | None = None) -> pd.DataFrame:
    """Run every claim's cells (resumable under out/cells) and return the table."""
    from simulate.sweep import get_problem, run_cells

    out = Path(out)
    seeds = list(range(num_seeds))
    bases = base_cells(quick)
    claim_list = claims() if claim_list is None else claim_list
    # every cell of every runnable claim, run per problem in one pass (vmapped groups)
    want: dict[str, list[dict]] = {}
    plan = []
    for c in claim_list:
        if (c.base or c.problem) not in bases:
            plan.append((c, None, None))
            continue
        prob = get_problem(c.problem)
        base = bases[c.base or c.problem]
        tc = _full_cell(prob, {**base, **c.treatment})
        cc = None if c.control is None else _full_cell(prob, {**base, **c.control})
        want.setdefault(c.problem, []).extend([tc] + ([cc] if cc is not None else []))
        plan.append((c, tc, cc))
    tables = {}
    for name, cells in want.items():
        uniq = list({repr(sorted(x.items())): x for x in cells}.values())
        tables[name] = run_cells(get_problem(name), uniq, seeds, out, progress=progress,
                                 desc=f"replicate {name}")
    rng = np.random.default_rng(0)
    rows = []
    for c, tc, cc in plan:
        if tc is None:
            rows.append({k: math.nan for k in COLUMNS} | {
                "id": c.id, "source": c.source, "claim": c.claim, "problem": c.problem,
                "experiment": c.experiment, "metric": c.metric, "rule": RULES[c.rule],
                "n_seeds": 0, "ci_method": "", "verdict": "inconclusive",
                "note": "not run in --quick: needs the JAX tiny LLaMA (embeddings / batch "
                        "skipping), ~40 s per 1500-step run on one core, and shorter runs do "
                        "not spike; the full replication runs it"})
            continue
        from simulate.sweep import cell_id
        t = tables[c.problem]
        pick = lambda cell: t[t["cell_id"] == cell_id(c.problem, cell)]  # noqa: E731
        rows.append(evaluate(c, pick(tc), None if cc is None else pick(cc), rng))
    return pd.DataFrame(rows, columns=COLUMNS)


def to_markdown(table: pd.DataFrame) -> str:
    def f(x):
        return "" if isinstance(x, float) and math.isnan(x) else f"{x:.3g}" if isinstance(x, float) else str(x)

    cols = ["id", "claim", "problem", "experiment", "metric", "control_mean", "treatment_mean",
            "effect", "ci_low", "ci_high", "n_seeds", "verdict", "rule", "note"]
    lines = ["# Replication of the literature's claims at toy scale", "",
             "95% CIs: " + (table["ci_method"].dropna().iloc[0] if table["ci_method"].astype(bool).any() else "") +
             " over seeds. Verdict rules: see the rule column and simulate/replication.py.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in table.iterrows():
        lines.append("| " + " | ".join(f(r[c]).replace("|", "/") for c in cols) + " |")
    counts = table["verdict"].value_counts()
    lines += ["", ", ".join(f"{k}: {v}" for k, v in counts.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adamspike sweep replicate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for replication.csv / .md and cells/")
    ap.add_argument("--quick", action="store_true", help="smaller, shorter runs (CI, <= 60 s)")
    ap.add_argument("--seeds", type=int, default=5, help="seeds per cell (>= 5 for the CIs)")
    ap.add_argument("--no-progress", action="store_true")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code == 0 else 2
    if args.seeds < 2:
        print("adamspike sweep replicate: --seeds must be >= 2 (>= 5 recommended)", file=sys.stderr)
        return 2
    from adamspike.rundir import atomic_write_bytes
    try:
        table = replicate(args.out, args.quick, args.seeds, progress=not args.no_progress)
    except ConfigError as e:
        print(f"adamspike sweep replicate: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    atomic_write_bytes(out / "replication.csv", table.to_csv(index=False).encode())
    atomic_write_bytes(out / "replication.md", to_markdown(table).encode())
    print(table[["id", "effect", "ci_low", "ci_high", "verdict"]].to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
