"""Phase map of loss spikes in the 70B's rho band: run the cells (JAX; analysis/phase_map.py
reads what this writes).

    adamspike phase-map --config configs/phase_map.toml --out DIR [--ladder L] [--set map.KEY=VALUE ...]

A cell is (lr_mult, b2, batch_mult) of the map's toy (configs/phase_map.toml): `seeds` lanes
of simulate.program's one step, `Program.run` with the stability number every
`curvature_every` steps:

    S_t = lr_t lambda_max(P_t H_t) / 2,   P = (1-b1)/((1+b1)(1-b1^t)) diag(1/(sqrt(v_hat)+eps))

(`Program.stability`: power iteration warm-started from the previous evaluation's vector;
S = 1 is Adam's edge of stability, Pi_eps = 2 (1+b1)/(1-b1) S in the eps band). Per (lr_mult,
batch_mult) the per-group eps are calibrated so that each depth group's rho sits at the 70B's
estimate (simulate.claims.calibrate; the pilots run at the first b2 and the map's length;
each group keeps the eps of the pilot that came closest, `verified`; when every pilot
diverges, the previous lr_mult's eps), so the cells differ in Pi, b2 and batch, not in where
each group sits against its eps.

Storage (DIR, resumable: a killed map restarts at the first missing cell):
  map.json               the resolved map: grid, spike settings, targets, calibration per
                         (lr_mult, batch_mult), every cell's settings, full config, id (a
                         hash of its config, seeds and K) and `cell` ({kind, key} in cells/)
  cells/                 the one cell store (adamspike.cells): a `phase_map_cell` per cell,
                         its table `rows` one row per seed x step: loss, grad_norm,
                         update_norm, rho_<group> (the consumed gradient's rms / the group's
                         eps), S and S_secant (the online proxy of the K steps before; both
                         NaN off the evaluation steps); and a `calibration` cell per pair
  stability_check.csv    the warm-started tracker and the online proxy against cold power
                         iteration (30 products, simulate.curvature) at the same parameters
"""

from __future__ import annotations

import hashlib
import json
import sys
from itertools import product
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from adamspike.claims import REPO
from adamspike.config import ConfigError, apply_sets, flatten, read_toml, to_dict
from adamspike.cells import Cell, CellStore, run_cells
from adamspike.rundir import atomic_write_bytes
from adamspike.train_config import RunConfig, id_settings
from simulate.claims import EPS_KEYS, arm_table, calibration_cell, ladder_targets, with_group_eps

MAP_FIELDS = {"title", "base", "overrides", "seeds", "first_seed", "lr_mult", "b2",
              "batch_mult", "curvature_every", "calibrate", "check"}
POWER_ITERS = 30     # the cold power iteration the tracker is checked against
KIND = "phase_map_cell"
CODE = "run-arm-1"   # bump when run_cell changes meaning


def read_map(path: str | Path, sets: Sequence[str] = ()) -> dict:
    """The map file with `--set map.KEY=VALUE` applied (a smaller map: the study's size
    table, configs/study.toml, gives its sizes this way), checked (ConfigError names the
    field)."""
    data = read_toml(path)
    bad = sorted(set(data) - {"map", "targets", "spikes"})
    if bad or "map" not in data:
        raise ConfigError(f"{path}: expected [map], [targets], [spikes]"
                          + (f" (unknown {bad[0]!r})" if bad else ""))
    m = dict(apply_sets(data, sets, {"map"})["map"])
    extra = sorted(set(m) - MAP_FIELDS)
    if extra:
        raise ConfigError(f"{path}: [map] unknown field {extra[0]!r}")
    for key in ("lr_mult", "b2", "batch_mult"):
        if not isinstance(m.get(key), list) or not m[key]:
            raise ConfigError(f"{path}: [map] {key}: a non-empty list")
    if int(m.get("seeds", 0)) < 2:
        raise ConfigError(f"{path}: [map] seeds: >= 2")
    return {"path": str(path), "sets": list(sets), "map": m, "targets": data.get("targets", {}),
            "spikes": data.get("spikes", {})}


def _config(flat: Mapping[str, Any]) -> RunConfig:
    return RunConfig.from_dict(dict(flat))


def base_flat(spec: dict) -> dict:
    m = spec["map"]
    base = flatten(to_dict(RunConfig.from_dict(read_toml(REPO / m["base"]))))
    flat = {**base, **flatten(m.get("overrides", {}))}
    _config(flat)
    return flat


def scaled(flat: Mapping[str, Any], lr_mult: float, batch_mult: int, b2: float | None = None) -> dict:
    out = {**flat, "optim.lr": flat["optim.lr"] * lr_mult,
           "optim.min_lr": flat["optim.min_lr"] * lr_mult,
           "train.global_batch_size": int(flat["train.global_batch_size"] * batch_mult)}
    if b2 is not None:
        out["optim.b2"] = float(b2)
    return out


def cell_id(cfg: Mapping[str, Any], seeds: list[int], every: int) -> str:
    blob = json.dumps({"config": id_settings(cfg), "seeds": seeds, "K": every}, sort_keys=True,
                      default=repr)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def store_cell(flat: Mapping[str, Any], seeds: list[int], every: int) -> Cell:
    """A map cell in the one store: its full config, seeds and K."""
    return Cell(KIND, CODE, {"config": dict(flat), "seeds": [int(s) for s in seeds],
                             "curvature_every": int(every)}, "simulate.phase_map:compute_cell")


def compute_cell(config: Mapping[str, Any]) -> dict:
    """The cell's computation: its lanes read arm_tokens of its batch size (the same
    batches for seed k in every cell of that size)."""
    from simulate.seeds import arm_tokens   # jax: only when cells run
    cfg, seeds = _config(config["config"]), list(config["seeds"])
    return {"rows": run_cell(cfg, seeds, int(config["curvature_every"]), arm_tokens(cfg, seeds))}


def run_cell(cfg: RunConfig, seeds: list[int], every: int, tokens: np.ndarray) -> pd.DataFrame:
    """One cell: the lanes as one program (simulate.seeds.run_arm with the stability number
    every `every` steps), the claims' arm table plus S and the online proxy S_secant of the
    `every` steps before it (module docstring)."""
    from simulate.seeds import run_arm   # jax: only when cells run
    res = run_arm(cfg, seeds, tokens=tokens, curvature_every=every, secant=True)
    df = arm_table(res, seeds)
    for col, key in (("S", "stability"), ("S_secant", "S_secant")):
        S = np.full(res["loss"].shape, np.nan)
        S[:, every - 1::every] = res[key]
        df[col] = S.ravel()
    return df


def run_map(spec: dict, out: str | Path, ladder: str | Path | None = None,
            progress: bool = True) -> Path:
    """Calibrate, then run every cell not yet in the store out/cells (module docstring)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    store = CellStore(out / "cells")
    m = spec["map"]
    meta_path = out / "map.json"
    targets = ladder_targets(ladder) if ladder else {g: float(v) for g, v in spec["targets"].items()}
    if not targets:
        raise ConfigError(f"{spec['path']}: no [targets] and no --ladder: the 70B's rho per group is needed")
    # lane seeds first_seed .. first_seed + seeds - 1: a lane's seed draws its init and its
    # data (the Zipf-Markov source), so a held-out map takes seeds no training map used
    first = int(m.get("first_seed", 0))
    seeds = list(range(first, first + int(m["seeds"])))
    every = int(m.get("curvature_every", 10))
    flat = base_flat(spec)
    if flat["train.num_steps"] % every:
        raise ConfigError(f"train.num_steps {flat['train.num_steps']}: not a multiple of "
                          f"curvature_every {every}")
    cal_spec = dict(m.get("calibrate", {"rounds": 2, "seeds": 2, "steps": 300}))
    meta = {"title": m.get("title", ""), "config_file": spec["path"], "sets": spec["sets"],
            "seeds": seeds, "curvature_every": every, "targets": targets,
            "spikes": spec["spikes"], "grid": {k: m[k] for k in ("lr_mult", "b2", "batch_mult")},
            "calibration": {}, "cells": []}

    def save():
        atomic_write_bytes(meta_path, json.dumps(meta, indent=2, default=repr).encode())

    # pair by pair, the smaller batch first, lr in the file's order (a diverging pilot falls
    # back to the previous lr's eps): calibrate, then run the pair's missing cells,
    # so an interrupted map has whole pairs done and map.json lists what exists
    pairs = sorted(product(m["lr_mult"], m["batch_mult"]), key=lambda p: p[1])   # lr as listed
    bar = tqdm(total=len(pairs) * len(m["b2"]), desc="phase-map cells", unit="cell",
               disable=not progress, file=sys.stderr)
    last_eps = {g: float(flat[k]) for g, k in EPS_KEYS.items() if flat.get(k) is not None}
    for lr_mult, batch_mult in pairs:
        key = f"lr_mult={lr_mult:g},batch_mult={batch_mult:g}"
        pilot = scaled(flat, lr_mult, batch_mult, m["b2"][0])   # the cells' own length
        if cal_spec.get("steps"):
            pilot.update({"train.num_steps": int(cal_spec["steps"]),
                          "optim.warmup_steps": int(cal_spec["steps"]) // 3})
        want = {"pilot": pilot, "targets": targets, "rounds": int(cal_spec["rounds"]),
                "seeds": int(cal_spec["seeds"])}
        res = run_cells(store, [calibration_cell(**want)], progress=False)[0]
        eps, note = res["eps"], ""
        if not eps:     # every pilot diverged: the previous (smaller) lr's eps
            eps, note = last_eps, "every pilot diverged; eps of the previous lr_mult"
        have = meta["calibration"][key] = {**want, "eps": eps, "pilot_rho": res["rho"],
                                           "note": note, "rounds_done": res["rounds"]}
        last_eps = have["eps"]
        pair = []
        for b2 in m["b2"]:
            flat_cell = with_group_eps(scaled(flat, lr_mult, batch_mult, b2), have["eps"])
            cfg = _config(flat_cell)
            c = store_cell(flat_cell, seeds, every)
            meta["cells"].append({"id": cell_id(flat_cell, seeds, every), "lr_mult": lr_mult,
                                  "b2": b2, "batch_mult": batch_mult, "lr": flat_cell["optim.lr"],
                                  "global_batch_size": cfg.train.global_batch_size,
                                  "eps": have["eps"], "config": flat_cell,
                                  "cell": {"kind": c.kind, "key": c.key}})
            pair.append(c)
        run_cells(store, pair, progress=False)
        save()
        bar.update(len(pair))
    bar.close()
    return out


def check_stability(spec: dict, out: str | Path, progress: bool = True) -> pd.DataFrame:
    """The tracker (Program.stability, 3 warm-started products every curvature_every steps,
    as in the cells) against a cold POWER_ITERS-product power iteration of the same operator
    (simulate.curvature, all parameters as one group) at every `every`-th step, on the
    trainer's step (Program.step_fn) for a few seeds at the calibrated eps of batch_mult 1:
    the map's `check` table (steps, every, lr_mult, seeds). Writes and returns
    out/stability_check.csv (lr_mult, seed, step, S_tracker, S_power, S_secant: the online
    proxy over the K steps before the row's, simulate.program.secant_update)."""
    import jax   # jax: only when the check runs
    import jax.numpy as jnp
    from simulate import optim as jopt
    from simulate.curvature import make_curvature_fn
    from simulate.program import secant_init, secant_readings, secant_update, program
    from simulate.seeds import arm_tokens
    out = Path(out)
    path = out / "stability_check.csv"
    meta = json.loads((out / "map.json").read_text())
    K = int(meta["curvature_every"])
    chk = {"steps": 300, "every": 30, "lr_mult": None, "seeds": 2, **spec["map"].get("check", {})}
    num_steps, every, lr_mults = int(chk["steps"]), int(chk["every"]), chk["lr_mult"]
    seeds = list(range(int(chk["seeds"])))
    if every % K:
        raise ConfigError(f"check.every {every}: not a multiple of curvature_every {K}")
    rows = []
    cells = [c for c in meta["cells"] if c["batch_mult"] == meta["grid"]["batch_mult"][0]
             and c["b2"] == meta["grid"]["b2"][0]]
    for c in tqdm(cells, desc="stability check", disable=not progress, file=sys.stderr):
        if lr_mults is not None and c["lr_mult"] not in lr_mults:
            continue
        flat = {**c["config"], "train.num_steps": num_steps,
                "optim.warmup_steps": num_steps // 3}
        cfg = _config(flat)
        prog = program(cfg)
        ctl = prog.controls(cfg, range(1, num_steps + 1))
        loss = lambda p, b: prog.loss(p, b, cfg.train.loss_scale)[0]  # noqa: E731
        power = make_curvature_fn(loss, {n: "all" for n in prog.names}, ["all"], POWER_ITERS)
        stab = jax.jit(prog.stability)
        secant = jax.jit(lambda sec, g, new, old, st, c: secant_update(sec, g, new, old,
                                                                        prog._pinv(st, c)))
        readings = jax.jit(secant_readings)   # jitted, as eager ops each compile a program

        @jax.jit
        def start(params, key):   # the power iteration's start vector, the secant's state
            leaves = jax.tree.leaves(params)
            keys = jax.random.split(jax.random.fold_in(key, 1), len(leaves))
            return (prog.tree([jax.random.normal(k, x.shape, jnp.float32)
                               for k, x in zip(keys, leaves)]), secant_init(params))
        eps = {n: float(ctl.eps[0][i]) for i, n in enumerate(prog.names)}
        tokens = arm_tokens(cfg, seeds)
        for j, seed in enumerate(seeds):
            params, state = prog.init(seed)
            u, sec = start(params, jax.random.PRNGKey(seed))
            sums = np.zeros(3)
            for s in range(1, num_steps + 1):
                batch = jnp.asarray(tokens[j, s - 1])
                new_params, state, out_s = prog.step_fn(params, state, batch, ctl.at(s - 1),
                                                        with_grads=True)
                sec, terms = secant(sec, out_s["grads"], new_params, params, state, ctl.at(s - 1))
                params, sums = new_params, sums + np.asarray(terms, np.float64)
                if s % K == 0:
                    S, u = stab(params, state, batch, ctl.at(s - 1), u)
                if s % every == 0:
                    adam = jopt.adam_state(state)
                    _, pre = power(params, batch, adam.nu, adam.count, cfg.optim.b1, cfg.optim.b2,
                                   eps, jax.random.PRNGKey(10_000 + s))
                    S_secant = readings(sums.astype(np.float32), ctl.lr[s - 1],
                                        ctl.loss_scale[s - 1])[0]
                    rows.append({"lr_mult": c["lr_mult"], "seed": seed, "step": s,
                                 "S_tracker": float(S),
                                 "S_power": float(ctl.lr[s - 1]) * float(np.asarray(pre)[0]) / 2,
                                 "S_secant": float(S_secant)})
                if s % K == 0:
                    sums = np.zeros(3)
    df = pd.DataFrame(rows)
    atomic_write_bytes(path, df.to_csv(index=False).encode())
    return df
