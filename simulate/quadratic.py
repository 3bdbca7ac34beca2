"""Adam on quadratics (Bai et al. 2025): spikes from a decoupled second moment.

Loss L(theta) = 1/2 theta^T H theta with H = Q diag(lam) Q^T, lam log-uniform in
[lam_min, lam_max] (`dim` values, geometric grid; Q = I unless `rotate`, then a seeded random
orthogonal matrix), theta_0 = theta0 * (1, ..., 1), optional gradient noise
g_t = H theta_t + noise * xi_t, xi ~ N(0, I). Adam (eps outside the root, as optax/torch):

    m_t = b1 m_{t-1} + (1-b1) g_t,  v_t = b2 v_{t-1} + (1-b2) g_t^2
    theta_{t+1} = theta_t - lr * (m_t / (1-b1^t)) / (sqrt(v_t / (1-b2^t)) + eps)

Per-step diagnostics (Bai et al.): the preconditioned Hessian
    H_hat_t = [(1-b1)/(1+b1)] / (1-b1^t) * diag(1 / (sqrt(v_hat_t) + eps)) H
its largest eigenvalue `lam_hat_max` and the curvature along the gradient
`lam_hat_grad` = g^T H_hat g / ||g||^2, against the stability threshold 2/lr. Late in
training lam_hat <= lam c / eps with c = (1-b1)/(1+b1), so eps >= eps* = lr lam_max c / 2
(`eps_star`) rules this instability out.

Numerics (the reason for `rescale`): after convergence theta decays by ~20 orders of
magnitude per 1000 steps while v decays only like b2^k, so in plain float64 theta reaches
the underflow floor (~1e-308) before v_hat is small enough to destabilise the iteration when
eps is near eps*; in float32 (and with XLA's flush-to-zero) it freezes at ~1e-38 and no spike
ever happens. With `rescale=True` (the default) theta and m are stored as 2^k * (theta~, m~)
with one integer exponent k renormalised every step (exact: multiplying by 2^k is exact in
binary floating point), v in true units (it never gets that small). This is float64
arithmetic with an unbounded exponent, i.e. the real-number Adam iteration to 16 digits.
`rescale=False` runs the plain iteration in `dtype` (to show what finite range does).
float64 needs x64: `run_quadratic` enables it; callers that jit/vmap `simulate_quadratic`
themselves must do so inside `jax.enable_x64(True)` (an error says so otherwise).

`simulate_quadratic(hparams, spec)` is a pure function of the scalar hparams (lr, eps, b1,
b2, noise, theta0, seed) and the static QuadraticSpec, so `jax.vmap` over configurations
works. Traces (arrays with a leading step axis, step t = 1..num_steps, after the update):
    log10_loss, loss, grad_norm, log10_grad_norm, update_norm (||theta_{t+1} - theta_t||),
    lam_hat_grad, lam_hat_max, threshold (2/lr), grad_clip-free telemetry `sums`
    (num_steps, NUM_SUMS) of the single tensor theta (simulate.telemetry.tensor_sums, true
    units; values below ~1e-308 underflow to 0 there), and with `record_coords`
    log10_abs_theta and lam_hat_diag (num_steps, dim): per-coordinate preconditioned
    curvature (the eigen-directions when rotate=False), plus log10_abs_eig (|Q^T theta|,
    the eigen-coordinates, column i along lams[i]) when rotate=True.

Spike criterion (`count_spikes`, specific to this problem where the loss falls over hundreds
of decades): on the 50-step running max of log10 loss, a rise of >= 3 decades within 100
steps starts a spike (documented there). Not the project's rule (adamspike.spikes): a
rolling-median band cannot judge a loss that falls by hundreds of decades. Measured with the
band rule on log10 loss at a 2-decade jump (the sweep's min_decades): 2 spikes at 0.5 eps*
where this criterion finds >= 5, none at 0.95 eps* where Bai's predictor fires, and the
toy claim "eps >= eps* removes spikes" left with no spikes in either arm.

The spike counts this problem gives around eps* (for both the rescaled and the plain
floating-point iteration) are measured by the sweep (`configs/sweep_quadratic.toml`) and the
replication table (`adamspike reproduce`), not recorded here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
from numpy.lib.stride_tricks import sliding_window_view

from simulate.telemetry import tensor_sums
from theory.quadratic import critical_eps

HPARAM_DEFAULTS = {"lr": 1e-2, "eps": 1e-8, "b1": 0.9, "b2": 0.999, "noise": 0.0,
                   "theta0": 1.0, "seed": 0}
LOG10_2 = math.log10(2.0)


@dataclass(frozen=True)
class QuadraticSpec:
    """Static part of a quadratic problem (hashable: a jit static argument)."""
    num_steps: int = 30_000
    dim: int = 1
    lam_min: float = 1.0
    lam_max: float = 1.0
    rotate: bool = False
    rescale: bool = True
    dtype: str = "float64"
    record_coords: bool = False
    record_sums: bool = True

    def __post_init__(self):
        if self.num_steps < 1:
            raise ValueError(f"num_steps: must be >= 1, got {self.num_steps}")
        if self.dim < 1:
            raise ValueError(f"dim: must be >= 1, got {self.dim}")
        if not 0 < self.lam_min <= self.lam_max:
            raise ValueError(f"lam_min: need 0 < lam_min <= lam_max, got {self.lam_min}, "
                             f"{self.lam_max}")
        if self.dim == 1 and self.lam_min != self.lam_max:
            raise ValueError("lam_max: a 1-D problem has one curvature (lam_min == lam_max)")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype: must be 'float32' or 'float64', got {self.dtype!r}")

    def lams(self) -> np.ndarray:
        """Curvatures, log-uniform (geometric grid) from lam_max down to lam_min."""
        return np.geomspace(self.lam_max, self.lam_min, self.dim)


def eps_star(lr: float, lam: float, b1: float) -> float:
    """eps* = lr lam (1-b1) / (2 (1+b1)): eps >= eps* rules out the late-training
    instability along a direction of curvature lam (theory.quadratic.critical_eps)."""
    return critical_eps(lr, lam, b1)


def _rotation(dim: int, seed, dtype):
    key = jax.random.PRNGKey(seed)
    a = jax.random.normal(jax.random.fold_in(key, 1), (dim, dim), dtype)
    q, r = jnp.linalg.qr(a)
    return q * jnp.sign(jnp.diagonal(r))


def simulate_quadratic(hparams: dict, spec: QuadraticSpec) -> dict:
    """Run Adam on the quadratic; see the module docstring. hparams: any of lr, eps, b1,
    b2, noise, theta0 (scalars, may be traced), seed (int scalar); missing keys take
    HPARAM_DEFAULTS."""
    unknown = set(hparams) - set(HPARAM_DEFAULTS)
    if unknown:
        raise ValueError(f"{sorted(unknown)[0]}: unknown quadratic hparam "
                         f"(known: {', '.join(HPARAM_DEFAULTS)})")
    dt = jnp.float64 if spec.dtype == "float64" else jnp.float32
    if dt == jnp.float64 and not jax.config.read("jax_enable_x64"):
        raise RuntimeError("dtype float64 needs x64: call inside `with jax.enable_x64(True):` "
                           "or use run_quadratic")
    hp = {**HPARAM_DEFAULTS, **hparams}
    lr, eps, b1, b2, noise, theta0 = (jnp.asarray(hp[k], dt)
                                      for k in ("lr", "eps", "b1", "b2", "noise", "theta0"))
    seed = jnp.asarray(hp["seed"], jnp.uint32)
    lams = jnp.asarray(spec.lams(), dt)
    c = (1 - b1) / (1 + b1)
    if spec.rotate:
        q = _rotation(spec.dim, seed, dt)
        hess = (q * lams) @ q.T
        hvp = lambda x: hess @ x  # noqa: E731
    else:
        hvp = lambda x: lams * x  # noqa: E731
    noise_key = jax.random.fold_in(jax.random.PRNGKey(seed), 2)

    def step(carry, t):
        th, m, v, k = carry  # theta = 2^k th, m_true = 2^k m; v in true units
        tf = t.astype(dt)
        g_s = hvp(th)  # scaled gradient
        # noise may be traced (vmapped sweeps), so it is always drawn; noise = 0 adds zeros
        xi = jax.random.normal(jax.random.fold_in(noise_key, t), (spec.dim,), dt)
        g_s = g_s + jnp.ldexp(noise * xi, -k)
        g = jnp.ldexp(g_s, k)  # true units (may underflow harmlessly: only feeds v)
        m_prev = m
        m = b1 * m + (1 - b1) * g_s
        v = b2 * v + (1 - b2) * g * g
        bc1 = 1 - b1 ** tf
        v_hat = v / (1 - b2 ** tf)
        denom = jnp.sqrt(v_hat) + eps
        r_s = (m / bc1) / denom  # r / 2^k
        th_new = th - lr * r_s
        # diagnostics (scale-free where possible)
        pre = c / bc1 / denom  # diag of the preconditioner times c / bc1
        gn2 = jnp.sum(g_s * g_s)
        lam_grad = jnp.where(gn2 > 0, jnp.sum(g_s * pre * hvp(g_s)) / jnp.where(gn2 > 0, gn2, 1), 0)
        if spec.rotate:
            sq = jnp.sqrt(pre)
            lam_max = jnp.linalg.eigvalsh(sq[:, None] * hess * sq[None, :])[-1]
        else:
            lam_max = jnp.max(pre * lams)
        half_sq = 0.5 * jnp.sum(th_new * hvp(th_new))
        log10_loss = jnp.where(half_sq > 0, jnp.log10(jnp.where(half_sq > 0, half_sq, 1.0))
                               + 2 * LOG10_2 * k.astype(dt), -jnp.inf)
        gnorm_s = jnp.sqrt(gn2)
        out = {
            "log10_loss": log10_loss,
            "loss": jnp.ldexp(jnp.ldexp(half_sq, k), k),
            "grad_norm": jnp.ldexp(gnorm_s, k),
            "log10_grad_norm": jnp.where(gnorm_s > 0, jnp.log10(jnp.where(gnorm_s > 0, gnorm_s, 1.0))
                                         + LOG10_2 * k.astype(dt), -jnp.inf),
            "update_norm": jnp.ldexp(lr * jnp.sqrt(jnp.sum(r_s * r_s)), k),
            "lam_hat_grad": lam_grad,
            "lam_hat_max": lam_max,
        }
        if spec.record_sums:
            out["sums"] = tensor_sums(g, jnp.ldexp(m / bc1, k), v_hat, jnp.ldexp(m_prev, k),
                                      jnp.ldexp(th_new, k), eps)
        if spec.record_coords:
            a = jnp.abs(th_new)
            out["log10_abs_theta"] = jnp.where(a > 0, jnp.log10(jnp.where(a > 0, a, 1.0))
                                               + LOG10_2 * k.astype(dt), -jnp.inf)
            out["lam_hat_diag"] = pre * lams if not spec.rotate else pre * jnp.diagonal(hess)
            if spec.rotate:  # eigen-coordinates z = Q^T theta (z_i along curvature lams[i])
                az = jnp.abs(q.T @ th_new)
                out["log10_abs_eig"] = jnp.where(az > 0, jnp.log10(jnp.where(az > 0, az, 1.0))
                                                 + LOG10_2 * k.astype(dt), -jnp.inf)
        if spec.rescale:  # renormalise so max(|th|, |m|) is in [0.5, 1): exact power-of-2 shift
            top = jnp.maximum(jnp.max(jnp.abs(th_new)), jnp.max(jnp.abs(m)))
            _, e = jnp.frexp(jnp.where(top > 0, top, 1.0))
            th_new, m, k = jnp.ldexp(th_new, -e), jnp.ldexp(m, -e), k + e
        return (th_new, m, v, k), out

    th0 = theta0 * jnp.ones(spec.dim, dt)
    carry = (th0, jnp.zeros(spec.dim, dt), jnp.zeros(spec.dim, dt), jnp.zeros((), jnp.int32))
    ts = jnp.arange(1, spec.num_steps + 1, dtype=jnp.int32)
    _, out = jax.lax.scan(step, carry, ts)
    out["threshold"] = 2.0 / lr
    return out


def run_quadratic(hparams: dict | list[dict], spec: QuadraticSpec) -> dict:
    """jit (and vmap over a list of hparam dicts) with x64 enabled as the spec needs;
    returns numpy arrays (a leading configuration axis for a list)."""
    with jax.enable_x64(spec.dtype == "float64"):
        if isinstance(hparams, dict):
            out = jax.jit(simulate_quadratic, static_argnums=1)(hparams, spec)
        else:
            if not hparams:
                raise ValueError("hparams: empty list of configurations")
            keys = set().union(*hparams)
            stacked = {k: np.array([{**HPARAM_DEFAULTS, **h}[k] for h in hparams]) for k in keys}
            out = jax.jit(jax.vmap(simulate_quadratic, in_axes=(0, None)), static_argnums=1)(
                stacked, spec)
        return jax.tree.map(np.asarray, out)


def envelope(values: np.ndarray, window: int = 50) -> np.ndarray:
    """Running max over the last `window` values (removes the zero-crossing dips)."""
    x = np.asarray(values, dtype=np.float64)
    padded = np.concatenate([np.full(window - 1, -np.inf), x])
    return sliding_window_view(padded, window).max(axis=-1)


def count_spikes(log10_loss: np.ndarray, *, min_decades: float = 3.0, rise_window: int = 100,
                 envelope_window: int = 50) -> pd.DataFrame:
    """Spikes of a quadratic run (a criterion for this problem only, in log space):
    E = running max of log10 loss over `envelope_window` steps (removes the dips where theta
    crosses 0); a step is rising when E exceeds its own minimum over the previous
    `rise_window` steps by >= `min_decades` orders of magnitude; each run of rising steps
    is one spike. Columns: start (first rising step, 1-based), peak_step, peak (log10
    loss), baseline (log10 loss, the minimum before the rise), log10_height, duration
    (steps from start until E is back below baseline + min_decades, or to the end),
    recovered (it got back there)."""
    env = envelope(log10_loss, envelope_window)
    finite = env[np.isfinite(env)]
    env = np.where(np.isneginf(env), finite.min() if finite.size else 0.0, env)
    padded = np.concatenate([np.full(rise_window, np.inf), env])
    base = sliding_window_view(padded, rise_window + 1).min(axis=-1)
    rising = env - base >= min_decades
    rows = []
    n = len(env)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], rising.astype(np.int8), [0]])))
    for a, b in zip(edges[::2], edges[1::2]):  # rising on [a, b)
        baseline = base[a]
        after = np.flatnonzero(env[b:] < baseline + min_decades)
        end = b + int(after[0]) if after.size else n
        peak_i = a + int(np.argmax(env[a:max(end, a + 1)]))
        rows.append({"start": a + 1, "peak_step": peak_i + 1, "peak": env[peak_i],
                     "baseline": baseline, "log10_height": env[peak_i] - baseline,
                     "duration": end - a, "recovered": bool(after.size)})
    return pd.DataFrame(rows, columns=["start", "peak_step", "peak", "baseline", "log10_height",
                                       "duration", "recovered"])
