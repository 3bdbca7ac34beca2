"""`adamspike replicate`: test each literature claim on spiking toy problems.

    adamspike replicate --out DIR [--quick] [--seeds 5] [--claims configs/claims.toml]
    (also `adamspike sweep replicate`)

One row per claim (DIR/replication.csv, replication.md): the claim and its source, the
experiment (problem and settings: a control and a treatment cell, or one cell), the
per-seed metric, the measured effect at toy scale with a 95% confidence interval over the
seeds, and a verdict by the row's stated rule. The claims are data (configs/claims.toml):
each arm is a dict of dotted config keys over the problem's base cell (`base_cells`), the
vocabulary of RunConfig.from_dict, so a claim about a new mitigation of the registry
(adamspike/mitigations.py) needs only a new [[claim]] table.

Problems (simulate.sweep_problems, real runs through `simulate.sweep.run_cells`, resumable
under DIR/cells/):
  mlp        Bai's 2-layer FNN on sin x + sin 4x (simulate.mlp "sin"), full batch unless
             stated, lr 1e-2, b = (0.9, 0.999), eps 1e-8: it spikes many times per run.
  mlp_deep   a 4 x 64 tanh MLP (simulate.mlp "deep", init gain 0.5): gradients shrink toward
             the input, so the first layer is the shallow layer nearest eps.
  quadratic  1/2 theta^2 (simulate.quadratic), lr 1e-2, gradient noise 1e-9 (so seeds
             differ), eps* = 2.63e-4.
  llama      the JAX tiny LLaMA (simulate.llama_train with sweep_problems.LLAMA_BASE), 1500
             steps, one run after another: full replication only. In --quick (CI) the llama
             rows say "not run" (verdict inconclusive): their spikes are late and rare, so
             shorter runs leave the control with nothing to remove. --skip-llama (the
             reproduce study, for its time budget) leaves them out the same way.
Each claim is tested where the toy problems spike; the seed report's own setting (b2 = 0.95)
does not spike in these toys, so its eps claims are tested at b2 = 0.999 (said per row).
The spike guard row (report.batch_skip) counts spikes in the kept trace (rolled-back steps
replaced by their re-runs), so it tests whether rollback + skip ends every incident within
the retries. Measured effects are in the generated replication.md, not here.

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
from typing import Any

import numpy as np
import pandas as pd

from adamspike.config import ConfigError, read_toml
from adamspike.rundir import atomic_write_bytes
from simulate.sweep import cell_id, cell_settings, run_cells
from simulate.sweep_problems import PROBLEMS

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


CLAIMS_FILE = Path(__file__).resolve().parent.parent / "configs" / "claims.toml"
CLAIM_FIELDS = ("id", "source", "claim", "problem", "metric", "rule", "treatment", "control",
                "experiment", "arg", "only_spiking", "note", "base", "also")


@dataclass
class Claim:
    id: str
    source: str
    claim: str
    problem: str                       # "mlp" | "quadratic" | "llama"
    metric: str                        # a sweep-table column
    rule: str                          # key of RULES
    treatment: dict                    # dotted-key overrides of the problem's base cell
    control: dict | None = None        # None: one-cell claim
    experiment: str = ""
    arg: Any = None                    # X for at_least, (a, b) for within
    only_spiking: bool = False         # one-cell metric over runs with >= 1 spike
    note: str = ""
    base: str = ""                     # key of base_cells (default: the problem)
    also: tuple[str, ...] = ()         # more sweep-table columns: arm means go in the note


def base_cells(quick: bool, llama: bool = True) -> dict[str, dict]:
    """Base settings (dotted keys) of each problem; the problem fills in the rest."""
    mlp = {"mlp.kind": "sin", "mlp.width": 64 if quick else 128,
           "train.num_steps": 1000 if quick else 4000, "optim.lr": 1e-2, "optim.eps": 1e-8,
           "optim.b1": 0.9, "optim.b2": 0.999}
    quad = {"train.num_steps": 20000, "optim.lr": 1e-2, "optim.eps": 1e-8, "optim.b2": 0.999,
            "quadratic.noise": 1e-9}
    deep = {"mlp.kind": "deep", "mlp.width": 32 if quick else 64, "mlp.depth": 4,
            "mlp.init_gain": 0.5, "train.num_steps": 1000 if quick else 4000, "optim.lr": 1e-2,
            "optim.eps": 1e-8, "optim.b1": 0.9, "optim.b2": 0.999}
    bases = {"mlp": mlp, "mlp_deep": deep, "quadratic": quad}
    if llama and not quick:   # ~40 s per run on one core: not in --quick (module docstring)
        bases["llama"] = {"train.num_steps": LLAMA_STEPS, "optim.b2": 0.999, "optim.eps": 1e-8,
                          "optim.lr": 1e-2}
    return bases


LLAMA_STEPS = 1500


def claims(path: str | Path = CLAIMS_FILE) -> list[Claim]:
    """The [[claim]] tables of a claims TOML (default configs/claims.toml), checked: known
    fields, problem, rule, and every arm's keys against the problem (ConfigError names the
    claim and the key)."""
    data = read_toml(path)
    rows = data.get("claim", [])
    if set(data) - {"claim"} or not isinstance(rows, list) or not rows:
        raise ConfigError(f"{path}: expected [[claim]] tables only")
    out, seen = [], set()
    for i, row in enumerate(rows):
        where = f"{path}: claim[{i}]"
        bad = sorted(set(row) - set(CLAIM_FIELDS))
        if bad:
            raise ConfigError(f"{where}.{bad[0]}: unknown field (known: {', '.join(CLAIM_FIELDS)})")
        for k in ("id", "source", "claim", "problem", "metric", "rule", "treatment"):
            if k not in row:
                raise ConfigError(f"{where}.{k}: missing")
        if row["id"] in seen:
            raise ConfigError(f"{where}.id: duplicate {row['id']!r}")
        seen.add(row["id"])
        if row["problem"] not in PROBLEMS:
            raise ConfigError(f"{where}.problem: unknown {row['problem']!r} (known: {', '.join(PROBLEMS)})")
        if row["rule"] not in RULES:
            raise ConfigError(f"{where}.rule: unknown {row['rule']!r} (known: {', '.join(RULES)})")
        c = Claim(**{**row, "arg": tuple(row["arg"]) if isinstance(row.get("arg"), list) else row.get("arg"),
                     "also": tuple(row.get("also", ()))})
        for arm in ("treatment", "control"):
            over = getattr(c, arm)
            if over is not None:
                try:
                    cell_settings(PROBLEMS[c.problem], over, arm)
                except ConfigError as e:
                    raise ConfigError(f"{where} ({c.id}): {e}") from None
        out.append(c)
    return out


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
    """Every knob of the problem for these dotted overrides (validated by its schema)."""
    return problem.values(cell_settings(problem, overrides, "claim"))


NOT_RUN = {
    "quick": "not run in --quick: needs the JAX tiny LLaMA (embeddings / batch skipping), ~40 s "
             "per 1500-step run on one core, and shorter runs do not spike; the full "
             "replication runs it",
    "skip_llama": "not run in this study (--skip-llama, for the reproduce budget: 15 tiny-LLaMA "
                  "runs, ~9 min on 2 cores): batch skipping is tested causally in replay/ "
                  "(skip_window) and GLM shrink in the matched-regime table (glm_shrink arm); "
                  "`adamspike replicate --out DIR` runs these rows"}


def replicate(out: str | Path, quick: bool = False, num_seeds: int = 5, progress: bool = True,
              claim_list: list[Claim] | None = None, llama: bool = True) -> pd.DataFrame:
    """Run every claim's cells (resumable under out/cells) and return the table; llama=False
    leaves the tiny-LLaMA rows out (said in their note)."""
    out = Path(out)
    seeds = list(range(num_seeds))
    bases = base_cells(quick, llama)
    claim_list = claims() if claim_list is None else claim_list
    # every cell of every runnable claim, run per problem in one pass (vmapped groups)
    want: dict[str, list[dict]] = {}
    plan = []
    for c in claim_list:
        if (c.base or c.problem) not in bases:
            plan.append((c, None, None))
            continue
        prob = PROBLEMS[c.problem]
        base = bases[c.base or c.problem]
        tc = _full_cell(prob, {**base, **c.treatment})
        cc = None if c.control is None else _full_cell(prob, {**base, **c.control})
        want.setdefault(c.problem, []).extend([tc] + ([cc] if cc is not None else []))
        plan.append((c, tc, cc))
    tables = {}
    for name, cells in want.items():
        uniq = list({repr(sorted(x.items())): x for x in cells}.values())
        tables[name] = run_cells(PROBLEMS[name], uniq, seeds, out, progress=progress,
                                 desc=f"replicate {name}")
    rng = np.random.default_rng(0)
    rows = []
    for c, tc, cc in plan:
        if tc is None:
            rows.append({k: math.nan for k in COLUMNS} | {
                "id": c.id, "source": c.source, "claim": c.claim, "problem": c.problem,
                "experiment": c.experiment, "metric": c.metric, "rule": RULES[c.rule],
                "n_seeds": 0, "ci_method": "", "verdict": "inconclusive",
                "note": NOT_RUN["quick" if quick else "skip_llama"]})
            continue
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
    ap = argparse.ArgumentParser(prog="adamspike replicate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for replication.csv / .md and cells/")
    ap.add_argument("--quick", action="store_true", help="smaller, shorter runs (CI, <= 60 s)")
    ap.add_argument("--seeds", type=int, default=5, help="seeds per cell (>= 5 for the CIs)")
    ap.add_argument("--claims", default=str(CLAIMS_FILE), help="claims TOML ([[claim]] tables)")
    ap.add_argument("--skip-llama", action="store_true",
                    help="leave out the tiny-LLaMA rows (15 runs; their note says so)")
    ap.add_argument("--no-progress", action="store_true")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code == 0 else 2
    if args.seeds < 2:
        print("adamspike replicate: --seeds must be >= 2 (>= 5 recommended)", file=sys.stderr)
        return 2
    try:
        table = replicate(args.out, args.quick, args.seeds, progress=not args.no_progress,
                          claim_list=claims(args.claims), llama=not args.skip_llama)
    except ConfigError as e:
        print(f"adamspike replicate: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    atomic_write_bytes(out / "replication.csv", table.to_csv(index=False).encode())
    atomic_write_bytes(out / "replication.md", to_markdown(table).encode())
    print(table[["id", "effect", "ci_low", "ci_high", "verdict"]].to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
