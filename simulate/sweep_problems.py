"""The problems `adamspike sweep` can grid over: batched adapters around simulate/.

Each adapter is a `simulate.sweep.Problem`: its parameters (static ones fix shapes / code
paths, the others are vmapped per run), and `run(static, scalars, seeds)` returning traces
[N, T]: loss, an optional detection signal, and the precursors of the problem's "shallow"
parameters (rms_t, sat_frac, bimodality, grad_mom_cos, rho; adamspike.metrics definitions).

quadratic  simulate.quadratic (Bai et al.): 1/2 theta^T H theta under Adam, float64 with an
           exact power-of-two rescaling. Spikes are counted by simulate.quadratic.count_spikes
           (analysis.spikes on the running max of log10 loss, >= min_decades high), so
           spike heights are in decades. Seeds only matter through gradient noise
           (`noise` > 0). The single tensor theta is its own "shallow layer".
mlp        simulate.mlp's networks ("sin": Bai's 2-layer FNN on sin x + sin 4x; "deep": a tanh
           MLP whose shallow layers get the smallest gradients when init_gain < 1), trained
           here with the same optax pieces as simulate.mlp.train (torch-formula global-norm
           clip, optax Adam with optional StableAdamW update clipping, constant lr, no weight
           decay) but vmapped over seeds (initialisation, data for "deep", minibatch order)
           and lr / eps / b1 / b2. Shallow = the depth-0 tensors (layers.0.weight / bias);
           precursors are the max over them (bimodality: of layers.0.weight).
llama      the JAX tiny LLaMA (simulate.llama_train.train, configs/toy_spike.toml defaults:
           copy task, constant lr 1e-2 after 50 warmup steps, no clipping), run one after
           another (every knob is static: the trainer is a host loop that writes a run
           directory, read back here). Shallow = embedding and block 0 (max / median over
           their tensors). `guard` turns on the trainer's PaLM-style spike guard
           (simulate.guard: roll back to an in-memory snapshot every `snapshot_every` steps,
           skip `guard_skip_batches` batches, <= `guard_max_retries` retries per incident);
           the loss trace is then the kept trajectory, and the table gets online_spikes,
           guard_rollbacks, guard_skipped_batches, guard_aborted. Slow: ~38 s per
           1500-step run on one core (measured; telemetry every step, no histograms).
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from adamspike.config import ConfigError
from simulate.sweep import Param, Problem

_B = dict(lo=0.0, hi=1.0, hi_open=True)


# ----------------------------------------------------------------------------- quadratic

@functools.lru_cache(maxsize=32)
def _quadratic_fn(spec):
    import jax

    from simulate.quadratic import simulate_quadratic
    return jax.jit(jax.vmap(lambda hp: simulate_quadratic(hp, spec)))


def _precursors(sums: np.ndarray, eps: np.ndarray) -> dict[str, np.ndarray]:
    """[N, T, NUM_SUMS] telemetry sums -> precursor traces [N, T] (per-run eps)."""
    from adamspike.metrics import finalize, shape_stats

    out = {k: [] for k in ("rms_t", "sat_frac", "bimodality", "grad_mom_cos", "rho")}
    for s, e in zip(sums, eps):
        with np.errstate(all="ignore"):
            m = finalize(s, float(e)) if e > 0 else finalize(s, 1.0)
            bc = shape_stats(m["r_mean"], m["r_m2"], m["r_m3"], m["r_m4"])["bimodality"]
        for k in ("rms_t", "sat_frac", "grad_mom_cos", "rho"):
            out[k].append(m[k] if (k != "rho" or e > 0) else np.full_like(m[k], np.inf))
        out["bimodality"].append(bc)
    return {k: np.asarray(v) for k, v in out.items()}


def _quadratic_spec(p: dict):
    from simulate.quadratic import QuadraticSpec
    return QuadraticSpec(num_steps=p["steps"], dim=p["dim"], lam_min=p["lam_min"],
                         lam_max=p["lam_max"], rotate=p["rotate"], record_sums=True)


def _check_quadratic(cell: dict) -> None:
    try:
        _quadratic_spec(cell)
    except ValueError as e:
        raise ConfigError(f"quadratic cell: {e}") from None


def _run_quadratic(static: dict, scalars: dict, seeds: np.ndarray) -> dict:
    import jax

    spec = _quadratic_spec(static)
    hp = {k: np.asarray(scalars[k], np.float64) for k in ("lr", "eps", "b1", "b2", "noise", "theta0")}
    hp["seed"] = np.asarray(seeds, np.uint32)
    with jax.enable_x64(True):
        out = jax.tree.map(np.asarray, _quadratic_fn(spec)(hp))
    return {"loss": out["loss"], "signal": out["log10_loss"],
            **_precursors(out["sums"], hp["eps"])}


def _detect_quadratic(signal: np.ndarray, **kw):
    from simulate.quadratic import count_spikes
    sp = count_spikes(signal, **kw)
    sp["height"] = sp["log10_height"]
    return sp


def _save_quadratic(p: dict, seed: int, path: Path) -> None:
    import time

    from simulate.quadratic import run_quadratic
    from simulate.runner import quadratic_traces, write_run

    spec = _quadratic_spec(p)
    hp = {k: p[k] for k in ("lr", "eps", "b1", "b2", "noise", "theta0")} | {"seed": seed}
    t0 = time.perf_counter()
    out = run_quadratic(hp, spec)
    write_run(path, quadratic_traces(out, spec, hp, time.perf_counter() - t0),
              config={"problem": "quadratic", **p, "seed": seed},
              problem={"kind": "quadratic", **p, "seed": seed}, progress=False)


QUADRATIC = Problem(
    name="quadratic",
    params={
        "steps": Param(20_000, static=True, lo=10),
        "dim": Param(1, static=True, lo=1),
        "lam_min": Param(1.0, static=True, lo=0.0, lo_open=True),
        "lam_max": Param(1.0, static=True, lo=0.0, lo_open=True),
        "rotate": Param(False, static=True),
        "lr": Param(1e-2, lo=0.0, lo_open=True),
        "eps": Param(1e-8, lo=0.0),
        "b1": Param(0.9, **_B),
        "b2": Param(0.999, **_B),
        "noise": Param(0.0, lo=0.0),
        "theta0": Param(1.0),
    },
    run=_run_quadratic,
    spikes={},
    max_vmap=128,
    detect=_detect_quadratic,
    spike_keys=("window", "min_decades", "detect_window", "k"),
    height_unit="decades",
    check=_check_quadratic,
    save=_save_quadratic,
)


# ----------------------------------------------------------------------------- mlp

MLP_SHALLOW = ("layers.0.bias", "layers.0.weight")


def _mlp_spec(p: dict, seed: int = 0):
    from simulate.mlp import MLPSpec
    return MLPSpec(kind=p["kind"], width=p["width"], depth=p["depth"], num_points=p["num_points"],
                   batch_size=p["batch"], init_gain=p["init_gain"], seed=seed)


def _check_mlp(cell: dict) -> None:
    try:
        _mlp_spec(cell)
    except ValueError as e:
        raise ConfigError(f"mlp cell: {e}") from None


@functools.lru_cache(maxsize=16)
def _mlp_fn(static_items: tuple):
    """jit(vmap(run_one)) for one static setting."""
    import jax
    import jax.numpy as jnp
    import optax

    from simulate import optim as O
    from simulate.mlp import forward
    from simulate.telemetry import step_telemetry

    st = dict(static_items)
    depth, batch, steps = st["depth"], st["batch"], st["steps"]
    scale = float(st["loss_scale"])

    def run_one(params, x, y, key, hp):
        tx = optax.chain(O.clip_by_global_norm_torch(st["grad_clip"] * scale),
                         O.scale_by_adam_stable(hp["b1"], hp["b2"], hp["eps"], st["update_clip"]),
                         optax.scale_by_learning_rate(hp["lr"]))
        names = sorted(params)
        shallow = [names.index(n) for n in MLP_SHALLOW]

        def loss_fn(p, t):
            if batch:
                idx = jax.random.choice(jax.random.fold_in(key, t), x.shape[0], (batch,), replace=False)
                xb, yb = x[idx], y[idx]
            else:
                xb, yb = x, y
            return jnp.mean((forward(p, xb, depth) - yb) ** 2)

        def step(carry, t):
            p, s = carry
            loss, g = jax.value_and_grad(lambda q: scale * loss_fn(q, t))(p)
            prev = O.adam_state(s)
            upd, s = tx.update(g, s, p)
            p = optax.apply_updates(p, upd)
            sums, _ = step_telemetry(O.consumed_grads(g, s), prev, O.adam_state(s), p,
                                     hp["b1"], hp["b2"], hp["eps"])
            return (p, s), {"loss": loss / scale, "sums": sums[jnp.asarray(shallow)]}

        _, out = jax.lax.scan(step, (params, tx.init(params)), jnp.arange(1, steps + 1))
        return out

    return jax.jit(jax.vmap(run_one))


def _run_mlp(static: dict, scalars: dict, seeds: np.ndarray) -> dict:
    import jax

    from adamspike.metrics import finalize, shape_stats
    from simulate.mlp import dataset, init_params

    specs = [_mlp_spec(static, int(s)) for s in seeds]
    inits = [init_params(sp) for sp in specs]
    params = {k: np.stack([p[k] for p in inits]) for k in inits[0]}
    data = [dataset(sp) for sp in specs]
    x, y = np.stack([d[0] for d in data]), np.stack([d[1] for d in data])
    keys = np.stack([np.asarray(jax.random.PRNGKey(int(s) + 7)) for s in seeds])
    hp = {k: np.asarray(scalars[k], np.float32) for k in ("lr", "eps", "b1", "b2")}
    out = jax.tree.map(np.asarray, _mlp_fn(tuple(sorted(static.items())))(params, x, y, keys, hp))
    traces = {k: [] for k in ("rms_t", "sat_frac", "bimodality", "grad_mom_cos", "rho")}
    for sums, e in zip(out["sums"], scalars["eps"]):      # sums [T, 2 shallow tensors, NUM_SUMS]
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # all-NaN steps (e.g. cos at t=1)
            m = finalize(sums, float(e) if e > 0 else 1.0)
            w = MLP_SHALLOW.index("layers.0.weight")
            traces["bimodality"].append(shape_stats(m["r_mean"][:, w], m["r_m2"][:, w],
                                                    m["r_m3"][:, w], m["r_m4"][:, w])["bimodality"])
            for k in ("rms_t", "sat_frac", "grad_mom_cos"):
                traces[k].append(np.nanmax(m[k], axis=1))
            traces["rho"].append(np.nanmedian(m["rho"], axis=1) if e > 0
                                 else np.full(len(sums), np.inf))
    return {"loss": out["loss"], **{k: np.asarray(v) for k, v in traces.items()}}


def _save_mlp(p: dict, seed: int, path: Path) -> None:
    from adamspike.train_config import OptimSection
    from simulate.mlp import train
    from simulate.runner import write_run

    if p["loss_scale"] != 1.0:
        raise ConfigError("--save-runs: mlp run directories support loss_scale = 1 only")
    optim = OptimSection(lr=p["lr"], schedule="constant", b1=p["b1"], b2=p["b2"], eps=p["eps"],
                         weight_decay=0.0, grad_clip=p["grad_clip"], update_clip=p["update_clip"])
    traces = train(_mlp_spec(p, seed), optim, p["steps"], progress=False)
    write_run(path, traces, config={"problem": "mlp", **p, "seed": seed},
              problem={"kind": "mlp", **p, "seed": seed}, progress=False)


MLP = Problem(
    name="mlp",
    params={
        "steps": Param(5000, static=True, lo=10),
        "kind": Param("sin", static=True, choices=("sin", "deep")),
        "width": Param(256, static=True, lo=1),
        "depth": Param(1, static=True, lo=1),
        "num_points": Param(256, static=True, lo=1),
        "batch": Param(0, static=True, lo=0),
        "init_gain": Param(1.0, static=True, lo=0.0, lo_open=True),
        "grad_clip": Param(0.0, static=True, lo=0.0),
        "update_clip": Param(False, static=True),
        "loss_scale": Param(1.0, static=True, lo=0.0, lo_open=True),
        "lr": Param(1e-3, lo=0.0, lo_open=True),
        "eps": Param(1e-8, lo=0.0),
        "b1": Param(0.9, **_B),
        "b2": Param(0.999, **_B),
    },
    run=_run_mlp,
    spikes={"window": 50, "k": 6.0, "min_rel_jump": 0.5, "log": True},
    max_vmap=32,
    check=_check_mlp,
    save=_save_mlp,
)


# ----------------------------------------------------------------------------- llama

LLAMA_SHALLOW_MAX_DEPTH = 0   # embedding (-1) and block 0: tiny has 2 blocks, L // 10 = 0
LLAMA_SCALARS = ("online_spikes", "guard_rollbacks", "guard_skipped_batches", "guard_aborted")


def _llama_config(p: dict, seed: int):
    from adamspike.config import from_dict
    from adamspike.train_config import RunConfig

    data = {"model": {"preset": p["preset"], "embed_grad_shrink": p["embed_grad_shrink"]},
            "optim": {"lr": p["lr"], "schedule": "constant", "warmup_steps": p["warmup_steps"],
                      "b1": p["b1"], "b2": p["b2"], "eps": p["eps"], "weight_decay": 0.0,
                      "grad_clip": p["grad_clip"], "update_clip": p["update_clip"]},
            "train": {"num_steps": p["steps"], "global_batch_size": p["batch"],
                      "seq_len": p["seq_len"], "seed": seed, "loss_scale": p["loss_scale"]},
            "data": {"task": p["task"]},
            "telemetry": {"every": 1, "hist_every": 0},
            "guard": {"enabled": p["guard"], "skip_batches": p["guard_skip_batches"],
                      "max_retries": p["guard_max_retries"]},
            "checkpoint": {"every": p["snapshot_every"]}}
    return from_dict(RunConfig, data)


def _check_llama(cell: dict) -> None:
    _llama_config(cell, 0)   # raises ConfigError naming the key


def _run_llama(static: dict, scalars: dict, seeds: np.ndarray) -> dict:
    """One run after another (the trainer is a host loop writing a run directory, read back
    with adamspike.rundir.load_run); traces padded with NaN after a divergence or a guard
    abort. With the guard, the loss trace is the kept trajectory (rolled-back steps are
    replaced by their re-runs); the spike that made the guard abort is put back at its step,
    so an abort counts as a spike the guard did not avoid (and as diverged). Per-run
    scalars: guard_rollbacks, guard_skipped_batches, guard_aborted (0 without the guard) and
    online_spikes (the detector's "spike" / "nonfinite_loss" events: spiking steps of an
    unguarded run, detections that were rolled back or aborted a guarded one)."""
    import tempfile

    from adamspike.metrics import shape_stats
    from adamspike.rundir import load_run
    from simulate.llama_train import train

    steps = static["steps"]
    out = {k: np.full((len(seeds), steps), np.nan)
           for k in ("loss", "rms_t", "sat_frac", "bimodality", "grad_mom_cos", "rho")}
    extra = {k: np.zeros(len(seeds)) for k in LLAMA_SCALARS}
    cols = ["rms_t", "sat_frac", "grad_mom_cos", "rho", "r_mean", "r_m2", "r_m3", "r_m4"]
    for i, seed in enumerate(seeds):
        with tempfile.TemporaryDirectory() as tmp:
            run = load_run(train(_llama_config(static, int(seed)), Path(tmp) / "run", progress=False),
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
        lay = run.layers[run.layers["depth"] <= LLAMA_SHALLOW_MAX_DEPTH].copy()
        lay["bimodality"] = shape_stats(lay["r_mean"], lay["r_m2"], lay["r_m3"], lay["r_m4"])["bimodality"]
        g = lay.groupby("step")
        agg = {"rms_t": g["rms_t"].max(), "sat_frac": g["sat_frac"].max(),
               "grad_mom_cos": g["grad_mom_cos"].max(), "bimodality": g["bimodality"].median(),
               "rho": g["rho"].median()}
        for k, ser in agg.items():
            out[k][i, ser.index.to_numpy() - 1] = ser.to_numpy()
    return {**out, "scalars": extra}


def _save_llama(p: dict, seed: int, path: Path) -> None:
    from simulate.llama_train import train
    train(_llama_config(p, seed), path, progress=False)


LLAMA = Problem(
    name="llama",
    params={
        "steps": Param(1500, static=True, lo=2),
        "preset": Param("tiny", static=True),
        "task": Param("copy", static=True, choices=("copy", "markov")),
        "batch": Param(32, static=True, lo=1),
        "seq_len": Param(32, static=True, lo=2),
        "lr": Param(1e-2, static=True, lo=0.0, lo_open=True),
        "warmup_steps": Param(50, static=True, lo=0),
        "eps": Param(1e-8, static=True, lo=0.0),
        "b1": Param(0.9, static=True, **_B),
        "b2": Param(0.999, static=True, **_B),
        "grad_clip": Param(0.0, static=True, lo=0.0),
        "update_clip": Param(False, static=True),
        "embed_grad_shrink": Param(1.0, static=True, lo=0.0, hi=1.0, lo_open=True),
        "loss_scale": Param(1.0, static=True, lo=0.0, lo_open=True),
        # PaLM-style spike guard (simulate.guard; guard.window / mad_k / min_rel_jump stay at
        # their defaults 50 / 6 / 0.2, the detector settings of `spikes` below)
        "guard": Param(False, static=True),
        "guard_skip_batches": Param(200, static=True, lo=0),
        "guard_max_retries": Param(3, static=True, lo=0),
        "snapshot_every": Param(25, static=True, lo=1),
    },
    run=_run_llama,
    spikes={"window": 50, "k": 6.0, "min_rel_jump": 0.2},
    max_vmap=1,
    check=_check_llama,
    save=_save_llama,
)
