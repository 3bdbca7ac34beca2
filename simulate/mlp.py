"""Small MLPs trained with simulate.optim.adamw, per-tensor telemetry every step.

Two problems (`MLPSpec.kind`):

- "sin" (Bai et al. 2025): a 2-layer FNN  f(x) = W1 tanh(W0 x + b0) + b1  fitting
  y = sin x + sin 4x on `num_points` evenly spaced x in [-pi, pi], full-batch MSE.
- "deep": a `depth`-hidden-layer tanh MLP on a fixed random regression task
  (x ~ N(0, I_16), y = sin(x . u) + 0.5 cos(x . w), u, w random unit-norm directions), with
  weights N(0, init_gain^2 / fan_in), inputs multiplied by `input_scale`. A weight's
  gradient is (backward signal) x (its input), so a small input_scale makes the first
  layer's gradient the smallest (like a small unscaled embedding); rho = grad_rms / eps then
  differs by orders of magnitude across depth (measured: see below). `batch_size` > 0 draws
  minibatches (seeded, a pure function of the step), 0 = full batch.

Loss scale s (train's `loss_scale`): Adam is run on s * L with the clip threshold scaled
by s, equivalent to eps / s; the logged loss is the unscaled L, grad_norm and the telemetry
are of the gradient Adam consumed (of s * L).

Parameters are a flat dict "layers.{i}.weight" / "layers.{i}.bias" (depth i, kind
"param") and "output.weight" / "output.bias" (depth = number of hidden layers, kind
"output"), weights shaped (out, in) like torch.

`train(spec, optim, num_steps, ...)` runs jitted lax.scan chunks (tqdm over chunks, to
stderr) and returns numpy traces for simulate.runner: per step loss, lr, grad_norm (before
clipping), clipped, update_norm, and per step / tensor the telemetry sums; r histograms at
steps divisible by hist_every.

Measured (float32, seed 0, constant lr, no clipping unless said; spikes = analysis.spikes
.detect_spikes(loss, window=100, k=6, min_rel_jump=1, log=True), i.e. loss >= 2x the
rolling median and beyond 6 MAD; "10x" = peak >= 10x baseline):
  sin, width 256, lr 1e-2, 2e4 steps, b1 0.9:
    eps 1e-8, b2 0.999: 638 spikes (288 >= 10x, 90 >= 100x, max 729x); final loss 5.4e-5.
      curvature=True: lam_hat_grad > 2/lr on 13.7% of the steps, 347 crossing onsets, 80
      sustained (>= 20 steps; Bai et al. report 77 spikes); every >= 10x spike is preceded
      by a crossing within 100 steps (89% within 30, 43% within 10).
    eps 1e-8, b2 0.99 : 144 (24 >= 10x, max 286x); final 2.0e-3
    eps 1e-8, b2 0.9  : 0 spikes (the loss chatters within a ~10x band); final 8.9e-3
    eps 1e-3, b2 0.999: 274 (58 >= 10x, max 51x); final 4.3e-3
    eps 0.1,  b2 0.999: 0 spikes, but the net barely fits (final 1.4e-1: Adam -> SGD, lr/eps)
    update_clip, eps 1e-8, b2 0.999: 51 spikes (24 >= 10x), but larger: max 51254x, peaks
      at loss 4..44, ~1000-step recoveries. At the onset of the three largest the unclipped
      direction already has update_rms 1.2..1.6 while rms_t is 0.05..1.1 (v_hat is not
      stale: the loud-gradient trigger stays off); rms_t reaches 5..25 only after the loss
      has jumped, so the clip slows the recovery instead of preventing the onset.
  sin at width 100 / 1000, lr 1e-3 / 1e-2: eps 1e-8, b2 0.999 spikes in every case (72..561
    detections, max 5.6x..77x); b2 0.9 and eps 0.1 none (eps 0.1 again fits badly).
  deep (width 64, depth 8, 1024 points, batch 128, lr 1e-3, grad_clip 1, 6000 steps, eps
    1e-8): no run spiked (<= 1 detection, max 7x) at loss scale 1 / 1e-3 / 1e-5, b2 0.999 /
    0.95. rho per weight (layers 0..7, output; last 500 steps), loss scale 1:
    4e4 2.4e4 2.1e4 2e4 2.1e4 2.3e4 2.7e4 3.8e4 5e5 (U-shaped: the middle layers, not the
    first, are smallest; only ~2x, the output layer 10x above); loss scale 1e-3 divides rho
    by 1e3 (43 .. 26 .. 560) and 1e-5 puts every layer below eps (rho 0.012..0.14, update
    rms 1e-3: the eps-dominated regime). input_scale 0.01 / 0.001 did not make layer 0 the
    smallest either (Adam grows W0 to compensate). With update_clip the deep runs reached
    much lower loss (1e-6..2e-7) and then showed 7..8 spikes >= 10x.
  deep, FULL batch (256 points, batch_size 0), no clipping, 1e4 steps, eps 1e-8:
    lr 1e-3, b2 0.999: converges to ~5e-15, then 43 spikes (first at step 1911), the
      largest from ~1e-15 back to ~1e-2; loss scale 1e-3: 22 spikes (11 >= 10x)
    lr 3e-3, b2 0.999: 4 spikes (first 7418), same 1e-15 -> 1e-2 kind
    b2 0.9 (lr 1e-3 and 3e-3) and eps 0.1: no spike (final 2e-5 / 5e-6 and 1e-5 / 1e-9)
    lr 3e-3, b2 0.9: rho rises monotonically with depth, 31 (layer 0) .. 1.6e3 (layer 7)
      .. 8e4 (output): here the shallow layers do have the smallest gradients.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from adamspike.train_config import OptimSection
from simulate import optim as O
from adamspike.metrics import NUM_HIST_BINS, NUM_VHIST_BINS
from simulate.telemetry import (grad_below_eps, hist_counts, step_telemetry, step_vhists,
                                update_direction)

KINDS = ("sin", "deep")
DEEP_INPUT_DIM = 16


@dataclass(frozen=True)
class MLPSpec:
    kind: str = "sin"
    width: int = 256
    depth: int = 1              # hidden layers; "sin" is the 2-layer FNN (depth 1)
    num_points: int = 256       # training set size
    batch_size: int = 0         # 0 = full batch
    init_gain: float = 1.0
    input_scale: float = 1.0    # "deep": x is multiplied by this (small: small W0 gradients)
    seed: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind: must be one of {KINDS}, got {self.kind!r}")
        for name in ("width", "depth", "num_points"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.kind == "sin" and self.depth != 1:
            raise ValueError("depth: the 'sin' problem is the 2-layer FNN (depth 1)")
        if not 0 <= self.batch_size <= self.num_points:
            raise ValueError(f"batch_size: must be in [0, num_points={self.num_points}], "
                             f"got {self.batch_size}")
        if self.init_gain <= 0:
            raise ValueError(f"init_gain: must be > 0, got {self.init_gain}")
        if self.input_scale <= 0:
            raise ValueError(f"input_scale: must be > 0, got {self.input_scale}")


def dataset(spec: MLPSpec) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) float32, x (num_points, d_in), y (num_points, 1)."""
    if spec.kind == "sin":
        x = np.linspace(-math.pi, math.pi, spec.num_points)[:, None]
        return x.astype(np.float32), (np.sin(x) + np.sin(4 * x)).astype(np.float32)
    rng = np.random.default_rng(spec.seed + 1000)
    x = rng.normal(size=(spec.num_points, DEEP_INPUT_DIM))
    u, w = (d / np.linalg.norm(d) for d in rng.normal(size=(2, DEEP_INPUT_DIM)))
    y = np.sin(x @ u) + 0.5 * np.cos(x @ w)
    return (x * spec.input_scale).astype(np.float32), y[:, None].astype(np.float32)


def init_params(spec: MLPSpec) -> dict[str, np.ndarray]:
    """W ~ N(0, gain^2 / fan_in) (out, in), biases 0; float32."""
    rng = np.random.default_rng(spec.seed)
    d_in = 1 if spec.kind == "sin" else DEEP_INPUT_DIM
    dims = [d_in] + [spec.width] * spec.depth
    params = {}
    for i in range(spec.depth):
        std = spec.init_gain / math.sqrt(dims[i])
        params[f"layers.{i}.weight"] = rng.normal(size=(dims[i + 1], dims[i])) * std
        params[f"layers.{i}.bias"] = np.zeros(dims[i + 1])
    params["output.weight"] = rng.normal(size=(1, spec.width)) / math.sqrt(spec.width)
    params["output.bias"] = np.zeros(1)
    return {k: v.astype(np.float32) for k, v in params.items()}


def tensor_meta(spec: MLPSpec):
    """(names, depths, kinds, numels) in telemetry row order (sorted names)."""
    params = init_params(spec)
    names = sorted(params)
    depths = [spec.depth if n.startswith("output") else int(n.split(".")[1]) for n in names]
    kinds = ["output" if n.startswith("output") else "param" for n in names]
    return names, depths, kinds, [int(params[n].size) for n in names]


def forward(params, x, depth: int):
    h = x
    for i in range(depth):
        h = jnp.tanh(h @ params[f"layers.{i}.weight"].T + params[f"layers.{i}.bias"])
    return h @ params["output.weight"].T + params["output.bias"]


def train(spec: MLPSpec, optim: OptimSection, num_steps: int, *, loss_scale: float = 1.0,
          hist_every: int = 0, curvature: bool = False, chunk: int = 1000,
          progress: bool = True) -> dict:
    """Train and return numpy traces (see module docstring): keys loss, lr, grad_norm,
    clipped, update_norm, step_time_s (chunk wall time / chunk steps), sums
    (num_steps, num_tensors, NUM_SUMS), hist_steps, hists (len(hist_steps), num_tensors,
    bins), vhists (len(hist_steps), num_tensors, NUM_VHIST_BINS: sqrt(v_hat)/eps),
    g_below_eps (len(hist_steps), num_tensors: coordinates with |g| < eps), names,
    depths, kinds, numels, eps, batch_size.

    curvature=True adds Bai et al.'s gradient-direction curvature of the preconditioned
    Hessian, one Hessian-vector product per step (forward-over-reverse):
        lam_hat_grad = g^T P H g / ||g||^2,  P = [(1-b1)/(1+b1)] / (1-b1^t) / (sqrt(v_hat) + eps)
    (g: the gradient Adam consumed, H: Hessian of the (scaled) minibatch loss at the
    parameters g was taken at, v_hat after the step) and threshold = 2 / lr_t."""
    if num_steps < 1:
        raise ValueError(f"num_steps: must be >= 1, got {num_steps}")
    if hist_every < 0:
        raise ValueError(f"hist_every: must be >= 0, got {hist_every}")
    x_np, y_np = dataset(spec)
    x, y = jnp.asarray(x_np), jnp.asarray(y_np)
    tx = O.adamw(optim, num_steps, loss_scale=loss_scale)
    sched = O.lr_schedule(optim, num_steps)
    b1, b2, eps = optim.b1, optim.b2, optim.eps
    batch_key = jax.random.PRNGKey(spec.seed + 7)

    def loss_fn(params, t):
        if spec.batch_size:
            idx = jax.random.choice(jax.random.fold_in(batch_key, t), spec.num_points,
                                    (spec.batch_size,), replace=False)
            xb, yb = x[idx], y[idx]
        else:
            xb, yb = x, y
        return jnp.mean((forward(params, xb, spec.depth) - yb) ** 2)

    def step(carry, t):
        params, opt_state = carry
        params_before = params
        loss, grads = jax.value_and_grad(lambda p: loss_scale * loss_fn(p, t))(params)
        prev = O.adam_state(opt_state)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        grad_norm, _, clipped = O.clip_info(opt_state)
        sums, _ = step_telemetry(O.consumed_grads(grads, opt_state), prev,
                                 O.adam_state(opt_state), params, b1, b2, eps)
        lr_t = sched(t - 1)
        out = {"loss": loss / loss_scale, "grad_norm": grad_norm, "clipped": clipped,
               "update_norm": O.global_norm(updates), "lr": lr_t, "sums": sums}
        if curvature:
            st = O.adam_state(opt_state)
            g = O.consumed_grads(grads, opt_state)
            scaled_grad = jax.grad(lambda p: loss_scale * loss_fn(p, t))
            hg = jax.jvp(scaled_grad, (params_before,), (g,))[1]
            c = (1 - b1) / (1 + b1) / (1 - b1 ** st.count)
            bc2 = 1 - b2 ** st.count
            num = sum(jnp.sum(g[k] * hg[k] * c / (jnp.sqrt(st.nu[k] / bc2) + eps)) for k in g)
            den = sum(jnp.sum(g[k] * g[k]) for k in g)
            out["lam_hat_grad"] = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)
            out["threshold"] = 2.0 / lr_t
        if hist_every:
            def hists():
                st = O.adam_state(opt_state)
                bc1, bc2 = 1 - b1 ** st.count, 1 - b2 ** st.count
                return jnp.stack([hist_counts(update_direction(st.mu[k] / bc1, st.nu[k] / bc2, eps))
                                  for k in sorted(params)])
            out["hists"] = jax.lax.cond(t % hist_every == 0, hists,
                                        lambda: jnp.zeros((len(params), NUM_HIST_BINS), jnp.int32))
            out["vhists"], out["g_below_eps"] = jax.lax.cond(  # same steps, sorted names
                t % hist_every == 0,
                lambda: (step_vhists(O.adam_state(opt_state), b2, eps),
                         grad_below_eps(O.consumed_grads(grads, opt_state), eps)),
                lambda: (jnp.zeros((len(params), NUM_VHIST_BINS), jnp.int32),
                         jnp.zeros(len(params), jnp.int32)))
        return (params, opt_state), out

    @jax.jit
    def run_chunk(carry, ts):
        return jax.lax.scan(step, carry, ts)

    params = {k: jnp.asarray(v) for k, v in init_params(spec).items()}
    carry = (params, tx.init(params))
    parts, times = [], []
    bar = _progress(num_steps, progress, f"mlp-{spec.kind}")
    for start in range(1, num_steps + 1, chunk):
        ts = jnp.arange(start, min(start + chunk, num_steps + 1), dtype=jnp.int32)
        t0 = time.perf_counter()
        carry, out = run_chunk(carry, ts)
        out = jax.tree.map(np.asarray, out)  # blocks until done
        times.append(np.full(len(ts), (time.perf_counter() - t0) / len(ts)))
        parts.append(out)
        if bar is not None:
            bar.update(len(ts))
            bar.set_postfix(loss=f"{float(out['loss'][-1]):.3e}")
    if bar is not None:
        bar.close()
    traces = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    traces["step_time_s"] = np.concatenate(times)
    if hist_every:
        steps = np.arange(1, num_steps + 1)
        keep = steps % hist_every == 0
        traces["hist_steps"], traces["hists"] = steps[keep], traces["hists"][keep]
        traces["vhists"] = traces["vhists"][keep]
        traces["g_below_eps"] = traces["g_below_eps"][keep]
    names, depths, kinds, numels = tensor_meta(spec)
    traces.update(names=names, depths=depths, kinds=kinds, numels=numels, eps=eps,
                  batch_size=spec.batch_size or spec.num_points)
    traces["final_params"] = jax.tree.map(np.asarray, carry[0])
    return traces


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, mininterval=1.0)
