"""Train the JAX tiny LLaMA on synthetic tokens and write a run directory (never torch).

    adamspike simulate llama --config configs/tiny.toml --out RUN [--section.key value ...]

Reads `adamspike.train_config.RunConfig` (sections model, optim, train, data, telemetry; the
torch trainer reads the same file). Step s (1-based) reads the samples
`adamspike.order.sample_indices(s, global_batch_size, data.num_samples, train.seed)` of
`SyntheticTokens(data.task, vocab_size, train.seq_len, data.num_samples, train.seed,
data.alpha)`, the same batches the torch trainer reads.

One jitted step: value_and_grad of `loss_scale * loss` -> simulate.optim.adamw (torch-style
global-norm clip at grad_clip * loss_scale, Adam, decoupled weight decay, lr_at(s)) ->
telemetry sums of simulate.telemetry.step_telemetry on logged steps (+ r histograms on
hist steps). Three compiled variants (plain / telemetry / telemetry + hist) so steps that log
nothing pay nothing.

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
the loss of every trained step is judged online by analysis.spikes.RollingSpikeDetector
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

Toy spikes, measured (configs/toy_spike.toml vs configs/toy_stable.toml). Tiny preset
(2 layers, dim 64), copy task (loss floor log(64)/2 = 2.079), batch 32 x 32, constant lr 1e-2
after 50 warmup steps, no gradient clipping, eps = 1e-8, 1500 steps (~2 min on 2 cores).
Spikes: analysis.spikes.detect_spikes on the loss (window 50, k = 6 MAD, >= 10% jump).

    setting (copy task)                     seeds  spikes    peak loss   max/median update_norm
    b2 = 0.999                                0,1,2  2, 1, 3   2.67 2.87 4.60   9.0 9.8 12.4
    b2 = 0.95                                 0,1,2  0, 0, 0   2.16 2.18 2.18   1.8 1.8 1.8
    b2 = 0.999, loss_scale 1e-5 (eps/s=1e-3)  0,1    5, 4      3.54 2.91        11.9 7.1
    b2 = 0.95,  loss_scale 1e-5               0      0         2.21             3.4
    b2 = 0.999, loss_scale 1e-7 (eps/s=0.1)   0      0  (barely learns: final loss 3.26)
    b2 = 0.999, grad_clip 1.0                 0,1,2  0, 0, 1   2.25 2.17 2.19   2.7 2.8 3.4
(peak loss: max after step 300; the baseline is 2.08-2.10 in every run. The one clipped
spike is at step 291, peak 2.41, while the loss still falls.) With loss_scale
1e-5 the shallow tensors sit at the 70B report's rho = rms(g)/(eps/s) ~ 1 (medians after
step 300: embedding 0.93, block-0 wv 1.13, wo 0.74, wq 0.34, wk 0.53; block-0 MLP 0.06-0.09
with eps_frac > 0.9); at eps = 1e-8 every tensor has rho 1e4..1e6, so eps plays no role there
and the spikes are not the eps-regime mechanism. Lowering b2 removed every spike; the
eps ~ rms(g) regime did not remove them (more spikes: 5 and 4 vs 1-3); eps >> rms(g)
removed them only by freezing the model; global-norm clipping at 1.0 (active on ~5% of the
steps) removed all but one small early one. The Markov task never spiked in any setting tried
(1500 steps, batch 64, grad_clip 1: b2 0.999 / 0.95, lr 3e-3 / 1e-2 / 3e-2, loss_scale 1 /
1e-5; batch 32 unclipped at lr 1e-1, loss_scale 1e-5; full-batch memorisation of 32
sequences at b2 0.999, 2000 steps).

Before the spikes: the second-moment lag. Gradient bursts happen at either b2 (after step
300 the max grad_norm is 22-84x its median in every run, 2.5-8.7); with b2 = 0.95 v catches
up and update_norm stays <= 1.12 (1.8x its median); with b2 = 0.999 v lags (max rms_t of the
shallow tensors reached 3.4-11 in the 10 steps before each spike, above the 1/sqrt(1-b2) =
4.5 cap of b2 = 0.95) and update_norm reaches 2.2-2.3 (9-12x). An alarm "max rms_t over the
embedding + block-0 matrices > 3" fired 1-28 steps (median 6) before 11 of 11 spikes, first
in block-0 attention (wo, wv, wk), but 73 of its 96 alarm steps in the spiking runs, all 29
in the four b2 = 0.95 runs and 17 in the clipped run were not followed by a spike within 30
steps; at > 5 it caught 7 of 11 with 16 false alarm steps in the spiking runs, 6 in the
clipped run and none with b2 = 0.95 (by the 4.5 bound). The Molybog signature
did not precede these spikes: grad_mom_cos of the shallow layers was negative (-0.1 to -0.2
on average in the 10 steps before, an oscillation), Sarle's bimodality stayed 0.49-0.57
(5/9 = 0.556 is the bimodal mark); sat_frac of the shallow tensors in those 10 steps
reached 0.04-0.44 (about 0.001 in quiet stretches), i.e. |r| -> 1 as v lags.

Re-measured later with this trainer (one core, XLA one thread, ~40 s per 1500-step run),
b2 = 0.999, telemetry every step, no histograms (the sweep's llama problem), seeds 0-4:
with a >= 10% jump 1, 3, 2, 1, 1 spikes; with the sweep's and the guard's >= 20% jump 0, 2,
1, 0, 0 (steps 1310 / 1313 and 826); seed 3 never learns the copy task (final loss 2.96).
configs/toy_spike.toml as is, seed 0: one >= 10% spike (step 481, +13%), none >= 20%, not
the steps 691 / 693-697 its header records: where (and whether) this toy spikes depends on
floating-point details, so such counts are per environment.
"""

from __future__ import annotations

import argparse
import json
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

from adamspike.config import ConfigError, load_config, to_dict
from adamspike.llama import LlamaConfig, spec_by_name
from adamspike.order import sample_indices
from adamspike.rundir import RunFormatError, RunWriter, environment
from adamspike.synthdata import SyntheticTokens
from adamspike.train_config import RunConfig
from simulate import llama as jllama
from simulate import optim as jopt
from simulate import telemetry as jtel
from simulate.guard import SnapshotGuard

POISON_TOKEN = 0


# ----------------------------------------------------------------------------- data

def dataset(cfg: RunConfig, llama: LlamaConfig):
    """SyntheticTokens (markov, copy) or simulate.zipf_data.ZipfMarkov (zipf)."""
    d = cfg.data
    if d.task == "zipf":
        from simulate.zipf_data import ZipfMarkov
        return ZipfMarkov(llama.vocab_size, cfg.train.seq_len, d.num_samples, cfg.train.seed,
                          d.zipf_exponent)
    return SyntheticTokens(d.task, llama.vocab_size, cfg.train.seq_len, d.num_samples,
                           cfg.train.seed, d.alpha)


def batch_at(data, cfg: RunConfig, step: int, offset: int = 0) -> np.ndarray:
    """Tokens (global_batch_size, seq_len + 1) of optimizer step `step` at data offset
    `offset` (it reads batch step + offset; data.poison_steps name batches, as in torch)."""
    idx = sample_indices(step, cfg.train.global_batch_size, cfg.data.num_samples, cfg.train.seed,
                         offset=offset)
    batch = data.batch(idx)
    if step + offset in cfg.data.poison_steps:
        batch[:, 1:] = POISON_TOKEN
    return batch


# ----------------------------------------------------------------------------- steps

_STEP_CACHE: dict[str, tuple] = {}


def make_steps(cfg: RunConfig):
    """(tx, step): the optax chain and the jitted step(params, opt_state, batch, telemetry,
    hist, native=True) (the last three static; native: the telemetry's native CPU kernel,
    simulate.native_telemetry, where it applies) -> (params, opt_state, out). Cached per
    (model, optim, train) settings, so runs of one process that share them compile once."""
    train = {k: v for k, v in to_dict(cfg.train).items() if k != "seed"}  # seed: not compiled in
    key = json.dumps([to_dict(cfg.model), to_dict(cfg.optim), train], sort_keys=True)
    if key not in _STEP_CACHE:
        if len(_STEP_CACHE) >= 8:  # bounded: sweeps in one process keep a few
            _STEP_CACHE.pop(next(iter(_STEP_CACHE)))
        _STEP_CACHE[key] = _make_steps(cfg)
    return _STEP_CACHE[key]


def _make_steps(cfg: RunConfig):
    t, o = cfg.train, cfg.optim
    llama = cfg.model.llama()
    tx = jopt.adamw(o, t.num_steps, t.loss_scale)
    value_and_grad = jax.value_and_grad(
        lambda p, b: jllama.loss_fn(p, b, llama, t.loss_scale, t.z_loss,
                                    cfg.model.embed_grad_shrink), has_aux=True)

    def step(params, opt_state, batch, telemetry: bool, hist: bool, native: bool = True):
        (_, aux), grads = value_and_grad(params, batch)
        updates, new_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        grad_norm, _, clipped = jopt.clip_info(new_state)
        out = {"loss": aux["loss"], "grad_norm": grad_norm, "clipped": clipped,
               "update_norm": jopt.global_norm(updates)}
        if telemetry:
            sums, hists = jtel.step_telemetry(
                grads, jopt.adam_state(opt_state), jopt.adam_state(new_state), new_params,
                o.b1, o.b2, o.eps, with_hist=hist, grad_scale=jopt.clip_info(new_state)[1],
                native=native)
            out["sums"] = sums
            if hist:
                out["hists"] = hists
        return new_params, new_state, out

    return tx, jax.jit(step, static_argnums=(3, 4, 5))


def _curvature_fn(cfg: RunConfig, llama: LlamaConfig):
    """simulate.curvature for this model: (fn, groups present), on loss_scale * loss."""
    from adamspike.depth_groups import GROUPS, depth_group
    from simulate.curvature import make_curvature_fn
    t = cfg.train
    groups = {s.name: depth_group(s.depth, llama.num_layers) for s in spec_by_name(llama).values()}
    present = [g for g in GROUPS if g in set(groups.values())]
    loss = lambda p, b: jllama.loss_fn(p, b, llama, t.loss_scale, t.z_loss,  # noqa: E731
                                        cfg.model.embed_grad_shrink)[0]
    return make_curvature_fn(loss, groups, present, cfg.telemetry.curvature_iters), present


def advance_schedule(opt_state):
    """A skipped step: only the lr schedule's count moves (Adam's count and moments stay)."""
    if isinstance(opt_state, optax.ScaleByScheduleState):
        return opt_state._replace(count=opt_state.count + 1)
    if isinstance(opt_state, tuple) and not hasattr(opt_state, "_fields"):
        return tuple(advance_schedule(s) for s in opt_state)
    return opt_state


# ----------------------------------------------------------------------------- loop

def train(cfg: RunConfig, out_dir: str | Path, progress: bool = True) -> Path:
    """Run cfg to completion (or divergence, or a guard abort); return the run directory."""
    if cfg.data.source != "synthetic":
        raise ConfigError("data.source: the JAX toy trains on synthetic data only "
                          f"(got {cfg.data.source!r}); use `adamspike train` for indexed data")
    if cfg.model.hf_config:
        raise ConfigError("model.hf_config: not supported by the JAX toy; use a preset")
    if cfg.guard.enabled and cfg.checkpoint.every < 1:
        raise ConfigError("checkpoint.every: guard.enabled needs snapshots to roll back to; the "
                          "JAX trainer keeps one in memory every checkpoint.every steps "
                          f"(got {cfg.checkpoint.every}; e.g. 25)")
    cfg.check()
    llama = cfg.model.llama()
    t, o, tel = cfg.train, cfg.optim, cfg.telemetry
    native = tel.compile != "off"   # the telemetry's native CPU kernel where it applies
    data = dataset(cfg, llama)
    tx, step_fn = make_steps(cfg)
    params = jllama.init_params(llama, jax.random.PRNGKey(t.seed))
    opt_state = tx.init(params)
    guard = SnapshotGuard(cfg.guard, cfg.checkpoint.every, params, opt_state)
    curv_fn, curv_groups = _curvature_fn(cfg, llama) if tel.curvature_every > 0 else (None, [])

    specs = spec_by_name(llama)
    names = jtel.tensor_names(params)  # telemetry row order
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
            batch = jnp.asarray(pending.result())
            if step < t.num_steps:
                pending = loader.submit(batch_at, data, cfg, step + 1, offset)
            log = tel.enabled and step % tel.every == 0
            hist = log and tel.hist_every > 0 and step % tel.hist_every == 0 and step not in skip
            new_params, new_state, out = step_fn(params, opt_state, batch, log, hist, native)
            out = jax.device_get(out)
            row = dict(loss=float(out["loss"]), grad_norm=float(out["grad_norm"]),
                       clipped=bool(out["clipped"]), update_norm=float(out["update_norm"]),
                       skipped=step in skip)
            if step in skip:  # keep params and Adam state; only the lr schedule advances
                opt_state = advance_schedule(opt_state)
                row.update(clipped=False, update_norm=0.0)
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
                        params, batch, adam.nu, adam.count, o.b1, o.b2, o.eps,
                        jax.random.PRNGKey(step)))
                    lr_now = o.lr_at(step, t.num_steps)
                    for g, r, p_ in zip(curv_groups, raw, pre):
                        rows.add(step, writer.log_curvature, step, g, float(p_), float(r), lr_now)
                if log:
                    rows.add(step, writer.log_layers, step, columns=jtel.layer_columns(
                        names, depths, kinds, numels, out["sums"], o.eps))
                if hist:
                    for i, n in enumerate(names):
                        rows.add(step, writer.log_hist, step, n, depths[i], kinds[i],
                                 out["hists"][i])
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
    from tqdm.auto import tqdm
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
        if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
            raise RunFormatError(f"--out {args.out}: exists and is not an empty directory "
                                 "(nothing was overwritten)")
        out = train(cfg, args.out, progress=not args.no_progress)
    except (ConfigError, RunFormatError) as e:
        print(f"adamspike simulate llama: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
