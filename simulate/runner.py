"""Write a simulated problem's traces to a run directory (adamspike.rundir, backend "jax").

Traces are a dict of numpy arrays with a leading step axis (step t = 1..num_steps):
    loss, lr, grad_norm (global, before clipping), clipped, update_norm   required
    step_time_s                                                           optional (0 if absent)
    any other 1-D float arrays of length num_steps (e.g. log10_loss, lam_hat_grad) become
    extra steps columns (STEP_EXTRA_KEYS lists the ones kept)
    sums (num_steps, num_tensors, NUM_SUMS) + names, depths, kinds, numels, eps
                                                                          -> layers table
    hists (len(hist_steps), num_tensors, NUM_HIST_BINS) + hist_steps     -> hists table
    vhists (len(hist_steps), num_tensors, NUM_VHIST_BINS), optional     -> vhists table
    g_below_eps (len(hist_steps), num_tensors), optional (|g| < eps)      -> its column
    batch_size                                                            tokens = step * batch
Rows: steps every step (skipped = False: simulations skip nothing); layers every
`layers_every` steps; hists at hist_steps (what the problem recorded) further thinned to
multiples of `hist_every` when given. Events: one "problem" event (kind and parameters) at
the start and one "finished" event; spikes are not events (analysis detects them).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np
import optax
from tqdm import tqdm

from adamspike.metrics import METRIC_NAMES, NUM_HIST_BINS, NUM_VHIST_BINS, finalize
from adamspike.rundir import RunWriter, environment
from simulate.quadratic import HPARAM_DEFAULTS
from simulate.telemetry import NUM_SUMS, layer_columns

REQUIRED = ("loss", "lr", "grad_norm", "clipped", "update_norm")
STEP_EXTRA_KEYS = ("log10_loss", "log10_grad_norm", "lam_hat_grad", "lam_hat_max", "threshold")


def jax_environment(**extra: Any) -> dict:
    dev = jax.devices()[0]
    return environment(jax=jax.__version__, optax=optax.__version__, device=str(dev.platform),
                       world_size=1, **extra)


def write_run(out: str | Path, traces: Mapping[str, Any], *, config: Mapping[str, Any],
              problem: Mapping[str, Any], layers_every: int = 1, hist_every: int = 0,
              progress: bool = True, flush_every_s: float = 30.0) -> Path:
    """Write `traces` (module docstring) to a new run directory `out` (RunWriter refuses an
    existing non-empty one, so nothing is overwritten). Returns the path."""
    missing = [k for k in REQUIRED if k not in traces]
    if missing:
        raise ValueError(f"traces: missing {', '.join(missing)}")
    if layers_every < 1:
        raise ValueError(f"layers_every: must be >= 1, got {layers_every}")
    num_steps = len(traces["loss"])
    cols = {k: np.asarray(traces[k]) for k in REQUIRED}
    cols["step_time_s"] = np.asarray(traces.get("step_time_s", np.zeros(num_steps)), np.float64)
    for k in STEP_EXTRA_KEYS:
        if k in traces:
            v = np.broadcast_to(np.asarray(traces[k], np.float64), (num_steps,))
            cols[k] = v
    for k, v in cols.items():
        if v.shape != (num_steps,):
            raise ValueError(f"traces[{k!r}]: shape {v.shape}, expected ({num_steps},)")
    batch = int(traces.get("batch_size", 1))
    has_layers = "sums" in traces
    if has_layers:
        sums = np.asarray(traces["sums"])
        names = list(traces["names"])
        if sums.shape != (num_steps, len(names), NUM_SUMS):
            raise ValueError(f"traces['sums']: shape {sums.shape}, expected "
                             f"({num_steps}, {len(names)}, {NUM_SUMS})")
    if "hists" in traces:  # validated before anything is written
        hists = np.asarray(traces["hists"])
        hist_steps = np.asarray(traces["hist_steps"])
        if hists.shape != (len(hist_steps), len(traces["names"]), NUM_HIST_BINS):
            raise ValueError(f"traces['hists']: shape {hists.shape} does not match "
                             f"hist_steps / names")
    vhists = np.asarray(traces["vhists"]) if "vhists" in traces and "hists" in traces else None
    if vhists is not None and vhists.shape != (len(hist_steps), len(traces["names"]),
                                               NUM_VHIST_BINS):
        raise ValueError(f"traces['vhists']: shape {vhists.shape} does not match "
                         "hist_steps / names")
    gbe = np.asarray(traces["g_below_eps"]) if vhists is not None and "g_below_eps" in traces \
        else None
    if has_layers:  # finalize all steps at once (vectorised), then slice per step
        key_cols = layer_columns(names, traces["depths"], traces["kinds"], traces["numels"],
                                 np.ones((len(names), NUM_SUMS)), 1.0)
        key_cols = {k: key_cols[k] for k in ("name", "depth", "kind", "numel")}
        metrics = finalize(sums.reshape(-1, NUM_SUMS), float(traces["eps"]))
        metrics = {m: np.asarray(metrics[m]).reshape(num_steps, len(names)) for m in METRIC_NAMES}
    bar = None
    if progress:
        bar = tqdm(total=num_steps, desc="write run", unit="step", file=sys.stderr, mininterval=1.0)
    out = Path(out)
    with RunWriter(out, backend="jax", config=dict(config), env=jax_environment(),
                   flush_every_s=flush_every_s) as w:
        w.event("problem", step=0, **dict(problem))
        t0 = time.time()
        for i in range(num_steps):
            step = i + 1
            row = {k: v[i].item() for k, v in cols.items()}
            row["clipped"] = bool(row["clipped"])
            w.log_step(step=step, tokens=step * batch, skipped=False, **row)
            if has_layers and step % layers_every == 0:
                w.log_layers(step, columns={**key_cols, **{m: v[i] for m, v in metrics.items()}})
            if bar is not None and step % 1000 == 0:
                bar.update(1000)
        if "hists" in traces:
            for j, step in enumerate(hist_steps):
                if hist_every and step % hist_every:
                    continue
                for k, name in enumerate(traces["names"]):
                    w.log_hist(int(step), name, int(traces["depths"][k]), traces["kinds"][k],
                               hists[j, k])
                    if vhists is not None:
                        w.log_vhist(int(step), name, int(traces["depths"][k]),
                                    traces["kinds"][k], vhists[j, k],
                                    None if gbe is None else int(gbe[j, k]))
        w.event("finished", step=num_steps, write_s=round(time.time() - t0, 3))
    if bar is not None:
        bar.update(num_steps - bar.n)
        bar.close()
    return out


def quadratic_traces(out: Mapping[str, Any], spec, hparams: Mapping[str, Any],
                     wall_s: float) -> dict:
    """simulate.quadratic output -> runner traces: one tensor "theta" (depth 0, kind
    "param"), never clipped, constant lr, step_time_s = wall time / steps; no r
    histograms (the problem does not record them)."""
    hparams = {**HPARAM_DEFAULTS, **hparams}
    n = len(out["log10_loss"])
    lr = float(hparams["lr"])
    tr = {k: np.asarray(out[k]) for k in ("loss", "grad_norm", "update_norm", "log10_loss",
                                          "log10_grad_norm", "lam_hat_grad", "lam_hat_max")}
    tr.update(lr=np.full(n, lr), clipped=np.zeros(n, bool), threshold=np.full(n, 2.0 / lr),
              step_time_s=np.full(n, wall_s / n), batch_size=1)
    if "sums" in out:
        tr.update(sums=np.asarray(out["sums"])[:, None, :], names=["theta"], depths=[0],
                  kinds=["param"], numels=[spec.dim], eps=float(hparams["eps"]))
    return tr
