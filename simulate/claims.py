"""Run the arms of a claims study (adamspike.claims): paired seeds per arm, resumable.

    adamspike replicate --out DIR [--seeds N] [--claims configs/claims.toml] [--skip-llama]
                        [--only ID ...] [--set base.NAME.KEY=VALUE ...]
    adamspike replicate matched --ladder LADDER_DIR --out DIR [--seeds 10]
                                (= --claims configs/claims_matched.toml --ladder LADDER_DIR)

Runners, by the base's kind (seed k of every arm has the same init and batches: paired):
  problem = P    a spiking toy of simulate.sweep_problems (mlp, mlp_deep, quadratic, llama)
                 through simulate.sweep.run_cells (vmapped; its `sweep_cell` cells): one row
                 per seed, the sweep table's metrics.
  config = TOML  the tiny LLaMA of a RunConfig, one vmapped program per arm
                 (simulate.seeds.run_arm; a `claims_arm` cell): one row per seed x step
                 (loss, grad_norm, update_norm, rho_<group>); the metrics come from
                 analysis.claims.

Calibration (a base with `calibrate`, e.g. the matched regime): one Adam eps per depth group
(mitigation.eps_embed / eps_shallow / eps_deep / eps_head, optim.eps = eps_shallow) such
that each group's rho = rms(consumed gradient) / eps sits at the LLaMA2-70B's estimate at
eps 1e-5 (LADDER_DIR/fit.json, `llama2_70b.rho`). The gradient scale moves with eps
(rho_embed ~ eps^-2 near the target), so eps is found by root finding in log-log: pilots
(`seeds` seeds, the arms' schedule and length) measure rho_g = median over the second half;
the first update is eps_g <- eps_g rho_g / target_g, later ones secant steps through the
last two pilots (slope clipped to [-4, -0.25], steps to 1.5 decades), `rounds` pilots in all;
a pilot whose rho is not finite and positive (it diverged) ends the calibration (the round
is marked "diverged"). Each group keeps the eps of the pilot that came closest to its target
(`verified`): the last step is not trusted unmeasured.
An arm's "*k" value then scales the calibrated eps.

Storage (DIR): replication.json (the resolved study: claims, every arm's full config and
the cell that holds its table, `arms[<arm>]["cell"]` = {kind, key}; calibration; arm_configs:
the RunConfig arms, which `adamspike spike-rate --matched` reads), and cells/, the one cell
store (adamspike.cells): arm tables, sweep cells and calibrations, keyed by their configs
and seeds, so a killed study resumes at the first missing cell and a changed claim reruns
only its own arms. <arm> = base name + a hash of its config and seeds. Verdicts and the
report: analysis.claims (reads these files).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from adamspike.cells import Cell, CellStore, run_cells as run_store_cells
from adamspike.claims import REPO, Study, arm_label, resolve
from adamspike.config import ConfigError, flatten, read_toml, to_dict
from adamspike.rundir import atomic_write_bytes
from adamspike.train_config import RunConfig, id_settings
from simulate.sweep import cell_id, cell_settings, run_cells, store_cell
from simulate.sweep_problems import PROBLEMS

EPS_KEYS = {"embed": "mitigation.eps_embed", "shallow": "mitigation.eps_shallow",
            "deep": "mitigation.eps_deep", "head": "mitigation.eps_head"}
NOT_RUN = {
    "only": "not run at this size (the study's size table, configs/study.toml, runs a subset "
            "with --only): `adamspike replicate` without --only runs it",
    "skip_llama": "not run in this study (--skip-llama, for the reproduce budget): batch "
                  "skipping is tested causally in replay/ (skip_window) and GLM shrink in the "
                  "matched-regime table; `adamspike replicate --out DIR` runs these rows"}


def ladder_targets(ladder_dir: str | Path) -> dict[str, float]:
    """The 70B's rho per depth group at eps 1e-5 from a ladder's fit.json."""
    path = Path(ladder_dir) / "fit.json"
    try:
        fit = json.loads(path.read_text())
        rho, eps = fit["llama2_70b"]["rho"], float(fit["llama2_70b"]["eps"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a ladder fit ({e}); run `adamspike simulate ladder` first") from None
    if abs(eps - 1e-5) > 1e-12:
        raise ConfigError(f"{path}: its 70B profile is at eps {eps:g}, expected 1e-5")
    return {g: float(v) for g, v in rho.items()}


def _config(flat: Mapping[str, Any]) -> RunConfig:
    return RunConfig.from_dict(dict(flat))


ARM_KIND, CAL_KIND = "claims_arm", "calibration"
CODE = "seeds-1"        # bump when run_arm / arm_table / calibrate change meaning


def arm_cell(cfg: Mapping[str, Any], seeds: Sequence[int]) -> Cell:
    """A RunConfig arm (full dotted config) x seeds as a cell of the one store."""
    return Cell(ARM_KIND, CODE, {"config": dict(cfg), "seeds": [int(s) for s in seeds]},
                "simulate.claims:compute_arm")


def compute_arm(config: Mapping[str, Any]) -> dict:
    seeds = list(config["seeds"])
    return {"rows": arm_table(run_arm(_config(config["config"]), seeds), seeds)}


def calibration_cell(pilot: Mapping[str, Any], targets: Mapping[str, float], rounds: int,
                     seeds: int) -> Cell:
    """A calibration (`calibrate`) as a cell: the claims' calibrated bases and the phase
    map's (lr_mult, batch_mult) pairs."""
    return Cell(CAL_KIND, CODE, {"pilot": dict(pilot), "targets": dict(targets),
                                 "rounds": int(rounds), "seeds": int(seeds)},
                "simulate.claims:compute_calibration")


def compute_calibration(config: Mapping[str, Any]) -> dict:
    return calibrate(config["pilot"], config["targets"], config["rounds"], config["seeds"],
                     progress=False)


def run_arm(cfg: RunConfig, seeds: Sequence[int]) -> dict:
    from simulate import seeds as S   # the tiny-LLaMA step program: only for config bases
    return S.run_arm(cfg, seeds)


def group_layout(cfg: RunConfig) -> tuple:
    from simulate import seeds as S   # the tiny-LLaMA step program: only for config bases
    return S.group_layout(cfg)


def with_group_eps(flat: Mapping[str, Any], eps: Mapping[str, float]) -> dict:
    out = {**flat, **{EPS_KEYS[g]: float(e) for g, e in eps.items()}}
    out["optim.eps"] = float(eps.get("shallow", out["optim.eps"]))
    return out


def calibrate(flat: Mapping[str, Any], targets: Mapping[str, float], rounds: int, seeds: int,
              progress: bool = True) -> dict:
    """Per-group eps putting each group at its target rho (module docstring)."""
    pilot = {**flat, "optim.warmup_steps": min(flat["optim.warmup_steps"], flat["train.num_steps"] // 4)}
    groups, _, _, eps0 = group_layout(_config(pilot))
    eps, history = dict(zip(groups, map(float, eps0))), []
    for _ in tqdm(range(rounds), desc="calibrate", disable=not progress, file=sys.stderr):
        res = run_arm(_config(with_group_eps(pilot, eps)), list(range(seeds)))
        half = res["rho"].shape[1] // 2
        rho = {str(g): float(np.median(res["rho"][:, half:, i])) for i, g in enumerate(res["groups"])}
        history.append({"eps": dict(eps), "rho": rho})
        if not all(math.isfinite(r) and r > 0 for r in rho.values()):
            history[-1]["diverged"] = True   # no gradient scale to aim at: stop here
            break
        eps = {g: next_eps(g, history, targets[g]) if g in targets else eps[g] for g in rho}
    best, rho = verified(history, targets)
    return {"targets": dict(targets), "rounds": history, "eps": best, "rho": rho}


def verified(rounds: Sequence[Mapping], targets: Mapping[str, float]) -> tuple[dict, dict]:
    """Per group the eps of the pilot whose measured rho came closest to the target (in
    log), and that rho: the last secant step is an extrapolation no pilot has checked, and
    one that overshoots leaves a group decades from its band (measured: a 2-round, 200-step
    calibration of the phase map's toy put embed and shallow at rho 62-69 against 0.7-0.9).
    ({}, {}) when every pilot diverged."""
    rounds = [r for r in rounds if not r.get("diverged")]
    if not rounds:
        return {}, {}
    eps, rho = {}, {}
    for g in rounds[0]["eps"]:
        pick = (min(rounds, key=lambda r: abs(math.log(r["rho"][g] / targets[g])))
                if g in targets else rounds[-1])
        eps[g], rho[g] = pick["eps"][g], pick["rho"][g]
    return eps, rho


def next_eps(group: str, rounds: Sequence[Mapping[str, Mapping[str, float]]], target: float) -> float:
    """The next pilot's eps of one group: log rho(log eps) crosses log target. One pilot:
    eps rho / target (slope -1); more: the secant through the last two pilots, its slope
    clipped to [-4, -0.25], the step to 1.5 decades."""
    e1, r1 = math.log(rounds[-1]["eps"][group]), math.log(rounds[-1]["rho"][group])
    slope = -1.0
    if len(rounds) >= 2:
        e0, r0 = math.log(rounds[-2]["eps"][group]), math.log(rounds[-2]["rho"][group])
        if abs(e1 - e0) > 1e-9:
            slope = min(-0.25, max(-4.0, (r1 - r0) / (e1 - e0)))
    cap = 1.5 * math.log(10.0)
    return math.exp(e1 + max(-cap, min(cap, (math.log(target) - r1) / slope)))


def base_config(study: Study, name: str, ladder: str | Path | None, meta: dict,
                progress: bool, store: CellStore) -> dict:
    """A base's full dotted config (sweep problem: its cell; RunConfig: calibrated)."""
    b = study.bases[name]
    over = flatten(b.get("overrides", {}))
    if "problem" in b:
        if b["problem"] not in PROBLEMS:
            raise ConfigError(f"base.{name}.problem: unknown {b['problem']!r} (known: {', '.join(PROBLEMS)})")
        prob = PROBLEMS[b["problem"]]
        return prob.values(cell_settings(prob, over, f"base.{name}"))
    flat = resolve(flatten(to_dict(RunConfig.from_dict(read_toml(REPO / b["config"])))), over)
    _config(flat)
    cal = b.get("calibrate")
    if not cal:
        return flat
    if ladder is None:
        raise ConfigError(f"base.{name}: calibrated to a ladder's 70B rho: give --ladder LADDER_DIR")
    # the targets at 6 significant digits (far inside the fit's own error): the ladder's
    # refit may differ in its last bits on another CPU, and a calibration's key must not,
    # or the shipped cells (package_data CLAIMS_CELLS) would not be found there
    targets = {g: float(f"{v:.6g}") for g, v in ladder_targets(ladder).items()}
    key = {"base": flat, "targets": targets, "calibrate": cal}
    cell = calibration_cell(flat, key["targets"], int(cal["rounds"]), int(cal["seeds"]))
    have = {**key, **run_store_cells(store, [cell], progress=progress, desc="calibrate")[0]}
    meta.setdefault("calibration", {})[name] = have
    return with_group_eps(flat, have["eps"])


def arm_config(study: Study, base_name: str, base: Mapping[str, Any], over: Mapping[str, Any]) -> dict:
    """An arm's full config: base + overrides, validated (errors name the key)."""
    b = study.bases[base_name]
    flat = resolve(base, over)
    if "problem" in b:
        prob = PROBLEMS[b["problem"]]
        return prob.values(cell_settings(prob, flat, "arm"))
    unknown = sorted(set(flat) - set(base))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown config key")
    _config(flat)
    return flat


def arm_table(res: Mapping[str, np.ndarray], seeds: Sequence[int]) -> pd.DataFrame:
    n, T = res["loss"].shape
    df = pd.DataFrame({"seed": np.repeat(np.asarray(seeds), T), "step": np.tile(np.arange(1, T + 1), n),
                       "loss": res["loss"].ravel(), "grad_norm": res["grad_norm"].ravel(),
                       "update_norm": res["update_norm"].ravel()})
    for i, g in enumerate(res["groups"]):
        df[f"rho_{g}"] = res["rho"][:, :, i].ravel()
    return df


def run_study(study: Study, out: str | Path, only: Sequence[str] | None = None,
              num_seeds: int | None = None, ladder: str | Path | None = None,
              skip_llama: bool = False, progress: bool = True,
              cells_from: Sequence[str | Path] = ()) -> Path:
    """Resolve every claim's arms, run those not yet in the store out/cells, write
    replication.json. A calibration or arm found in a `cells_from` store (the cells
    shipped with the package: the standard study) is copied from it instead of run."""
    out = Path(out)
    seeds = list(range(num_seeds or study.seeds))
    meta_path = out / "replication.json"
    store = CellStore(out / "cells", sources=cells_from)
    meta = {"claims_file": study.path, "title": study.title, "description": study.description,
            "sets": list(study.sets), "only": None if only is None else list(only), "seeds": seeds, "spike_k": study.spike_k, "calibration": {},
            "claims": [], "arms": {}, "arm_configs": {}}
    unknown = sorted(set(only or ()) - {c.id for c in study.claims})
    if unknown:
        raise ConfigError(f"{study.path}: --only {unknown[0]}: no such claim")
    bases = {}
    for c in study.claims:
        b = study.bases[c.base]
        skip = ("only" if only is not None and c.id not in only else
                "skip_llama" if skip_llama and b.get("problem") == "llama" else None)
        row = {**asdict(c), "rule_text": c.rule_text(), "not_run": NOT_RUN[skip] if skip else ""}
        if not skip:
            if c.base not in bases:
                bases[c.base] = base_config(study, c.base, ladder, meta, progress, store)
            for arm in ("treatment", "control"):
                over = getattr(c, arm)
                if over is None:
                    continue
                try:
                    cfg = arm_config(study, c.base, bases[c.base], over)
                except ConfigError as e:
                    raise ConfigError(f"{study.path}: claim {c.id}.{arm}: {e}") from None
                blob = json.dumps({"config": id_settings(cfg), "seeds": seeds}, sort_keys=True,
                                  default=repr)
                aid = f"{c.base}-{hashlib.sha1(blob.encode()).hexdigest()[:10]}"
                row[f"{arm}_arm"] = aid
                cell = (store_cell(PROBLEMS[b["problem"]], cfg, seeds, PROBLEMS[b["problem"]].spikes)
                        if "problem" in b else arm_cell(cfg, seeds))
                meta["arms"][aid] = {"base": c.base, "label": arm_label(over, getattr(c, f"{arm}_name")),
                                     "config": cfg, "cell": {"kind": cell.kind, "key": cell.key}}
                if "config" in b:
                    meta["arm_configs"][aid] = cfg
        meta["claims"].append(row)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(meta_path, json.dumps(meta, indent=2, default=repr).encode())
    by_problem: dict[str, list] = {}
    config_arms = {}
    for aid, m in meta["arms"].items():
        b = study.bases[m["base"]]
        if "problem" in b:
            by_problem.setdefault(b["problem"], []).append(m["config"])
        else:
            config_arms.setdefault(m["cell"]["key"], arm_cell(m["config"], seeds))
    run_store_cells(store, list(config_arms.values()), progress=progress, desc="arms")
    for name, cfgs in by_problem.items():   # one pass per problem: vmapped groups, stored cells
        uniq = list({cell_id(name, c): c for c in cfgs}.values())
        run_cells(PROBLEMS[name], uniq, seeds, out, progress=progress, desc=f"replicate {name}",
                  cells_from=cells_from)
    if cells_from:
        print(f"replicate: {store.copied} cells copied from {', '.join(map(str, cells_from))}; "
              "the others computed or already here", file=sys.stderr)
    return out
