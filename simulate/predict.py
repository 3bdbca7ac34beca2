"""`adamspike predict`: predictions.json (schema v2) from theory + sweep results.

    adamspike predict (--profile (llama2-70b | PROFILE.json | RUN_DIR) | --profile-from-log LOG
                       | --profile-from-run RUN) [--ladder DIR] --sweep TABLE
                      [--candidates candidates.toml] --out predictions.json

Profile: per-depth gradient scale of the model the predictions are for, as
rho_ref(depth) = rms(g) / eps_ref of the gradient Adam consumes, at the eps it refers to.
  - llama2-70b (needs --ladder DIR, a finished `adamspike simulate ladder` directory): the
    ladder fit (simulate.ladder) extrapolated to dim 8192, 80 layers, 1024 x 4096 tokens per
    step under the clip constraint sum_g N_g rms_g^2 = min(gn, 1)^2, at eps_ref = 1e-5; each
    depth takes its group's rho with the bootstrap prediction interval (rho_lo, rho_hi);
    phi = 0; lr 1.5e-4, batch 1024 (configs/llama2-70b.toml). `source` names the ladder, its
    R^2 (log) per group and the interval.
  - --profile-from-log LOG (Megatron / ModelLink / MindSpeed training log; needs --ladder for
    the depth shape): rho_bar(t) = min(grad_norm_t, clip) / (sqrt(N) eps) (N of the
    llama2-70b preset, --clip, --eps-ref), its median over the second half of the log,
    spread over depth by the ladder's shape rho_g / mean_rho (the N-weighted rms of the
    result is rho_bar); the interval combines the log's 10-90 % range of rho_bar with the
    shape's bootstrap interval. This replaces the ladder's absolute level by a measurement.
  - --profile-from-run RUN / RUN_DIR: a run directory (either backend; a telemetry run of the
    70B replaces the ladder entirely): median grad_rms per depth over all logged steps and
    tensors, interval = its 10-90 % range over steps, eps_ref = the run's optim.eps; phi per
    depth from the median grad_mom_cos, inverted through theory.adam_moments.grad_mom_cos
    (zero-mean AR(1) assumption); lr, b1, batch from the run's config.
  - PROFILE.json: {"name", "num_layers", "eps_ref", "rho_by_depth": {"-1": ..., ...}}
    (optional: "phi", "lr", "b1", "global_batch_size").
The profile section of predictions.json carries `by_depth`: one row per depth with depth,
group (adamspike.depth_groups), rho, rho_lo, rho_hi at eps_ref.
A candidate eps moves every depth to rho = rho_ref * eps_ref / eps (rms(g) held fixed).

Candidates are dicts of dotted RunConfig keys (CANDIDATE_KEYS: optim.b1, optim.b2,
optim.eps, optim.lr, train.global_batch_size; a candidates TOML gives [[candidate]] tables
of them, missing ones taken from the profile), validated by RunConfig.from_dict; each
setting of predictions.json carries them as its `overrides`.

Risk of a candidate, in [0, 1]:
  theory  p_theory = fraction of shallow depths (adamspike.depth_groups.shallow_depths)
          outside the scale-invariant regime (rho <= 10, theory.eps_regime): the layers whose
          effective step depends on eps (Molybog's regime); per-depth details from
          theory.risk.layer_risk are stored in `per_depth` (evaluated on a 1/20-decade rho
          grid and a 0.05 phi grid, cached).
  sweep   p_sweep = kernel-weighted fraction of sweep runs (baseline mitigations only) that
          spiked, weights exp(-d^2/2) with d^2 = (log10 rho ratio / 0.5)^2 + (log10
          (1-b2) ratio / 0.25)^2, matching the shallow rho (sweep column median_rho) and b2;
          n_eff = (sum w)^2 / sum w^2.
  risk    (n_eff p_sweep + 2 p_theory) / (n_eff + 2): the theory acts as a prior worth two
          runs. This combination is a documented heuristic, not a fitted model.
  label   low (< 1/3), medium (< 2/3), high.
Settings are ranked by risk (rank 1 = lowest); `validate` lists the three lowest-risk ids.

Alarm rules (each rule's `source` says where its threshold comes from):
  rms_t / sat_frac / grad_mom_cos of shallow tensors (max): the threshold maximising
      Youden's J between pre-spike maxima (sweep column pre_<m>, the PRE_WINDOW steps before
      each spike) of spiking runs and run maxima (max_<m>) of runs without spikes; expected
      lead = the 10-90% range of the measured lead_<m>. Without enough sweep data (< 3 runs
      per class) or when the best split is poor (Youden J = TPR - FPR < 0.2): rms_t 2.0 with lead [1, 8] (Wortsman 2023a, as in notes/theory.md);
      grad_mom_cos = theory.adam_moments.grad_mom_cos at the SNR where the r-bimodality
      crosses 5/9 (theory.bimodality.snr_bc_crossing); sat_frac is then left out.
  bimodality of shallow tensors (median > 5/9: most shallow tensors bimodal): Sarle's
      threshold (theory.bimodality.BC_THRESHOLD).
  rho of shallow tensors (median < 0.1 for 5 logged steps): frozen band
      (theory.eps_regime.RHO_FROZEN).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from adamspike.config import ConfigError, flatten, read_toml, to_dict
from adamspike.depth_groups import depth_group
from adamspike.depth_groups import shallow_depths as group_shallow_depths
from adamspike.llama import num_params, preset
from adamspike.mitigations import neutral_mask
from adamspike.predictions import AlarmRule, Predictions, PredictionsError, save_predictions
from adamspike.rundir import RunFormatError, load_run
from adamspike.train_config import RunConfig
from analysis.megatron_log import MegatronLogError, read_megatron_log
from simulate import ladder as LD
from simulate.sweep import load_table
from theory.adam_moments import grad_mom_cos
from theory.bimodality import BC_THRESHOLD, snr_bc_crossing
from theory.eps_regime import RHO_FROZEN, regime
from theory.risk import layer_risk

MIN_CLASS_RUNS = 3
MIN_YOUDEN_J = 0.2           # a data threshold must separate the classes at least this well
PRIOR_RUNS = 2.0
RHO_BANDWIDTH_DECADES = 0.5
B2_BANDWIDTH_DECADES = 0.25
NUM_VALIDATE = 3


# ----------------------------------------------------------------------------- profiles

LLAMA2_70B_SETTINGS = {"lr": 1.5e-4, "b1": 0.9, "global_batch_size": 1024, "eps_ref": 1e-5,
                      "clip": 1.0}   # configs/llama2-70b.toml (the seed report's run)


def _by_depth(num_layers: int, rho: Mapping[int, float], lo: Mapping[int, float],
              hi: Mapping[int, float]) -> list[dict]:
    return [{"depth": int(d), "group": depth_group(int(d), num_layers), "rho": float(rho[d]),
             "rho_lo": float(lo[d]), "rho_hi": float(hi[d])} for d in sorted(rho)]


def _ladder_source(ladder_dir: str | Path, fit: Mapping[str, Any], ext: Mapping[str, Any]) -> str:
    r2 = ", ".join(f"{g} {v['r2_log']:.3f}" for g, v in fit["groups"].items())
    ho = [f"{g} {v['heldout_widest']['mean_log10_error']:+.2f}" for g, v in fit["groups"].items()
          if v.get("heldout_widest")]
    lr = fit.get("ladder_spec", {}).get("lr_scaling", "constant")
    return (f"ladder fit ({ladder_dir}: {len(fit['rungs'])} rungs, {fit['num_rows']} rung x seed "
            f"rows, lr {lr} over width; power law in dim, layers, tokens/step per depth group; R^2 (log) {r2}"
            + (f"; held-out widest dim {fit['heldout_dim']} mean log10 error {', '.join(ho)}"
               if ho else "")
            + f"; {int(100 * fit['ci'])}% bootstrap prediction interval, n_boot {fit['n_boot']})"
            f" extrapolated to dim {ext['dim']}, {ext['num_layers']} layers, "
            f"{ext['tokens_per_step']} tokens/step: raw grad norm {ext['raw_grad_norm']:.3g} "
            f"[{ext['raw_grad_norm_lo']:.3g}, {ext['raw_grad_norm_hi']:.3g}], clip "
            f"{ext['clip']:g} -> mean rho {ext['mean_rho']:.3g} at eps {ext['eps']:g} "
            f"(bound clip/(sqrt(N) eps) = {ext['mean_rho_bound']:.3g})")


def ladder_profile(ladder_dir: str | Path) -> dict:
    """The LLaMA2-70B profile from a ladder directory (module docstring)."""
    s = LLAMA2_70B_SETTINGS
    fit, ext = LD.ladder_70b(ladder_dir, eps=s["eps_ref"], clip=s["clip"])
    rows = LD.profile_by_depth(ext)
    L = int(ext["num_layers"])
    rho = {r["depth"]: r["rho"] for r in rows}
    return {"name": "llama2-70b", "num_layers": L, "eps_ref": s["eps_ref"], "rho_by_depth": rho,
            "phi_by_depth": {d: 0.0 for d in rho}, "lr": s["lr"], "b1": s["b1"],
            "global_batch_size": s["global_batch_size"],
            "by_depth": _by_depth(L, rho, {r["depth"]: r["rho_lo"] for r in rows},
                                  {r["depth"]: r["rho_hi"] for r in rows}),
            "ladder": {"fit": LD.public(fit), "llama2_70b": {k: v for k, v in LD.public(ext).items()}},
            "source": _ladder_source(ladder_dir, fit, ext)}


def profile_from_log(log: str | Path, ladder_dir: str | Path, clip: float = 1.0,
                     eps_ref: float = 1e-5) -> dict:
    """LLaMA2-70B profile from a training log's grad norms, shaped by the ladder (module
    docstring)."""
    if not clip > 0:
        raise ConfigError(f"--clip: must be > 0, got {clip}")
    if not eps_ref > 0:
        raise ConfigError(f"--eps-ref: must be > 0, got {eps_ref}")
    try:
        steps = read_megatron_log(log).steps
    except MegatronLogError as e:
        raise ConfigError(str(e)) from None
    gn = steps["grad_norm"].to_numpy(float)
    gn = gn[np.isfinite(gn)]
    if len(gn) == 0:
        raise ConfigError(f"{log}: no finite 'grad norm' values in the log")
    late = gn[len(gn) // 2:]
    N = num_params(preset("llama2-70b"))
    rho_bar_t = np.minimum(late, clip) / (math.sqrt(N) * eps_ref)
    rho_bar = float(np.median(rho_bar_t))
    q10, q90 = (float(np.quantile(rho_bar_t, q)) for q in (0.1, 0.9))
    fit, ext = LD.ladder_70b(ladder_dir, eps=eps_ref, clip=clip)
    groups = ext["_groups"]
    shape = {g: ext["rho"][g] / ext["mean_rho"] for g in groups}
    draws = ext["_draws_rho"]
    Ng = np.array([ext["group_numel"][g] for g in groups], float)
    mean_d = np.sqrt((draws ** 2 * Ng).sum(1) / Ng.sum())
    a = (1 - fit["ci"]) / 2
    shape_lo = dict(zip(groups, np.quantile(draws / mean_d[:, None], a, axis=0)))
    shape_hi = dict(zip(groups, np.quantile(draws / mean_d[:, None], 1 - a, axis=0)))
    L = int(ext["num_layers"])
    depths = range(-1, L + 1)
    rho = {d: rho_bar * shape[depth_group(d, L)] for d in depths}
    lo = {d: q10 * shape_lo[depth_group(d, L)] for d in depths}
    hi = {d: q90 * shape_hi[depth_group(d, L)] for d in depths}
    s = LLAMA2_70B_SETTINGS
    return {"name": "llama2-70b", "num_layers": L, "eps_ref": eps_ref, "rho_by_depth": rho,
            "phi_by_depth": {d: 0.0 for d in rho}, "lr": s["lr"], "b1": s["b1"],
            "global_batch_size": s["global_batch_size"], "by_depth": _by_depth(L, rho, lo, hi),
            "rho_bar": rho_bar, "rho_bar_q10_q90": [q10, q90],
            "source": (f"measured log {log}: rho_bar = median of min(grad_norm, {clip:g}) / "
                       f"(sqrt(N) eps) over its last {len(late)} logged iterations = "
                       f"{rho_bar:.3g} (10-90 %: {q10:.3g}-{q90:.3g}), N {N}, eps {eps_ref:g}; "
                       f"depth shape from the " + _ladder_source(ladder_dir, fit, ext))}


def profile_from_run(path: Path) -> dict:
    run = load_run(path, tables=("layers",), layer_columns=["grad_rms", "grad_mom_cos"])
    if run.layers.empty:
        raise ConfigError(f"{path}: the run has no layers rows (no per-tensor telemetry)")
    optim = run.config.get("optim", {})
    eps = float(optim.get("eps", math.nan))
    if not eps > 0:
        raise ConfigError(f"{path}: run.json config optim.eps must be > 0 to define rho, got {eps}")
    b1 = float(optim.get("b1", 0.9))
    by_depth = run.layers.groupby("depth")
    grad = by_depth["grad_rms"].median()
    grad_lo, grad_hi = by_depth["grad_rms"].quantile(0.1), by_depth["grad_rms"].quantile(0.9)
    cos = by_depth["grad_mom_cos"].median()
    phis = np.linspace(-0.9, 0.99, 190)
    curve = np.array([grad_mom_cos(b1, 1.0, 0.0, p) for p in phis])
    rho, phi = {}, {}
    for d, g in grad.items():
        if not (np.isfinite(g) and g > 0):
            continue
        rho[int(d)] = float(g / eps)
        c = cos.get(d, math.nan)
        phi[int(d)] = float(np.clip(phis[np.argmin(np.abs(curve - c))], 0.0, 0.99)) \
            if np.isfinite(c) else 0.0
    if not rho:
        raise ConfigError(f"{path}: no depth with a positive finite grad_rms")
    model, train = run.config.get("model", {}), run.config.get("train", {})
    num_layers = int(model.get("num_layers") or max(max(rho), 0))
    lo = {d: float(grad_lo[d] / eps) for d in rho}
    hi = {d: float(grad_hi[d] / eps) for d in rho}
    return {"name": str(model.get("preset", path.name)), "num_layers": num_layers, "eps_ref": eps,
            "rho_by_depth": rho, "phi_by_depth": phi, "lr": float(optim.get("lr", 1e-3)),
            "by_depth": _by_depth(num_layers, rho, lo, hi) if all(
                -1 <= d <= num_layers for d in rho) else [],
            "b1": b1, "global_batch_size": int(train.get("global_batch_size", 1)),
            "source": f"measured: median grad_rms per depth of run {path}"}


def profile_from_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None
    for k in ("num_layers", "eps_ref", "rho_by_depth"):
        if k not in data:
            raise ConfigError(f"{path}: profile field {k!r} missing")
    try:
        rho = {int(d): float(v) for d, v in dict(data["rho_by_depth"]).items()}
        phi_in = data.get("phi", 0.0)
        phi = ({int(d): float(v) for d, v in phi_in.items()} if isinstance(phi_in, dict)
               else {d: float(phi_in) for d in rho})
        eps_ref, num_layers = float(data["eps_ref"]), int(data["num_layers"])
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: malformed profile ({e})") from None
    if not rho or any(not (v > 0 and math.isfinite(v)) for v in rho.values()):
        raise ConfigError(f"{path}: rho_by_depth must hold positive finite numbers")
    if not eps_ref > 0:
        raise ConfigError(f"{path}: eps_ref must be > 0")
    if any(not -1 < v < 1 for v in phi.values()):
        raise ConfigError(f"{path}: phi must lie in (-1, 1)")
    return {"name": str(data.get("name", path.stem)), "num_layers": num_layers, "eps_ref": eps_ref,
            "rho_by_depth": rho, "phi_by_depth": {d: phi.get(d, 0.0) for d in rho},
            "lr": float(data.get("lr", 1.5e-4)), "b1": float(data.get("b1", 0.9)),
            "global_batch_size": int(data.get("global_batch_size", 1024)),
            "source": f"profile file {path}"}


def load_profile(spec: str, ladder: str | None = None) -> dict:
    if spec == "llama2-70b":
        if not ladder:
            raise ConfigError("--profile llama2-70b: needs --ladder DIR (a directory written by "
                              "`adamspike simulate ladder`); the hand-written profile is gone")
        if not Path(ladder).is_dir():
            raise ConfigError(f"--ladder {ladder}: not a directory")
        return ladder_profile(ladder)
    p = Path(spec)
    if p.is_dir():
        try:
            return profile_from_run(p)
        except RunFormatError as e:
            raise ConfigError(str(e)) from None
    if p.is_file():
        return profile_from_json(p)
    raise ConfigError(f"--profile: {spec!r} is neither 'llama2-70b', a profile JSON nor a run directory")


def shallow_depths(profile: Mapping[str, Any]) -> list[int]:
    """The profile's depths in the embed and shallow groups (adamspike.depth_groups)."""
    shallow = set(group_shallow_depths(int(profile["num_layers"])))
    return [d for d in sorted(profile["rho_by_depth"]) if d in shallow]


# ----------------------------------------------------------------------------- candidates

CANDIDATE_KEYS = ("optim.b1", "optim.b2", "optim.eps", "optim.lr", "train.global_batch_size")


def _profile_defaults(profile: Mapping[str, Any]) -> dict:
    return {"optim.b1": profile["b1"], "optim.lr": profile["lr"],
            "train.global_batch_size": profile["global_batch_size"]}


def default_candidates(profile: Mapping[str, Any]) -> list[dict]:
    """The seed report's eps (1e-5 as run, 1e-8) x b2 (0.95 as run, 0.99, 0.999), plus the
    run's setting at half the learning rate."""
    base = _profile_defaults(profile)
    out = [{**base, "optim.b2": b2, "optim.eps": eps}
           for eps in (1e-5, 1e-8) for b2 in (0.95, 0.99, 0.999)]
    out.append({**base, "optim.b2": 0.95, "optim.eps": 1e-5, "optim.lr": base["optim.lr"] / 2})
    return out


def load_candidates(path: str, profile: Mapping[str, Any]) -> list[dict]:
    """[[candidate]] tables of dotted keys (CANDIDATE_KEYS, optional id); optim.b2 and
    optim.eps are required, the others default to the profile's. Values are validated by
    RunConfig.from_dict (ConfigError names the candidate and the key)."""
    data = read_toml(path)
    unknown = sorted(set(data) - {"candidate"})
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; expected [[candidate]] tables")
    cands = data.get("candidate", [])
    if not isinstance(cands, list) or not cands:
        raise ConfigError(f"{path}: no [[candidate]] tables")
    out = []
    for i, c in enumerate(cands):
        c = dict(c)
        cid = c.pop("id", None)
        flat = flatten(c)
        bad = sorted(set(flat) - set(CANDIDATE_KEYS))
        if bad:
            raise ConfigError(f"candidate[{i}].{bad[0]}: unknown key (known: id, {', '.join(CANDIDATE_KEYS)})")
        for k in ("optim.b2", "optim.eps"):
            if k not in flat:
                raise ConfigError(f"candidate[{i}].{k}: missing")
        flat = {**_profile_defaults(profile), **flat}
        try:
            cfg = flatten(to_dict(RunConfig.from_dict(flat)))
        except ConfigError as e:
            raise ConfigError(f"candidate[{i}].{e}") from None
        if not cfg["optim.eps"] > 0:
            raise ConfigError(f"candidate[{i}].optim.eps: must be > 0 (rho = rms(g) / eps)")
        out.append({**({"id": cid} if cid else {}), **{k: cfg[k] for k in CANDIDATE_KEYS}})
    return out


def setting_id(c: Mapping[str, Any]) -> str:
    return c.get("id") or (f"eps{c['optim.eps']:.0e}-b2_{c['optim.b2']:g}-lr{c['optim.lr']:.2g}"
                           f"-b1_{c['optim.b1']:g}-bs{int(c['train.global_batch_size'])}")


# ----------------------------------------------------------------------------- risk

def _baseline_rows(table: pd.DataFrame) -> pd.DataFrame:
    return table[neutral_mask(table)]


def sweep_rate(table: pd.DataFrame, rho: float, b2: float) -> tuple[float, float]:
    """(p_sweep, n_eff) near (shallow rho, b2); (nan, 0) without usable rows."""
    t = _baseline_rows(table)
    if t.empty or "optim.b2" not in t:
        return math.nan, 0.0
    d2 = (np.log10((1 - t["optim.b2"].to_numpy(float)) / (1 - b2)) / B2_BANDWIDTH_DECADES) ** 2
    if "median_rho" in t:
        r = t["median_rho"].to_numpy(float)
        ok = np.isfinite(r) & (r > 0)
        d2 = np.where(ok, d2 + (np.log10(np.where(ok, r, 1.0) / rho) / RHO_BANDWIDTH_DECADES) ** 2, np.inf)
    w = np.exp(-0.5 * d2)
    if not w.sum() > 0:
        return math.nan, 0.0
    spiked = ((t["num_spikes"].to_numpy() > 0) | t["diverged"].astype(bool).to_numpy()).astype(float)
    return float((w * spiked).sum() / w.sum()), float(w.sum() ** 2 / (w ** 2).sum())


_RISK_CACHE: dict = {}
RHO_QUANTUM_DECADES = 0.05   # closed forms are evaluated on a 1/20-decade rho grid (cached)
PHI_QUANTUM = 0.05


def _layer_risk(rho: float, phi: float, b1: float, b2: float, eps: float) -> dict:
    """theory.risk.layer_risk for one depth at rho, phi rounded to the quanta above (the
    fields used here do not depend on lr); regime is that of the exact rho."""
    rq = 10 ** (round(math.log10(rho) / RHO_QUANTUM_DECADES) * RHO_QUANTUM_DECADES)
    pq = round(phi / PHI_QUANTUM) * PHI_QUANTUM
    key = (rq, pq, b1, b2, eps)
    if key not in _RISK_CACHE:
        _RISK_CACHE[key] = layer_risk([rq], [pq], b1, b2, eps, 1.0)[0]
    return {**_RISK_CACHE[key], "rho": rho, "phi": phi, "regime": regime(rho)}


def assess(profile: Mapping[str, Any], cand: Mapping[str, Any], table: pd.DataFrame | None) -> dict:
    depths = sorted(profile["rho_by_depth"])
    b1, b2, eps = cand["optim.b1"], cand["optim.b2"], cand["optim.eps"]
    scale = profile["eps_ref"] / eps
    rhos = [profile["rho_by_depth"][d] * scale for d in depths]
    phis = [profile["phi_by_depth"].get(d, 0.0) for d in depths]
    rows = [_layer_risk(r, p, b1, b2, eps) for r, p in zip(rhos, phis)]
    shallow = set(shallow_depths(profile))
    sh = [r for d, r in zip(depths, rows) if d in shallow]
    p_theory = float(np.mean([r["regime"] != "scale_invariant" for r in sh]))
    rho_sh = float(np.median([r["rho"] for r in sh]))
    p_sweep, n_eff = sweep_rate(table, rho_sh, b2) if table is not None else (math.nan, 0.0)
    if not math.isfinite(p_sweep):
        p_sweep, n_eff = math.nan, 0.0
    risk = ((n_eff * p_sweep if n_eff else 0.0) + PRIOR_RUNS * p_theory) / (n_eff + PRIOR_RUNS)
    label = "low" if risk < 1 / 3 else "medium" if risk < 2 / 3 else "high"
    per_depth = [{"depth": d, **{k: r[k] for k in ("rho", "phi", "regime", "update_rms", "bc",
                                                    "sat_frac", "rms_t_bound", "const_peak",
                                                    "frozen_risk")}}
                 for d, r in zip(depths, rows)]
    frozen = sum(r["regime"] == "frozen" for r in sh)
    trans = sum(r["regime"] == "transition" for r in sh)
    rationale = (f"shallow rho median {rho_sh:.3g}: {frozen} frozen + {trans} transition of "
                 f"{len(sh)} shallow depths (p_theory {p_theory:.2f}); sweep spike fraction near "
                 f"rho/b2 {'n/a' if not n_eff else f'{p_sweep:.2f} (n_eff {n_eff:.1f})'}; "
                 f"after dormancy |r| peaks at {rows[0]['const_peak']:.2f} and rms_t <= "
                 f"{rows[0]['rms_t_bound']:.1f} at b2={b2:g}")
    return {"id": setting_id(cand), "overrides": {k: cand[k] for k in CANDIDATE_KEYS},
            "risk": float(risk),
            "risk_label": label, "p_theory": p_theory,
            "p_sweep": None if not n_eff else p_sweep, "n_eff": n_eff,
            "rationale": rationale, "per_depth": per_depth}


# ----------------------------------------------------------------------------- alarm rules

def youden_threshold(pos: np.ndarray, neg: np.ndarray) -> tuple[float, float, float]:
    """Threshold t maximising TPR - FPR for the rule value > t; -> (t, tpr, fpr)."""
    vals = np.unique(np.concatenate([pos, neg]))
    cands = (vals[:-1] + vals[1:]) / 2 if len(vals) > 1 else vals
    best = (-np.inf, math.nan, math.nan, math.nan)
    for t in cands:
        tpr, fpr = float(np.mean(pos > t)), float(np.mean(neg > t))
        if tpr - fpr > best[0]:
            best = (tpr - fpr, float(t), tpr, fpr)
    return best[1], best[2], best[3]


def alarm_rules(profile: Mapping[str, Any], table: pd.DataFrame | None, table_name: str,
                b1: float, b2: float) -> list[AlarmRule]:
    sh = shallow_depths(profile)
    depths = [min(sh), max(sh)]
    rules = []
    for m in ("rms_t", "sat_frac", "grad_mom_cos"):
        thr, lead, src, weak = math.nan, None, "", ""
        if table is not None and f"pre_{m}" in table and f"max_{m}" in table:
            spiked = table["num_spikes"] > 0
            pos = table.loc[spiked, f"pre_{m}"].dropna().to_numpy(float)
            neg = table.loc[~spiked & ~table["diverged"].astype(bool), f"max_{m}"].dropna().to_numpy(float)
            if len(pos) >= MIN_CLASS_RUNS and len(neg) >= MIN_CLASS_RUNS:
                thr, tpr, fpr = youden_threshold(pos, neg)
            if math.isfinite(thr) and tpr - fpr < MIN_YOUDEN_J:
                weak = (f"sweep {table_name}: {m} does not separate spiking from calm runs "
                        f"(best TPR {tpr:.2f}, FPR {fpr:.2f}); ")
                thr = math.nan
            if math.isfinite(thr):
                leads = table.loc[spiked, f"lead_{m}"].dropna().to_numpy(float)
                if len(leads):
                    lead = [max(1, int(math.floor(np.quantile(leads, 0.1)))),
                            max(1, int(math.ceil(np.quantile(leads, 0.9))))]
                src = (f"sweep {table_name}: Youden-optimal split of pre-spike maxima of {m} "
                       f"({len(pos)} spiking runs) vs run maxima ({len(neg)} runs without spikes): "
                       f"TPR {tpr:.2f}, FPR {fpr:.2f}")
        if not math.isfinite(thr):
            src = weak
            if m == "rms_t":
                thr, lead = 2.0, [1, 8]
                src += "literature: StableAdamW (Wortsman 2023a), rms_t exceeds ~2-5 1-8 steps before spikes"
            elif m == "grad_mom_cos":
                snr = snr_bc_crossing(b1, b2)
                norm = math.sqrt(1 + snr * snr)
                thr = grad_mom_cos(b1, 1 / norm, snr / norm)
                src += (f"theory: grad_mom_cos at the SNR {snr:.3f} where r turns bimodal "
                       "(theory.bimodality.snr_bc_crossing, theory.adam_moments.grad_mom_cos)")
            else:
                continue
        rules.append(AlarmRule(id=f"{m}_shallow", metric=m, op=">", threshold=float(thr),
                               depths=tuple(depths), reduce="max", consecutive=1,
                               expected_lead_steps=tuple(lead) if lead else None, source=src))
    rules.append(AlarmRule(id="bimodality_shallow", metric="bimodality", op=">",
                           threshold=float(BC_THRESHOLD), depths=tuple(depths), reduce="median",
                           source="theory: Sarle's bimodality threshold 5/9 "
                                  "(theory.bimodality.BC_THRESHOLD), most shallow tensors"))
    rules.append(AlarmRule(id="rho_shallow_frozen", metric="rho", op="<", threshold=float(RHO_FROZEN),
                           depths=tuple(depths), reduce="median", consecutive=5,
                           source="theory: frozen band rho < 0.1 (theory.eps_regime.RHO_FROZEN)"))
    return rules


# ----------------------------------------------------------------------------- build

def predict(profile: dict, candidates: Sequence[Mapping[str, Any]], table: pd.DataFrame | None,
            table_name: str = "") -> Predictions:
    settings = [assess(profile, c, table) for c in candidates]
    ids = [s["id"] for s in settings]
    if len(set(ids)) != len(ids):
        raise ConfigError("candidates: two candidates have the same id/setting")
    settings.sort(key=lambda s: (s["risk"], -s["overrides"]["optim.lr"], s["id"]))
    for i, s in enumerate(settings, 1):
        s["rank"] = i
    base = candidates[0]
    rules = alarm_rules(profile, table, table_name, base["optim.b1"], base["optim.b2"])
    prof = {"name": profile["name"], "num_layers": int(profile["num_layers"]),
            "rho_by_depth": {str(d): float(v) for d, v in sorted(profile["rho_by_depth"].items())},
            "phi": float(np.median(list(profile["phi_by_depth"].values()))),
            "phi_by_depth": {str(d): float(v) for d, v in sorted(profile["phi_by_depth"].items())},
            "eps_ref": profile["eps_ref"], "shallow_depths": shallow_depths(profile),
            "source": profile["source"]}
    for k in ("by_depth", "ladder", "rho_bar", "rho_bar_q10_q90"):
        if k in profile:
            prof[k] = profile[k]
    src = {"sweep": table_name or None, "sweep_runs": 0 if table is None else int(len(table)),
           "method": "risk = (n_eff p_sweep + 2 p_theory)/(n_eff + 2); see simulate/predict.py"}
    return Predictions(settings=settings, alarm_rules=rules,
                       validate=[s["id"] for s in settings[:NUM_VALIDATE]], profile=prof, source=src)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adamspike predict", description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--profile", help="llama2-70b (with --ladder) | PROFILE.json | RUN_DIR")
    which.add_argument("--profile-from-log", metavar="LOG",
                       help="Megatron training log of the 70B (rho_bar from its grad norms; "
                            "depth shape from --ladder)")
    which.add_argument("--profile-from-run", metavar="RUN",
                       help="telemetry run directory (measured per-depth rho)")
    ap.add_argument("--ladder", help="ladder directory (adamspike simulate ladder)")
    ap.add_argument("--clip", type=float, default=1.0, help="--profile-from-log: grad clip")
    ap.add_argument("--eps-ref", type=float, default=1e-5, help="--profile-from-log: the run's eps")
    ap.add_argument("--sweep", help="sweep table (runs.parquet / .csv or a sweep directory)")
    ap.add_argument("--candidates", help="TOML with [[candidate]] tables of dotted keys "
                    "(optim.b1, optim.b2, optim.eps, optim.lr, train.global_batch_size)")
    ap.add_argument("--out", required=True, help="predictions.json to write (must not exist)")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code == 0 else 2
    try:
        if Path(args.out).exists():
            raise ConfigError(f"{args.out}: exists; choose another --out (nothing was overwritten)")
        if args.profile_from_log:
            if not args.ladder:
                raise ConfigError("--profile-from-log: needs --ladder DIR for the depth shape")
            profile = profile_from_log(args.profile_from_log, args.ladder, args.clip, args.eps_ref)
        elif args.profile_from_run:
            if not Path(args.profile_from_run).is_dir():
                raise ConfigError(f"--profile-from-run {args.profile_from_run}: not a directory")
            profile = load_profile(args.profile_from_run)
        else:
            profile = load_profile(args.profile, args.ladder)
        table = None
        if args.sweep:
            table = load_table(args.sweep)
            need = {"optim.b2", "num_spikes", "diverged"}
            if not need <= set(table.columns):
                raise ConfigError(f"{args.sweep}: not a sweep table (missing {sorted(need - set(table.columns))})")
        cands = (load_candidates(args.candidates, profile) if args.candidates
                 else default_candidates(profile))
        pred = predict(profile, cands, table, args.sweep or "")
        save_predictions(pred, args.out)
    except (ConfigError, PredictionsError, ValueError) as e:
        print(f"adamspike predict: {e}", file=sys.stderr)
        return 2
    best = pred.settings[0]
    print(f"{len(pred.settings)} settings, {len(pred.alarm_rules)} alarm rules -> {args.out}; "
          f"lowest risk {best['id']} ({best['risk']:.2f}, {best['risk_label']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
