"""The sharpness law under the plan's convergence QC, and the 70B's reading with a
prediction interval (reads files: the shipped batch-sharpness summary and the Lanczos
cells of simulate/sharpness.py in a cell store).

QC (docs/plan/science4_v1.toml [sharpness.qc]):
- a Lanczos rung-seed passes when every evaluation has residual ||H y - theta y|| / |theta|
  < max_residual and theta_1 > 0, and its 1/n fit lambda(n) = lambda_inf + a / n has
  a > 0 and lambda_inf > 0;
- a shipped (power-iteration) rung-seed carries no residual: it passes when max_change <=
  shipped_max_change, lambda_first > 0, a > 0 and lambda_inf > 0;
- a rung enters the law with >= min_seeds passing seeds (the median of their lambda_inf).

The law: log10 lambda_inf = c0 + c_d log10 dim + c_L log10 layers + c_lr log10 lr by least
squares over rungs; at a target x the 90 % prediction interval is
x'b -+ t_{0.95, n-p} sqrt(s^2 (1 + x'(X'X)^-1 x)) (a regression interval, not a
leave-one-out spread). The 70B's Adam stability number after the warmup is
S = (0.55 lr / eps) lambda / (38 (1 + rho_min)) (simulate.predict.mechanism_inputs' reading),
and the plan's labels: "A" when S_lo >= 1, "below the edge" when S_hi < 1, "undetermined
(A)" otherwise; "+ B" when rho_min < 0.1.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from adamspike.cells import CellStore
from adamspike.sharpness_law import label as law_label, law_at  # noqa: F401 (law_at re-exported)

PI_THRESHOLD = 38.0      # 2 (1+b1)/(1-b1) at b1 0.9
LR_AFTER_WARMUP = 0.55   # median lr after the warmup as a fraction of the peak (predict.PHASE_LR)


def fit_noise(tokens: Sequence[float], lam: Sequence[float]) -> tuple[float, float]:
    """lambda(n) = lambda_inf + a / n by least squares: (lambda_inf, a)."""
    t = np.asarray(tokens, float)
    X = np.stack([np.ones_like(t), 1.0 / t], 1)
    coef = np.linalg.lstsq(X, np.asarray(lam, float), rcond=None)[0]
    return float(coef[0]), float(coef[1])


def qc_cell(payload: Mapping[str, Any], plan: Mapping[str, Any]) -> dict:
    """QC of one Lanczos rung-seed (module doc): pass, the reasons it failed, the fit."""
    q = plan["sharpness"]["qc"]
    ev = payload["eval"]
    why = []
    worst = max(e["residual"] for e in ev)
    if not worst < q["max_residual"]:
        why.append(f"residual {worst:.2g} >= {q['max_residual']:g}")
    if any(not e["theta_1"] > 0 for e in ev):
        why.append("theta_1 <= 0 at some n")
    lam_inf, a = fit_noise([e["tokens"] for e in ev], [e["theta_1"] for e in ev])
    if not a > 0:
        why.append(f"1/n fit a = {a:.3g} <= 0")
    if not lam_inf > 0:
        why.append(f"lambda_inf = {lam_inf:.3g} <= 0")
    return {"pass": not why, "why": "; ".join(why), "lambda_inf": lam_inf, "noise_a": a,
            "max_residual": worst, "min_theta_min": min(e["theta_min"] for e in ev)}


def qc_shipped(row: Mapping[str, Any], plan: Mapping[str, Any]) -> dict:
    """The plain check of a shipped power-iteration rung-seed (module doc)."""
    q = plan["sharpness"]["qc"]
    why = []
    if not row["max_change"] <= q["shipped_max_change"]:
        why.append(f"last-product change {row['max_change']:.2g} > {q['shipped_max_change']:g}")
    if not row["lambda_first"] > 0:
        why.append(f"lambda at the smallest batch {row['lambda_first']:.3g} <= 0")
    if not row["noise_a"] > 0:
        why.append(f"1/n fit a = {row['noise_a']:.3g} <= 0")
    if not row["lambda_inf"] > 0:
        why.append(f"lambda_inf {row['lambda_inf']:.3g} <= 0")
    return {"pass": not why, "why": "; ".join(why)}


def shipped_rows(summary: Mapping[str, Any], plan: Mapping[str, Any]) -> pd.DataFrame:
    """The shipped batch-sharpness rung-seeds (power iteration, 150 steps, eps 1e-8) with
    their QC."""
    rows = []
    for r in summary["rungs"]:
        qc = qc_shipped(r, plan)
        rows.append({"source": "v4 power iteration", "dim": r["dim"], "layers": r["layers"],
                     "lr": r["lr"], "eps": 1e-8, "steps": 150, "seed": r["seed"],
                     "lambda_inf": r["lambda_inf"], "noise_a": r["noise_a"],
                     "max_residual": math.nan, "check": r["max_change"],
                     "pass": qc["pass"], "why": qc["why"], "rerun": False})
    return pd.DataFrame(rows)


def cell_rows(pairs: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]],
              plan: Mapping[str, Any]) -> pd.DataFrame:
    """Lanczos rung-seeds [(cell config, payload)] with their QC. A rerun (start > 0)
    replaces its first pass: the first pass stays in the table, marked superseded."""
    rows = []
    for cfg, payload in pairs:
        qc = qc_cell(payload, plan)
        rows.append({"source": "Lanczos", "dim": cfg["dim"], "layers": cfg["layers"],
                     "lr": cfg["lr"], "eps": cfg["eps"], "steps": cfg["steps"],
                     "seed": cfg["seed"], "lambda_inf": qc["lambda_inf"],
                     "noise_a": qc["noise_a"], "max_residual": qc["max_residual"],
                     "check": qc["min_theta_min"], "pass": qc["pass"], "why": qc["why"],
                     "rerun": cfg["start"] > 0, "iters": cfg["iters"],
                     "seconds": payload.get("seconds", math.nan)})
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    key = ["dim", "layers", "lr", "eps", "steps", "seed"]
    rerun = df[df["rerun"]].set_index(key).index
    df["superseded"] = ~df["rerun"] & df.set_index(key).index.isin(rerun)
    return df


def rung_table(rows: pd.DataFrame, min_seeds: int) -> pd.DataFrame:
    """Per rung (dim, layers, lr, eps, steps): passing seeds, their median lambda_inf, and
    whether the rung enters the law (>= min_seeds passing)."""
    sup = rows["superseded"].fillna(False).astype(bool) if "superseded" in rows else False
    use = rows[rows["pass"].astype(bool) & ~sup]
    g = use.groupby(["dim", "layers", "lr", "eps", "steps"], as_index=False)
    t = g.agg(seeds=("seed", "nunique"), lambda_inf=("lambda_inf", "median"))
    t["enters"] = t["seeds"] >= min_seeds
    return t


def fit_law(rungs: pd.DataFrame, level: float = 0.90) -> dict | None:
    """OLS of log10 lambda_inf on log10 dim, layers, lr over the rungs that enter (module
    doc); None without enough rungs for the four terms and one degree of freedom."""
    r = rungs[rungs["enters"] & (rungs["lambda_inf"] > 0)]
    X = np.stack([np.ones(len(r)), np.log10(r["dim"]), np.log10(r["layers"]),
                  np.log10(r["lr"])], 1) if len(r) else np.zeros((0, 4))
    if len(r) < 5 or np.linalg.matrix_rank(X) < 4:
        return None
    y = np.log10(r["lambda_inf"].to_numpy(float))
    coef = np.linalg.lstsq(X, y, rcond=None)[0]
    dof = len(r) - 4
    s2 = float(np.sum((y - X @ coef) ** 2) / dof)
    cov = s2 * np.linalg.inv(X.T @ X)
    return {"coef": coef.tolist(), "se": np.sqrt(np.diag(cov)).tolist(), "cov": cov.tolist(),
            "s2": s2, "dof": dof, "num_rungs": int(len(r)), "level": level,
            "t": float(stats.t.ppf(0.5 + level / 2, dof))}


def label(S: float, lo: float, hi: float, rho_min: float, plan: Mapping[str, Any]) -> str:
    """The plan's mechanism label (adamspike.sharpness_law.label at the plan's edge)."""
    return law_label(S, lo, hi, rho_min, plan["labels"]["edge"], plan["labels"]["dormant_rho"])


def reading_70b(law: Mapping[str, Any] | None, plan: Mapping[str, Any], rho_min: float) -> dict | None:
    """lambda_inf, Pi_eps and S after the warmup at the plan's target, with intervals and
    the label."""
    if law is None:
        return None
    t = plan["sharpness"]["target"]
    lam, lo, hi = law_at(law, t["dim"], t["layers"], t["lr"])
    k = LR_AFTER_WARMUP * t["lr"] / t["eps"] / (PI_THRESHOLD * (1 + rho_min))
    return {"lambda_inf": lam, "lambda_lo": lo, "lambda_hi": hi,
            "pi_eps": t["lr"] / t["eps"] * lam, "S_after": k * lam, "S_lo": k * lo,
            "S_hi": k * hi, "rho_min": rho_min,
            "depth_exponent": law["coef"][2], "depth_se": law["se"][2],
            "lr_exponent": law["coef"][3], "lr_se": law["se"][3],
            "label": label(k * lam, k * lo, k * hi, rho_min, plan)}


def hits(plan: Mapping[str, Any], rungs: pd.DataFrame) -> pd.DataFrame:
    """The plan's new rungs: each law's prediction as written in the plan, the measured
    median over passing seeds, hit or miss (inside the written interval)."""
    rows = []
    for r in plan["sharpness"]["rungs"]:
        eps = r.get("eps", 1e-8)
        m = rungs[(rungs["dim"] == r["dim"]) & (rungs["layers"] == r["layers"])
                  & np.isclose(rungs["lr"], r["lr"]) & np.isclose(rungs["eps"], eps)
                  & (rungs["steps"] == r["steps"])]
        measured = float(m["lambda_inf"].iloc[0]) if len(m) else math.nan
        seeds = int(m["seeds"].iloc[0]) if len(m) else 0
        row = {"dim": r["dim"], "layers": r["layers"], "lr": r["lr"], "eps": eps,
               "steps": r["steps"], "passing_seeds": seeds, "measured": measured}
        for law in ("law_v4", "law_v4_qc"):
            p, lo, hi = r[law]
            row[f"{law}"] = f"{p:.3g} [{lo:.3g}, {hi:.3g}]"
            row[f"{law}_hit"] = ("not measured" if not math.isfinite(measured) else
                                 "hit" if lo <= measured <= hi else "miss")
        rows.append(row)
    return pd.DataFrame(rows)


def read_cells(store_dir: str | Path) -> list[tuple[dict, dict]]:
    """Every verified sharpness cell in a store directory: [(config, payload)]."""
    return CellStore(store_dir).verified("sharpness_rung")
