"""The problems `adamspike sweep` and `adamspike replicate` run: batched adapters around
simulate/, each over the dotted keys of one config schema (adamspike.config sections).

A problem declares only which keys a grid may set and which of them are static (shapes,
code paths, step counts: compiled separately); every value is validated by the schema's
own field metadata (RunConfig's for optim / train / mitigation keys), never re-declared.
`run(static, scalars, seeds)` returns traces [N, T]: loss, an optional detection signal,
and the precursors of the problem's shallow group (adamspike.depth_groups; rms_t,
sat_frac, bimodality, grad_mom_cos, rho with adamspike.metrics' definitions; rho of the
group: adamspike.depth_groups.group_rho over its tensors).

quadratic  simulate.quadratic (Bai et al.): 1/2 theta^T H theta under Adam, float64 with an
           exact power-of-two rescaling. Keys: optim.lr / eps / b1 / b2 (vmapped),
           quadratic.noise / theta0 (vmapped), train.num_steps, quadratic.dim / lam_min /
           lam_max / rotate (static). Spikes are counted by simulate.quadratic.count_spikes
           (heights in decades). The single tensor theta is its own shallow group.
mlp        simulate.mlp's networks ("sin": Bai's 2-layer FNN; "deep": a tanh MLP), the step
           of simulate.mlp.make_step vmapped over seeds and optim.lr / eps / b1 / b2; static:
           train.num_steps, train.loss_scale, optim.grad_clip, the mitigation keys whose
           hook simulate.mlp implements (HOOKS) and the mlp.* section (kind, width, depth, num_points, batch (0 = full), init_gain).
           Shallow = the depth group of each tensor's layer (adamspike.depth_groups with L =
           the hidden layers; no embed group): for depth <= 10, layers.0.
llama      the JAX tiny LLaMA (simulate.llama_train.train, with LLAMA_BASE: copy task,
           constant lr 1e-2 after 50 warmup steps, b2 0.999, no clipping), one run after
           another (every key is static: the trainer is a host loop that writes a run
           directory, read back here). Any RunConfig key may be set (including every
           mitigation.* key of the registry and guard.*). Shallow = the embed and shallow
           groups (rho per step: adamspike.depth_groups.group_rho over them, as for mlp;
           max of rms_t / sat_frac / grad_mom_cos, median of bimodality). With
           guard.enabled the loss trace is the kept trajectory, and the table
           gets online_spikes, guard_rollbacks, guard_skipped_batches, guard_aborted.

The quadratic and the MLP have one config each (QuadraticConfig, MLPConfig: one set of
defaults, the schema's under the problem's `base`) and one run-directory writer
(save_quadratic, save_mlp; run.json's config from run_config): the sweep's --save-runs and
`adamspike simulate quadratic|mlp` (whose flags are these dotted keys) both go through them.
Keys outside `knobs` (quadratic.rescale / dtype, mlp.input_scale / curvature, telemetry.*)
only shape a written run directory, never a sweep cell.
"""

from __future__ import annotations

import functools
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd

from adamspike.config import ConfigError, flatten, nest, param, to_dict
from adamspike.depth_groups import depth_group, group_rho, shallow_depths
from adamspike.metrics import finalize, shape_stats
from adamspike.mitigations import REGISTRY, MitigationSection, require_hooks
from adamspike.mitigations import all_keys as all_mitigation_keys
from adamspike.mitigations import plan as mitigation_plan
from adamspike.rundir import load_run
from adamspike.train_config import OptimSection, RunConfig, TelemetrySection, TrainSection
from simulate import optim as O
from simulate.llama_train import train as train_llama
from simulate.mlp import HOOKS as MLP_HOOKS
from simulate.mlp import MLPSpec, dataset, init_params, make_step, tensor_meta
from simulate.mlp import train as train_mlp
from simulate.quadratic import (QuadraticSpec, count_spikes, eps_star, run_quadratic,
                                simulate_quadratic)
from simulate.runner import quadratic_traces, write_run
from simulate.sweep import Problem


@dataclass
class QuadraticSection:
    dim: int = param(1, lo=1)
    lam_min: float = param(1.0, lo=0.0, lo_open=True)
    lam_max: float = param(1.0, lo=0.0, lo_open=True)
    rotate: bool = param(False)
    noise: float = param(0.0, lo=0.0, help="gradient noise std")
    theta0: float = param(1.0)
    rescale: bool = param(True, help="exact power-of-two rescaling (false: plain floating "
                                     "point, theta may underflow; simulate.quadratic)")
    dtype: str = param("float64", choices=("float32", "float64"))


@dataclass
class QuadraticConfig:
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    quadratic: QuadraticSection = field(default_factory=QuadraticSection)
    telemetry: TelemetrySection = field(default_factory=TelemetrySection)   # every: layers rows


@dataclass
class MLPSection:
    kind: str = param("sin", choices=("sin", "deep"))
    width: int = param(256, lo=1)
    depth: int = param(1, lo=1, help="hidden layers")
    num_points: int = param(256, lo=1)
    batch: int = param(0, lo=0, help="minibatch size, 0 = full batch")
    init_gain: float = param(1.0, lo=0.0, lo_open=True)
    input_scale: float = param(1.0, lo=0.0, lo_open=True,
                               help="'deep': x is multiplied by this (small: small W0 gradients)")
    curvature: bool = param(False, help="run directories: lam_hat_grad (one Hessian-vector "
                                        "product per step) and 2/lr as steps columns")


@dataclass
class MLPConfig:
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    mitigation: MitigationSection = field(default_factory=MitigationSection)
    mlp: MLPSection = field(default_factory=MLPSection)
    telemetry: TelemetrySection = field(default_factory=TelemetrySection)   # every, hist_every


# ----------------------------------------------------------------------------- quadratic

@functools.lru_cache(maxsize=32)
def _quadratic_fn(spec):

    return jax.jit(jax.vmap(lambda hp: simulate_quadratic(hp, spec)))


def _precursors(sums: np.ndarray, eps: np.ndarray) -> dict[str, np.ndarray]:
    """[N, T, NUM_SUMS] telemetry sums -> precursor traces [N, T] (per-run eps)."""
    out = {k: [] for k in ("rms_t", "sat_frac", "bimodality", "grad_mom_cos", "rho")}
    for s, e in zip(sums, eps):
        with np.errstate(all="ignore"):
            m = finalize(s, float(e)) if e > 0 else finalize(s, 1.0)
            bc = shape_stats(m["r_mean"], m["r_m2"], m["r_m3"], m["r_m4"])["bimodality"]
        for k in ("rms_t", "sat_frac", "grad_mom_cos", "rho"):
            out[k].append(m[k] if (k != "rho" or e > 0) else np.full_like(m[k], np.inf))
        out["bimodality"].append(bc)
    return {k: np.asarray(v) for k, v in out.items()}


QUADRATIC_HP = {"lr": "optim.lr", "eps": "optim.eps", "b1": "optim.b1", "b2": "optim.b2",
                "noise": "quadratic.noise", "theta0": "quadratic.theta0"}


def _quadratic_spec(cfg: QuadraticConfig) -> QuadraticSpec:
    q = cfg.quadratic
    return QuadraticSpec(num_steps=cfg.train.num_steps, dim=q.dim, lam_min=q.lam_min,
                         lam_max=q.lam_max, rotate=q.rotate, rescale=q.rescale, dtype=q.dtype,
                         record_sums=True)


def _check_quadratic(cfg: QuadraticConfig) -> None:
    try:
        _quadratic_spec(cfg)
    except ValueError as e:
        raise ConfigError(f"quadratic.{e}") from None


def _run_quadratic(static: dict, scalars: dict, seeds: np.ndarray) -> dict:

    spec = _quadratic_spec(QUADRATIC.config(static))
    hp = {k: np.asarray(scalars[key], np.float64) for k, key in QUADRATIC_HP.items()}
    hp["seed"] = np.asarray(seeds, np.uint32)
    with jax.enable_x64(True):
        out = jax.tree.map(np.asarray, _quadratic_fn(spec)(hp))
    return {"loss": out["loss"], "signal": out["log10_loss"],
            **_precursors(out["sums"], hp["eps"])}


def _detect_quadratic(signal: np.ndarray, **kw):
    sp = count_spikes(signal, **kw)
    sp["height"] = sp["log10_height"]
    return sp


def save_quadratic(p: Mapping[str, Any], seed: int, path: Path, progress: bool = False) -> dict:
    """One run directory of the quadratic at dotted settings `p` over the problem's base
    (the sweep's --save-runs and `adamspike simulate quadratic`: one config, one writer);
    returns simulate.quadratic's output."""
    cfg = QUADRATIC.config({**p, "train.seed": seed})
    spec = _quadratic_spec(cfg)
    flat = flatten(to_dict(cfg))
    hp = {k: flat[key] for k, key in QUADRATIC_HP.items()} | {"seed": seed}
    t0 = time.perf_counter()
    out = run_quadratic(hp, spec)
    meta = run_config(QUADRATIC, cfg, eps_star=eps_star(hp["lr"], spec.lam_max, hp["b1"]))
    write_run(path, quadratic_traces(out, spec, hp, time.perf_counter() - t0), config=meta,
              problem=meta["problem"], layers_every=cfg.telemetry.every, progress=progress)
    return out


QUADRATIC = Problem(
    name="quadratic",
    schema=QuadraticConfig,
    knobs={"train.num_steps": True, "quadratic.dim": True, "quadratic.lam_min": True,
           "quadratic.lam_max": True, "quadratic.rotate": True, "optim.lr": False,
           "optim.eps": False, "optim.b1": False, "optim.b2": False, "quadratic.noise": False,
           "quadratic.theta0": False},
    base={"optim.lr": 1e-2, "optim.b2": 0.999, "train.num_steps": 20_000},
    run=_run_quadratic,
    spikes={},
    max_vmap=128,
    detect=_detect_quadratic,
    spike_keys=("window", "min_decades", "detect_window", "k"),
    height_unit="decades",
    check=_check_quadratic,
    save=save_quadratic,
)


# ----------------------------------------------------------------------------- mlp

def _mlp_spec(cfg: MLPConfig, seed: int = 0) -> MLPSpec:
    m = cfg.mlp
    return MLPSpec(kind=m.kind, width=m.width, depth=m.depth, num_points=m.num_points,
                   batch_size=m.batch, init_gain=m.init_gain, input_scale=m.input_scale,
                   seed=seed)


def _check_mlp(cfg: MLPConfig) -> None:
    require_hooks(cfg, MLP_HOOKS, "the mlp problem")
    try:
        _mlp_spec(cfg)
    except ValueError as e:
        raise ConfigError(f"mlp.{e}") from None


def mlp_shallow(spec) -> list[int]:
    """Telemetry rows (sorted names, simulate.mlp.tensor_meta) of the shallow group: the
    hidden layers' depth groups with L = spec.depth (the output layer is the head)."""
    names, depths, _, _ = tensor_meta(spec)
    return [i for i, (n, d) in enumerate(zip(names, depths))
            if not n.startswith("output") and depth_group(d, spec.depth) == "shallow"]


@functools.lru_cache(maxsize=16)
def _mlp_fn(static_items: tuple):
    """jit(vmap(run_one)) for one static setting: simulate.mlp.make_step under lax.scan."""
    st = dict(static_items)
    spec = _mlp_spec(MLP.config(st))
    scale = float(st["train.loss_scale"])
    shallow = np.asarray(mlp_shallow(spec))   # a constant index (eager jnp: one more program)
    plan = mitigation_plan(MLP.config(st), {}, spec.depth)   # the `direction` hook only

    def run_one(params, x, y, key, hp):
        tx = O.adamw_chain(hp["b1"], hp["b2"], hp["eps"], hp["lr"],
                           st["optim.grad_clip"] * scale, 0.0, plan)
        step = make_step(spec, x, y, tx, hp["lr"], hp["b1"], hp["b2"], hp["eps"], scale,
                         batch_key=key)

        def shallow_step(carry, t):
            carry, out = step(carry, t)
            return carry, {"loss": out["loss"], "sums": out["sums"][shallow]}

        _, out = jax.lax.scan(shallow_step, (params, tx.init(params)),
                              jnp.arange(1, st["train.num_steps"] + 1))
        return out

    return jax.jit(jax.vmap(run_one))


def _run_mlp(static: dict, scalars: dict, seeds: np.ndarray) -> dict:


    cfg = MLP.config(static)
    specs = [_mlp_spec(cfg, int(s)) for s in seeds]
    inits = [init_params(sp) for sp in specs]
    params = {k: np.stack([p[k] for p in inits]) for k in inits[0]}
    data = [dataset(sp) for sp in specs]
    x, y = np.stack([d[0] for d in data]), np.stack([d[1] for d in data])
    keys = np.stack([np.asarray(jax.random.PRNGKey(int(s) + 7)) for s in seeds])
    hp = {k: np.asarray(scalars[f"optim.{k}"], np.float32) for k in ("lr", "eps", "b1", "b2")}
    out = jax.tree.map(np.asarray, _mlp_fn(tuple(sorted(static.items())))(params, x, y, keys, hp))
    names, _, _, numels = tensor_meta(specs[0])
    shallow_names = [names[i] for i in mlp_shallow(specs[0])]
    shallow_numel = [numels[i] for i in mlp_shallow(specs[0])]
    w = shallow_names.index("layers.0.weight")      # bimodality of the first weight matrix
    traces = {k: [] for k in ("rms_t", "sat_frac", "bimodality", "grad_mom_cos", "rho")}
    for sums, e in zip(out["sums"], scalars["optim.eps"]):   # sums [T, shallow tensors, NUM_SUMS]
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # all-NaN steps (e.g. cos at t=1)
            m = finalize(sums, float(e) if e > 0 else 1.0)
            traces["bimodality"].append(shape_stats(m["r_mean"][:, w], m["r_m2"][:, w],
                                                    m["r_m3"][:, w], m["r_m4"][:, w])["bimodality"])
            for k in ("rms_t", "sat_frac", "grad_mom_cos"):
                traces[k].append(np.nanmax(m[k], axis=1))
            traces["rho"].append(group_rho(m["rho"], shallow_numel) if e > 0
                                 else np.full(len(sums), np.inf))
    return {"loss": out["loss"], **{k: np.asarray(v) for k, v in traces.items()}}


# the keys of a toy's config its run directory states: those the toy reads (the quadratic
# has a constant lr, no clipping and no batch: its optim.schedule / grad_clip and train.*
# batch keys would state settings it never applied)
RUN_KEYS = {
    "quadratic": ("optim.lr", "optim.eps", "optim.b1", "optim.b2", "train.num_steps",
                  "train.seed", "quadratic.", "telemetry.every"),
    "mlp": ("optim.", "train.num_steps", "train.seed", "train.loss_scale", "mitigation.",
            "mlp.", "telemetry.every", "telemetry.hist_every"),
}


def run_config(problem: "Problem", cfg: Any, **derived: Any) -> dict:
    """run.json's config of a toy run, whichever command wrote it (the sweep's --save-runs,
    `adamspike simulate quadratic|mlp`): the validated config's keys the toy reads
    (RUN_KEYS), sections nested (train.seed the run's seed), and `problem` a table: the
    toy's name as `kind`, its seed and numbers derived from the config (e.g. the
    quadratic's eps_star). adamspike.rundir.normalize_config reads the shapes older runs
    have."""
    keep = RUN_KEYS[problem.name]
    flat = {k: v for k, v in flatten(to_dict(cfg)).items()
            if any(k == p or (p.endswith(".") and k.startswith(p)) for p in keep)}
    return {**nest(flat), "problem": {"kind": problem.name, "seed": cfg.train.seed, **derived}}


def save_mlp(p: Mapping[str, Any], seed: int, path: Path, progress: bool = False) -> dict:
    """One run directory of the MLP at dotted settings `p` over the problem's base (the
    sweep's --save-runs and `adamspike simulate mlp`: one config, one writer); returns
    simulate.mlp.train's traces."""
    cfg = MLP.config({**p, "train.seed": seed})
    traces = train_mlp(_mlp_spec(cfg, seed), cfg.optim, cfg.train.num_steps,
                       loss_scale=cfg.train.loss_scale,
                       plan=mitigation_plan(cfg, {}, cfg.mlp.depth),
                       hist_every=cfg.telemetry.hist_every, curvature=cfg.mlp.curvature,
                       progress=progress)
    meta = run_config(MLP, cfg)
    write_run(path, traces, config=meta, problem=meta["problem"],
              layers_every=cfg.telemetry.every, progress=progress)
    return traces


MLP = Problem(
    name="mlp",
    schema=MLPConfig,
    knobs={"train.num_steps": True, "mlp.kind": True, "mlp.width": True, "mlp.depth": True,
           "mlp.num_points": True, "mlp.batch": True, "mlp.init_gain": True,
           "optim.grad_clip": True, "train.loss_scale": True,
           **{k: True for m in REGISTRY.values() if m.hook in MLP_HOOKS for k in m.keys},
           "optim.lr": False, "optim.eps": False, "optim.b1": False, "optim.b2": False},
    base={"train.num_steps": 5000, "optim.lr": 1e-3, "optim.b2": 0.999, "optim.grad_clip": 0.0,
          "optim.schedule": "constant", "telemetry.hist_every": 100},
    run=_run_mlp,
    spikes={"window": 50, "k": 6.0, "min_rel_jump": 0.5, "log": True},
    max_vmap=32,
    check=_check_mlp,
    save=save_mlp,
)


# ----------------------------------------------------------------------------- llama

LLAMA_SCALARS = ("online_spikes", "guard_rollbacks", "guard_skipped_batches", "guard_aborted")
# configs/toy_spike.toml's settings: the copy task spikes late and rarely at b2 = 0.999
LLAMA_BASE = {"model.preset": "tiny", "data.task": "copy", "optim.lr": 1e-2,
              "optim.schedule": "constant", "optim.warmup_steps": 50, "optim.b2": 0.999,
              "optim.weight_decay": 0.0, "optim.grad_clip": 0.0, "train.num_steps": 1500,
              "train.global_batch_size": 32, "train.seq_len": 32, "telemetry.every": 1,
              "telemetry.hist_every": 0, "checkpoint.every": 25}


def _llama_config(p: dict, seed: int) -> RunConfig:
    return LLAMA.config({**p, "train.seed": seed})


def _llama_check(cfg: RunConfig) -> None:
    if cfg.guard.enabled and cfg.checkpoint.every < 1:
        raise ConfigError("checkpoint.every: guard.enabled needs snapshots (e.g. 25)")


def _run_llama(static: dict, scalars: dict, seeds: np.ndarray) -> dict:
    """One run after another (the trainer is a host loop writing a run directory, read back
    with adamspike.rundir.load_run); traces padded with NaN after a divergence or a guard
    abort. With the guard, the loss trace is the kept trajectory (rolled-back steps are
    replaced by their re-runs); the spike that made the guard abort is put back at its step,
    so an abort counts as a spike the guard did not avoid (and as diverged). Per-run
    scalars: guard_rollbacks, guard_skipped_batches, guard_aborted (0 without the guard) and
    online_spikes (the detector's "spike" / "nonfinite_loss" events: spiking steps of an
    unguarded run, detections that were rolled back or aborted a guarded one)."""


    steps = static["train.num_steps"]
    out = {k: np.full((len(seeds), steps), np.nan)
           for k in ("loss", "rms_t", "sat_frac", "bimodality", "grad_mom_cos", "rho")}
    extra = {k: np.zeros(len(seeds)) for k in LLAMA_SCALARS}
    cols = ["rms_t", "sat_frac", "grad_mom_cos", "rho", "r_mean", "r_m2", "r_m3", "r_m4"]
    for i, seed in enumerate(seeds):
        with tempfile.TemporaryDirectory() as tmp:
            run = load_run(train_llama(_llama_config(static, int(seed)), Path(tmp) / "run", progress=False),
                           tables=("steps", "layers"), layer_columns=cols)
        idx = run.steps["step"].to_numpy() - 1
        out["loss"][i, idx] = run.steps["loss"].to_numpy()
        ev = run.events
        types = ev["type"].astype(str) if "type" in ev else pd.Series([], dtype=str)
        detected = ev[types.isin(["spike", "nonfinite_loss"]).to_numpy()]
        extra["online_spikes"][i] = len(detected)
        extra["guard_rollbacks"][i] = int((types == "rollback").sum())
        if (types == "skip_batches").any():
            extra["guard_skipped_batches"][i] = float(
                ev.loc[(types == "skip_batches").to_numpy(), "num_batches"].sum())
        if (types == "abort").any():
            extra["guard_aborted"][i] = 1.0
            last = pd.to_numeric(detected["loss"], errors="coerce").iloc[-1]
            out["loss"][i, int(detected["step"].iloc[-1]) - 1] = last if np.isfinite(last) else np.inf
        num_layers = _llama_config(static, int(seed)).model.llama().num_layers
        lay = run.layers[run.layers["depth"].isin(shallow_depths(num_layers))].copy()
        lay["bimodality"] = shape_stats(lay["r_mean"], lay["r_m2"], lay["r_m3"], lay["r_m4"])["bimodality"]
        g = lay.groupby("step")
        rho = lay.groupby(["step", "name"])["rho"].first().unstack("name")
        numel = lay.groupby("name")["numel"].first().reindex(rho.columns).to_numpy(float)
        agg = {"rms_t": g["rms_t"].max(), "sat_frac": g["sat_frac"].max(),
               "grad_mom_cos": g["grad_mom_cos"].max(), "bimodality": g["bimodality"].median(),
               "rho": pd.Series(group_rho(rho.to_numpy(float), numel), index=rho.index)}
        for k, ser in agg.items():
            out[k][i, ser.index.to_numpy() - 1] = ser.to_numpy()
    return {**out, "scalars": extra}


def _save_llama(p: dict, seed: int, path: Path) -> None:
    train_llama(_llama_config(p, seed), path, progress=False)


# The RunConfig keys a llama grid may set (all static), with every mitigation of the
# registry: a new mitigation is sweepable without touching this file.
LLAMA_KNOBS = ("model.preset", "data.task", "train.num_steps", "train.global_batch_size",
               "train.seq_len", "train.loss_scale", "optim.lr", "optim.warmup_steps",
               "optim.eps", "optim.b1", "optim.b2", "optim.grad_clip", "guard.enabled",
               "guard.skip_batches", "guard.max_retries", "checkpoint.every",
               *sorted(all_mitigation_keys()))
LLAMA = Problem(
    name="llama",
    schema=RunConfig,
    knobs={k: True for k in LLAMA_KNOBS},
    base=LLAMA_BASE,
    run=_run_llama,
    spikes={"window": 50, "k": 6.0, "min_rel_jump": 0.2},
    max_vmap=1,
    check=_llama_check,
    save=_save_llama,
)

PROBLEMS: dict[str, Problem] = {p.name: p for p in (QUADRATIC, MLP, LLAMA)}
