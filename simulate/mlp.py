"""Small MLPs trained with simulate.optim.adamw, per-tensor telemetry every step.

Two problems (`MLPSpec.kind`):

- "sin" (Bai et al. 2025): a 2-layer FNN  f(x) = W1 tanh(W0 x + b0) + b1  fitting
  y = sin x + sin 4x on `num_points` evenly spaced x in [-pi, pi], full-batch MSE.
- "deep": a `depth`-hidden-layer tanh MLP on a fixed random regression task
  (x ~ N(0, I_16), y = sin(x . u) + 0.5 cos(x . w), u, w random unit-norm directions), with
  weights N(0, init_gain^2 / fan_in), inputs multiplied by `input_scale`. A weight's
  gradient is (backward signal) x (its input), so a small input_scale makes the first
  layer's gradient the smallest (like a small unscaled embedding); rho = grad_rms / eps then
  differs across depth. `batch_size` > 0 draws
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

The sweep's vmapped runs (simulate.sweep_problems) use the same `make_step`. Measured
spike counts of these problems are in the study's generated reports (`adamspike
reproduce`: the sweep and replication tables), not here.
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
from tqdm import tqdm

from adamspike.metrics import NUM_HIST_BINS, NUM_VHIST_BINS
from adamspike.train_config import OptimSection
from simulate import optim as O
from simulate.telemetry import (grad_below_eps, hist_counts, step_telemetry, step_vhists,
                                update_direction)

HOOKS = ("direction",)   # the mitigation hooks this trainer implements
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


def make_step(spec: MLPSpec, x, y, tx: optax.GradientTransformation, lr, b1, b2, eps,
              loss_scale: float = 1.0, curvature: bool = False, hist_every: int = 0,
              batch_key=None):
    """The traceable training step `step((params, opt_state), t) -> (carry, out)` for
    lax.scan, shared by `train` and the vmapped sweep (simulate.sweep_problems): minibatch
    of step t (spec.batch_size > 0, drawn from batch_key folded with t), value_and_grad of
    loss_scale * MSE, tx, per-tensor telemetry sums of the consumed gradient, and (static
    flags) the curvature and r histograms of `train`'s docstring. b1, b2, eps, lr may be
    traced (lr: a scalar or an optax schedule of the 0-based count)."""
    if batch_key is None:
        batch_key = jax.random.PRNGKey(spec.seed + 7)
    lr_of = lr if callable(lr) else (lambda count: lr)

    def loss_fn(params, t):
        if spec.batch_size:
            idx = jax.random.choice(jax.random.fold_in(batch_key, t), x.shape[0],
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
        lr_t = lr_of(t - 1)
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

    return step


def train(spec: MLPSpec, optim: OptimSection, num_steps: int, *, loss_scale: float = 1.0,
          plan: StepPlan | None = None, hist_every: int = 0, curvature: bool = False,
          chunk: int = 1000, progress: bool = True) -> dict:
    """Train and return numpy traces (see module docstring): keys loss, lr, grad_norm,
    clipped, update_norm, step_time_s (chunk wall time / chunk steps), sums
    (num_steps, num_tensors, NUM_SUMS), hist_steps, hists (len(hist_steps), num_tensors,
    bins), vhists (len(hist_steps), num_tensors, NUM_VHIST_BINS: sqrt(v_hat)/eps),
    g_below_eps (len(hist_steps), num_tensors: coordinates with |g| < eps), names,
    depths, kinds, numels, eps, batch_size. plan: the mitigation registry's
    StepPlan (adamspike.mitigations; this trainer implements the `direction` hook: use
    mitigations.require_hooks(cfg, HOOKS, ...) before).

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
    # device_put, not jnp.asarray: that compiles a copy program per shape (issue 37)
    x, y = jax.device_put(x_np), jax.device_put(y_np)
    tx = O.adamw(optim, num_steps, loss_scale=loss_scale, plan=plan)
    eps = optim.eps
    step = make_step(spec, x, y, tx, O.lr_schedule(optim, num_steps), optim.b1, optim.b2, eps,
                     loss_scale, curvature, hist_every)

    @jax.jit
    def run_chunk(carry, ts):
        return jax.lax.scan(step, carry, ts)

    params = {k: jax.device_put(v) for k, v in init_params(spec).items()}
    carry = (params, jax.jit(tx.init)(params))   # one program, not one per state leaf
    parts, times = [], []
    bar = _progress(num_steps, progress, f"mlp-{spec.kind}")
    for start in range(1, num_steps + 1, chunk):
        ts = np.arange(start, min(start + chunk, num_steps + 1), dtype=np.int32)
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
    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, mininterval=1.0)
