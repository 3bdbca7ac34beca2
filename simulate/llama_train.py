"""Train the JAX tiny LLaMA on synthetic tokens and write a run directory (never torch).

    adamspike simulate llama --config configs/tiny.toml --out RUN [--section.key value ...]

Reads `adamspike.train_config.RunConfig` (sections model, optim, train, data, telemetry; the
torch trainer reads the same file). Step s (1-based) reads the samples
`adamspike.order.sample_indices(s, global_batch_size, data.num_samples, train.seed)` of
`SyntheticTokens(data.task, vocab_size, train.seq_len, data.num_samples, train.seed,
data.alpha)`, the same batches the torch trainer reads.

The step is simulate.program's one step function (the program every tiny-LLaMA driver
runs), called once per step with the step's controls (lr_at(s), the registry's per-tensor
eps, v resets, frozen tensors, skip, poison) and, on logged steps, the telemetry sums of
simulate.telemetry.step_telemetry (+ r histograms, sqrt(v_hat)/eps histograms and |g| < eps
counts on hist steps): three compiled variants (plain / telemetry / telemetry + hist), so
steps that log nothing pay nothing.

Compute dtype: train.dtype "bf16" runs the forward and backward in bfloat16 on float32
master parameters (simulate.llama.loss_fn; the torch trainer's FSDP2 policy); Adam's state,
the update and the telemetry stay float32.

Gradient frame: every gradient quantity (steps.grad_norm, layers.grad_rms, rho, ...) is
that of the differentiated objective loss_scale * loss, i.e. what Adam consumed. With
loss_scale s, rho = rms(s g) / eps = rms(g) / (eps / s): the equivalent-eps ratio. The logged
loss is the unscaled loss (CE + z-loss term).

Curvature (telemetry.curvature_every = K > 0; off by default): every K trained steps the top
raw and preconditioned curvature of each depth group (simulate.curvature: power iteration
with Hessian-vector products, telemetry.curvature_iters steps) on that step's batch at the
updated parameters and Adam state, into the run directory's `curvature` table.

Data knobs:
- data.skip_batches: at these steps the batch is read and its loss and pre-clip gradient
  norm are logged (skipped = true, update_norm = 0, no layers row), but the step's result is
  discarded: parameters and Adam state (moments and step count, hence bias correction) are
  left untouched (Levanter's skip-step semantics); the lr schedule still advances
  (lr of row s is lr_at(s), as a torch loop that sets lr per step and skips
  optimizer.step()). An event "skip" is written.
- data.poison_steps: at these steps every target is replaced by POISON_TOKEN (0), a
  deterministic loss spike.
A non-finite loss stops the run after logging that step (event "diverged"), unless the
guard rolls back.

Spike guard (`guard` section, simulate.guard; the torch trainer's policy and event names):
the loss of every trained step is judged online by adamspike.spikes.RollingSpikeDetector
(guard.window, guard.mad_k, guard.min_rel_jump) before its update is applied; "spike" events
are logged whether or not the guard is enabled. With guard.enabled a spike restores the last
good in-memory snapshot (taken every checkpoint.every steps, which must then be > 0; "good":
the loss of its parameters was normal), skips max(guard.skip_batches, batches read since the
snapshot) batches (the data offset grows: step s then reads batch s + offset, as the torch
DataPosition), and re-runs the steps after the snapshot; after guard.max_retries rollbacks
in one incident the next spike aborts the run (event "abort", the run directory ends
there). Events: "spike" -> "rollback" -> "skip_batches" | "abort". Rows: the abandoned
trajectory's rows are never written (rows are held back until their step is at or before
the good snapshot), so each step appears once, from the trajectory of the final weights;
the discarded losses survive in the "spike" events. The "end" event counts rollbacks and
skipped batches.

Mitigations (`mitigation` section, adamspike.mitigations): the registry's StepPlan for
this model, as simulate.program implements it for every driver (model options compiled in;
eps, v resets and freezing as per-step controls; update clipping compiled in). The
telemetry is handed the state after the step's v reset as the previous one.

Measured toy-spike numbers live in the study's generated reports (`adamspike reproduce`),
not here.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from adamspike.config import ConfigError, load_config, to_dict
from adamspike.depth_groups import GROUPS, depth_group
from adamspike.llama import LlamaConfig, spec_by_name
from adamspike.order import sample_indices
from adamspike.rundir import RunFormatError, RunWriter, check_out, environment
from adamspike.synthdata import SyntheticTokens
from adamspike.train_config import RunConfig
from simulate import optim as jopt
from simulate import telemetry as jtel
from simulate.program import program, step_plan
from simulate.curvature import make_curvature_fn
from simulate.guard import SnapshotGuard
from simulate.zipf_data import ZipfMarkov

# ----------------------------------------------------------------------------- data

def dataset(cfg: RunConfig, llama: LlamaConfig):
    """SyntheticTokens (markov, copy) or simulate.zipf_data.ZipfMarkov (zipf)."""
    d = cfg.data
    if d.task == "zipf":
        return ZipfMarkov(llama.vocab_size, cfg.train.seq_len, d.num_samples, cfg.train.seed,
                          d.zipf_exponent)
    return SyntheticTokens(d.task, llama.vocab_size, cfg.train.seq_len, d.num_samples,
                           cfg.train.seed, d.alpha)


def batch_at(data, cfg: RunConfig, step: int, offset: int = 0) -> np.ndarray:
    """Tokens (global_batch_size, seq_len + 1) of optimizer step `step` at data offset
    `offset` (it reads batch step + offset; poisoned batches are the program's `poison`
    control)."""
    idx = sample_indices(step, cfg.train.global_batch_size, cfg.data.num_samples, cfg.train.seed,
                         offset=offset)
    return data.batch(idx)


def _curvature_fn(cfg: RunConfig, prog):
    """simulate.curvature for this model: (fn, groups present), on the program's objective
    loss_scale * loss."""
    llama, scale = prog.llama, cfg.train.loss_scale
    groups = {s.name: depth_group(s.depth, llama.num_layers) for s in spec_by_name(llama).values()}
    present = [g for g in GROUPS if g in set(groups.values())]
    loss = lambda p, b: prog.loss(p, b, scale)[0]  # noqa: E731
    return make_curvature_fn(loss, groups, present, cfg.telemetry.curvature_iters), present


# ----------------------------------------------------------------------------- loop

def train(cfg: RunConfig, out_dir: str | Path, progress: bool = True) -> Path:
    """Run cfg to completion (or divergence, or a guard abort); return the run directory."""
    if cfg.data.source != "synthetic":
        raise ConfigError("data.source: the JAX toy trains on synthetic data only "
                          f"(got {cfg.data.source!r}); use `adamspike train` for indexed data")
    if cfg.model.hf_config:
        raise ConfigError("model.hf_config: not supported by the JAX toy; use a preset")
    if to_dict(cfg.faults) != to_dict(type(cfg.faults)()):
        raise ConfigError("faults: fault injection is the torch trainer's (adamspike train; "
                          "docs/faults.md); the JAX toy does not inject faults")
    if cfg.guard.enabled and cfg.checkpoint.every < 1:
        raise ConfigError("checkpoint.every: guard.enabled needs snapshots to roll back to; the "
                          "JAX trainer keeps one in memory every checkpoint.every steps "
                          f"(got {cfg.checkpoint.every}; e.g. 25)")
    cfg.check()
    llama = cfg.model.llama()
    t, o, tel = cfg.train, cfg.optim, cfg.telemetry
    native = tel.compile != "off"   # the telemetry's native CPU kernel where it applies
    data = dataset(cfg, llama)
    prog = program(cfg)
    tel_spec = prog.telemetry_spec(cfg)
    params, opt_state = prog.init(t.seed)
    guard = SnapshotGuard(cfg.guard, cfg.checkpoint.every, params, opt_state)
    curv_fn, curv_groups = _curvature_fn(cfg, prog) if tel.curvature_every > 0 else (None, [])
    plan = step_plan(cfg)
    curv_eps = {n: float(e) for n, e in plan.tensor_eps.items()} or o.eps

    specs = spec_by_name(llama)
    names = prog.names  # telemetry row order
    tensor_eps = np.array([plan.tensor_eps[n] for n in names])
    depths = [specs[n].depth for n in names]
    kinds = [specs[n].kind for n in names]
    numels = [specs[n].numel for n in names]
    skip, tokens_per_step = set(cfg.data.skip_batches), t.global_batch_size * t.seq_len
    env = environment(jax=jax.__version__, optax=optax.__version__,
                      device=str(jax.devices()[0]), world_size=1)

    with RunWriter(out_dir, backend="jax", config=to_dict(cfg), env=env,
                   flush_every_s=tel.flush_every_s) as writer, \
            ThreadPoolExecutor(max_workers=1) as loader, \
            _progress(t.num_steps, progress) as bar:
        rows = _Rows(writer, buffered=cfg.guard.enabled)
        writer.event("start", step=0, num_params=int(sum(numels)),
                     entropy_rate=data.entropy_rate())
        # The next batch is drawn on a thread while this step computes (numpy, host side).
        offset, step = 0, 1
        pending = loader.submit(batch_at, data, cfg, 1, offset)
        while step <= t.num_steps:
            t0 = time.perf_counter()
            # jnp.asarray (one small copy program per batch shape), not device_put: a
            # 300-step toy_spike run was ~6 % slower in CPU time with device_put (3 A/B pairs)
            batch = jnp.asarray(pending.result())
            if step < t.num_steps:
                pending = loader.submit(batch_at, data, cfg, step + 1, offset)
            log = tel.enabled and step % tel.every == 0
            hist = log and tel.hist_every > 0 and step % tel.hist_every == 0 and step not in skip
            ctl = prog.controls(cfg, [step], offset).at(0)
            # one compiled step for the whole run: what it reports is a traced input
            new_params, new_state, out = prog.step_fn(
                params, opt_state, batch, ctl, tel_spec if tel.enabled else None,
                tel.hist_every > 0, native, report=np.int32(2 if hist else 1 if log else 0))
            out = jax.device_get(out)
            row = dict(loss=float(out["loss"]), grad_norm=float(out["grad_norm"]),
                       clipped=bool(out["clipped"]), update_norm=float(out["update_norm"]),
                       skipped=step in skip)
            if step in skip:  # the program kept params and Adam state (lr: the host's)
                writer.event("skip", step=step, reason="data.skip_batches", loss=row["loss"])
            else:
                # spike guard: judge the loss before its update is applied
                decision = guard.observe(step, row["loss"])
                for kind, fields in decision.events:
                    writer.event(kind, **fields)
                if decision.action == "abort":
                    break
                if decision.action == "rollback":
                    snap, offset, events = guard.rollback(step, offset)
                    for kind, fields in events:
                        writer.event(kind, **fields)
                    rows.discard()          # the abandoned trajectory's rows (steps > snap)
                    params, opt_state, step = snap.params, snap.opt_state, snap.step + 1
                    pending.result()
                    pending = loader.submit(batch_at, data, cfg, step, offset)
                    bar.reset(total=t.num_steps)
                    bar.update(step - 1)
                    continue
                params, opt_state = new_params, new_state
                if curv_fn is not None and step % tel.curvature_every == 0:
                    adam = jopt.adam_state(opt_state)
                    raw, pre = jax.device_get(curv_fn(
                        params, batch, adam.nu, adam.count, o.b1, o.b2, curv_eps,
                        jax.random.PRNGKey(step)))
                    lr_now = o.lr_at(step, t.num_steps)
                    for g, r, p_ in zip(curv_groups, raw, pre):
                        rows.add(step, writer.log_curvature, step, g, float(p_), float(r), lr_now)
                if log:
                    rows.add(step, writer.log_layers, step, columns=jtel.layer_columns(
                        names, depths, kinds, numels, out["sums"], tensor_eps))
                if hist:
                    for i, n in enumerate(names):
                        rows.add(step, writer.log_hist, step, n, depths[i], kinds[i],
                                 out["hists"][i])
                        rows.add(step, writer.log_vhist, step, n, depths[i], kinds[i],
                                 out["vhists"][i], out["g_below_eps"][i])
            rows.add(step, writer.log_step, step=step, tokens=step * tokens_per_step,
                     lr=o.lr_at(step, t.num_steps), step_time_s=time.perf_counter() - t0, **row)
            guard.after_step(step, params, opt_state, offset)
            rows.commit(guard.good.step)
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.4f}", gnorm=f"{row['grad_norm']:.3g}",
                            refresh=False)
            if not math.isfinite(row["loss"]):
                writer.event("diverged", step=step, loss=row["loss"])
                break
            step += 1
        rows.commit(None)
        writer.event("end", step=min(step, t.num_steps), num_rollbacks=guard.num_rollbacks,
                     num_skipped_batches=guard.num_skipped)
    return Path(out_dir)


class _Rows:
    """Rows of the run directory, written at once, or (guard enabled) held back until the
    step they belong to is at or before the guard's good snapshot: a rollback then drops
    the abandoned trajectory's rows (never written), so the tables hold each step once,
    from the trajectory of the final weights (the torch trainer rewrites re-run steps and
    its reader keeps the last row: the same tables). Costs at most ~2 x checkpoint.every
    steps of rows in memory and in what a crash can lose."""

    def __init__(self, writer: RunWriter, buffered: bool):
        self.writer, self.buffered = writer, buffered
        self.held: list[tuple[int, Any, tuple, dict]] = []

    def add(self, at: int, fn, *args, **kwargs) -> None:
        """fn(*args, **kwargs) now, or (buffered) once step `at` is committed."""
        if self.buffered:
            self.held.append((at, fn, args, kwargs))
        else:
            fn(*args, **kwargs)

    def commit(self, upto: int | None) -> None:
        """Write the held rows of steps <= upto (None: all)."""
        keep = []
        for item in self.held:
            if upto is None or item[0] <= upto:
                item[1](*item[2], **item[3])
            else:
                keep.append(item)
        self.held = keep

    def discard(self) -> None:
        self.held = []


def _progress(total: int, enabled: bool):
    return tqdm(total=total, desc="llama", unit="step", disable=not enabled, file=sys.stderr,
                mininterval=0.5)


# ----------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="adamspike simulate llama",
        description="Train the JAX tiny LLaMA on synthetic tokens; write a run directory.")
    ap.add_argument("--config", type=Path, help="TOML RunConfig (default: built-in defaults)")
    ap.add_argument("--out", type=Path, required=True, help="run directory (must not exist)")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    args, overrides = ap.parse_known_args(argv)
    try:
        cfg = load_config(RunConfig, args.config, overrides)
        check_out(args.out)     # new or empty, writable: before anything is compiled
        out = train(cfg, args.out, progress=not args.no_progress)
    except (ConfigError, RunFormatError) as e:
        print(f"adamspike simulate llama: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
