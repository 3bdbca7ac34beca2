"""Run the arms of the matched-regime replication: >= 10 paired seeds per arm, vmapped.

    adamspike replicate matched --ladder LADDER_DIR --out DIR [--quick] [--seeds 10]

1. Calibration. The base config (configs/matched_replication.toml) gets one Adam eps per
   depth group (mitigation.eps_embed / eps_shallow / eps_deep / eps_head, optim.eps =
   eps_shallow) such that each group's rho = rms(consumed gradient) / eps sits at the
   LLaMA2-70B's estimate at eps 1e-5 (LADDER_DIR/fit.json, `llama2_70b.rho`, from
   `adamspike simulate ladder`). The gradient scale moves with eps (a smaller eps gives
   larger updates, and the embedding's gradient grows: measured, rho_embed ~ eps^-2 near
   the target), so eps is found by root finding in log-log: pilot runs (CALIB_SEEDS seeds,
   the arms' own schedule and length) measure rho_g = median over the second half of the
   run; the first update is eps_g <- eps_g rho_g / target_g (rms held fixed), later ones
   are secant steps on log rho_g(log eps_g) through the last two pilots (slope clipped to
   [-4, -0.25], steps to 1.5 decades), `calib_rounds` pilots in all. The rho reached by the
   arms themselves is reported beside the target.
2. Arms ([[arm]] of configs/claims_matched.toml): dotted overrides of the calibrated base,
   and/or every group eps of `scale_groups` times `scale_eps`. Each arm is one vmapped
   program over the seeds (simulate.seeds.run_arm); seed k of every arm reads the same
   batches from the same init, so arms are paired by seed.

Storage (DIR): replication.json (the resolved study: base config, calibration, arms with
their full configs, claims, seeds, steps; a restart with another study is refused),
arms/<name>.parquet (one row per seed x step: loss, grad_norm, update_norm, rho_<group>;
written atomically when the arm is done), so an interrupted study resumes at the first
missing arm. The table (analysis.matched_replication) reads these files.
"""

from __future__ import annotations

import copy
import io
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from adamspike.config import ConfigError, flatten, read_toml, to_dict
from adamspike.rundir import atomic_write_bytes
from adamspike.train_config import RunConfig
from simulate.seeds import group_layout, run_arm

REPO = Path(__file__).resolve().parent.parent
BASE_CONFIG = REPO / "configs" / "matched_replication.toml"
CLAIMS = REPO / "configs" / "claims_matched.toml"
CALIB_SEEDS = 2
EPS_KEYS = {"embed": "mitigation.eps_embed", "shallow": "mitigation.eps_shallow",
            "deep": "mitigation.eps_deep", "head": "mitigation.eps_head"}
ARM_FIELDS = {"name", "description", "overrides", "scale_eps", "scale_groups", "quick"}
CLAIM_FIELDS = {"id", "source", "claim", "control", "treatment", "rule"}
RULES = ("decrease", "increase", "weak")


def study_spec(quick: bool, num_seeds: int | None = None) -> dict:
    """Steps and seeds: full 300 steps x 10 seeds (~1 min per arm on one core; the batch x2 arm
    costs 2x: the reproduce study's time budget), calibration 4 pilots of CALIB_SEEDS seeds x
    300 steps; quick 40 steps x 10 seeds (the arms marked quick), calibration 1 pilot x 40
    steps (the same program as the arms: one compile)."""
    if quick:
        return {"num_steps": 40, "warmup_steps": 4, "seeds": num_seeds or 10,
                "calib_steps": 40, "calib_rounds": 1, "calib_seeds": num_seeds or 10}
    return {"num_steps": 300, "warmup_steps": 30, "seeds": num_seeds or 10,
            "calib_steps": 300, "calib_rounds": 4}


def read_claims(path: str | Path = CLAIMS, quick: bool = False) -> tuple[list[dict], list[dict]]:
    """([[arm]], [[claim]]) of a claims file, checked (ConfigError names the table and
    field); quick keeps the arms marked quick and the claims between them."""
    data = read_toml(path)
    arms, claims = data.get("arm", []), data.get("claim", [])
    if set(data) - {"arm", "claim"} or not arms or not claims:
        raise ConfigError(f"{path}: expected [[arm]] and [[claim]] tables only")
    names = set()
    for i, a in enumerate(arms):
        bad = sorted(set(a) - ARM_FIELDS)
        if bad or "name" not in a:
            raise ConfigError(f"{path}: arm[{i}]: " + (f"unknown field {bad[0]!r}" if bad else "missing name"))
        if a["name"] in names:
            raise ConfigError(f"{path}: arm[{i}].name: duplicate {a['name']!r}")
        names.add(a["name"])
        if "scale_eps" in a and not float(a["scale_eps"]) > 0:
            raise ConfigError(f"{path}: arm {a['name']}: scale_eps must be > 0")
        for g in a.get("scale_groups", []):
            if g not in EPS_KEYS:
                raise ConfigError(f"{path}: arm {a['name']}: scale_groups: unknown group {g!r}")
    for i, c in enumerate(claims):
        bad = sorted(set(c) - CLAIM_FIELDS)
        missing = sorted(CLAIM_FIELDS - set(c))
        if bad or missing:
            raise ConfigError(f"{path}: claim[{i}]: " + (f"unknown field {bad[0]!r}" if bad
                                                          else f"missing {missing[0]!r}"))
        for k in ("control", "treatment"):
            if c[k] not in names:
                raise ConfigError(f"{path}: claim {c['id']}: {k}: unknown arm {c[k]!r}")
        if c["rule"] not in RULES:
            raise ConfigError(f"{path}: claim {c['id']}: rule: unknown {c['rule']!r} ({', '.join(RULES)})")
    if quick:
        arms = [a for a in arms if a.get("quick")]
        keep = {a["name"] for a in arms}
        claims = [c for c in claims if c["control"] in keep and c["treatment"] in keep]
    return arms, claims


def ladder_targets(ladder_dir: str | Path) -> dict[str, float]:
    """The 70B's rho per depth group at eps 1e-5 from a ladder's fit.json."""
    path = Path(ladder_dir) / "fit.json"
    try:
        fit = json.loads(path.read_text())
        rho = fit["llama2_70b"]["rho"]
        eps = float(fit["llama2_70b"]["eps"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a ladder fit ({e}); run `adamspike simulate ladder` first") from None
    if abs(eps - 1e-5) > 1e-12:
        raise ConfigError(f"{path}: its 70B profile is at eps {eps:g}, expected 1e-5")
    return {g: float(v) for g, v in rho.items()}


def _config(flat: Mapping[str, Any]) -> RunConfig:
    return RunConfig.from_dict(dict(flat))


def base_flat(spec: Mapping[str, Any], path: str | Path = BASE_CONFIG) -> dict:
    """The base config's dotted keys with the study's steps."""
    flat = flatten(to_dict(RunConfig.from_dict(read_toml(path))))
    flat.update({"train.num_steps": spec["num_steps"], "optim.warmup_steps": spec["warmup_steps"]})
    return flat


def with_group_eps(flat: Mapping[str, Any], eps: Mapping[str, float]) -> dict:
    out = dict(flat)
    for g, e in eps.items():
        out[EPS_KEYS[g]] = float(e)
    out["optim.eps"] = float(eps.get("shallow", out["optim.eps"]))
    return out


def group_eps(flat: Mapping[str, Any]) -> dict[str, float]:
    groups, _, _, eps = group_layout(_config(flat))
    return dict(zip(groups, map(float, eps)))


def calibrate(flat: Mapping[str, Any], targets: Mapping[str, float], spec: Mapping[str, Any],
              progress: bool = True) -> dict:
    """Per-group eps putting each group at its target rho (module docstring)."""
    flat = dict(flat)
    pilot = {**flat, "train.num_steps": spec["calib_steps"],
             "optim.warmup_steps": min(spec["warmup_steps"], spec["calib_steps"] // 4)}
    rounds = []
    eps = group_eps(pilot)
    for _ in tqdm(range(spec["calib_rounds"]), desc="calibrate", disable=not progress, file=sys.stderr):
        res = run_arm(_config(with_group_eps(pilot, eps)), list(range(spec.get("calib_seeds", CALIB_SEEDS))))
        half = res["rho"].shape[1] // 2
        rho = {str(g): float(np.median(res["rho"][:, half:, i])) for i, g in enumerate(res["groups"])}
        rounds.append({"eps": dict(eps), "rho": rho})
        eps = {g: next_eps(g, rounds, targets[g]) if g in targets else eps[g] for g in rho}
    return {"targets": dict(targets), "rounds": rounds, "eps": eps}


def next_eps(group: str, rounds: Sequence[Mapping[str, Mapping[str, float]]], target: float
             ) -> float:
    """The next pilot's eps of one group: log rho(log eps) crosses log target. One pilot:
    eps rho / target (the gradient RMS held fixed, slope -1); more: the secant through the
    last two pilots, its slope clipped to [-4, -0.25] (rho falls as eps grows), the step to
    1.5 decades."""
    e1, r1 = math.log(rounds[-1]["eps"][group]), math.log(rounds[-1]["rho"][group])
    slope = -1.0
    if len(rounds) >= 2:
        e0, r0 = math.log(rounds[-2]["eps"][group]), math.log(rounds[-2]["rho"][group])
        if abs(e1 - e0) > 1e-9:
            slope = min(-0.25, max(-4.0, (r1 - r0) / (e1 - e0)))
    step = (math.log(target) - r1) / slope
    cap = 1.5 * math.log(10.0)
    return math.exp(e1 + max(-cap, min(cap, step)))


def arm_flat(base: Mapping[str, Any], eps: Mapping[str, float], arm: Mapping[str, Any]) -> dict:
    """An arm's full dotted config: calibrated base + group eps scaling + overrides."""
    scaled = {g: e * (float(arm.get("scale_eps", 1.0)) if g in arm.get("scale_groups", list(eps)) else 1.0)
              for g, e in eps.items()}
    flat = with_group_eps(base, scaled)
    for k, v in arm.get("overrides", {}).items():
        if k not in flat:
            raise ConfigError(f"arm {arm['name']}: {k}: unknown config key")
        flat[k] = v
    _config(flat)   # validated: errors name the key
    return flat


def arm_table(res: Mapping[str, np.ndarray], seeds: Sequence[int]) -> pd.DataFrame:
    n, T = res["loss"].shape
    df = pd.DataFrame({"seed": np.repeat(np.asarray(seeds), T), "step": np.tile(np.arange(1, T + 1), n),
                       "loss": res["loss"].ravel(), "grad_norm": res["grad_norm"].ravel(),
                       "update_norm": res["update_norm"].ravel()})
    for i, g in enumerate(res["groups"]):
        df[f"rho_{g}"] = res["rho"][:, :, i].ravel()
    return df


def run_study(out: str | Path, ladder_dir: str | Path, quick: bool = False,
              num_seeds: int | None = None, claims_path: str | Path = CLAIMS,
              progress: bool = True) -> Path:
    """Calibrate, then run every arm not yet under out/arms; return out."""
    out = Path(out)
    spec = study_spec(quick, num_seeds)
    if spec["seeds"] < 10:
        raise ConfigError(f"--seeds: the paired tests need >= 10 seeds, got {spec['seeds']}")
    arms, claims = read_claims(claims_path, quick)
    targets = ladder_targets(ladder_dir)
    base = base_flat(spec)
    meta_path = out / "replication.json"
    want = {"spec": spec, "targets": targets, "base": base, "arms": arms, "claims": claims}
    if meta_path.exists():
        have = json.loads(meta_path.read_text())
        if {k: have.get(k) for k in want} != json.loads(json.dumps(want)):
            raise ConfigError(f"{out}: holds another matched replication (replication.json "
                              "differs: spec, ladder targets, base, arms or claims); use a new --out")
        meta = have
    else:
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        cal = calibrate(base, targets, spec, progress)
        meta = {**copy.deepcopy(want), "calibration": cal, "calibration_seconds": time.perf_counter() - t0,
                "arm_configs": {a["name"]: arm_flat(base, cal["eps"], a) for a in arms},
                "arm_seconds": {}}
        atomic_write_bytes(meta_path, json.dumps(meta, indent=2).encode())
    seeds = list(range(spec["seeds"]))
    (out / "arms").mkdir(exist_ok=True)
    todo = [a for a in arms if not (out / "arms" / f"{a['name']}.parquet").exists()]
    bar = tqdm(total=len(arms), initial=len(arms) - len(todo), desc="matched arms", unit="arm",
               disable=not progress, file=sys.stderr)
    for a in todo:
        bar.set_postfix(arm=a["name"], refresh=True)
        t0 = time.perf_counter()
        res = run_arm(_config(meta["arm_configs"][a["name"]]), seeds)
        buf = io.BytesIO()
        arm_table(res, seeds).to_parquet(buf, index=False)
        atomic_write_bytes(out / "arms" / f"{a['name']}.parquet", buf.getvalue())
        meta["arm_seconds"][a["name"]] = time.perf_counter() - t0
        atomic_write_bytes(meta_path, json.dumps(meta, indent=2).encode())
        bar.update(1)
    bar.close()
    return out
