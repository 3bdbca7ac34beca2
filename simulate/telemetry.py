"""Per-tensor Adam telemetry in JAX (jittable): adamspike/metrics.py, computed on device.

For each tensor, from the gradient g Adam consumed (after clipping), the bias-corrected
state after the step m_hat = mu_t / (1-b1^t), v_hat = nu_t / (1-b2^t), the raw momentum
before the step m_prev = mu_{t-1} and the parameter p after the step, `tensor_sums` returns
the SUM_FIELDS sums (n, sum g^2, sum r^k for k=1..4, sum g^2/max(v_hat, eps^2), #|r|>0.9,
#sqrt(v_hat)<eps, sum m_hat^2, sum v_hat, sum g m_prev, sum m_prev^2, sum p^2) with
r = m_hat / (sqrt(v_hat) + eps); `adamspike.metrics.finalize` turns them into METRIC_NAMES
on the host (`layer_columns`). `hist_counts` bins r on HIST_EDGES, values outside clipped
into the end bins, exactly as `adamspike.metrics.histogram`.

Precision: sums are accumulated in the tensors' dtype (float64 under jax.enable_x64);
the counts (n, sat, eps_small, histograms) are integer sums, exact. Histogram edges are
rounded up to the compute dtype, which makes `edge_lo <= r < edge_hi` in float32 the same
decision as numpy's comparison in float64.

Tensors are taken in `tensor_names(tree)` order (jax's flattening order: sorted keys for a
dict; nested keys joined by "."), the row order of the returned arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from adamspike.metrics import HIST_EDGES, METRIC_NAMES, NUM_HIST_BINS, SAT_THRESHOLD, SUM_FIELDS, finalize

NUM_SUMS = len(SUM_FIELDS)


def _edges_rounded_up(dtype) -> np.ndarray:
    """Smallest dtype value >= each float64 edge: for x of that dtype, x >= e64 <=> x >= e."""
    e = HIST_EDGES.astype(dtype)
    up = e.astype(np.float64) < HIST_EDGES
    e[up] = np.nextafter(e[up], np.array(np.inf, dtype=dtype))
    return e


_EDGES = {np.dtype(np.float32): _edges_rounded_up(np.float32),
          np.dtype(np.float64): HIST_EDGES.copy()}


def update_direction(m_hat, v_hat, eps):
    """r = m_hat / (sqrt(v_hat) + eps)."""
    return m_hat / (jnp.sqrt(v_hat) + eps)


def tensor_sums(g, m_hat, v_hat, m_prev, p, eps) -> jax.Array:
    """The SUM_FIELDS sums of one tensor, shape (NUM_SUMS,), dtype of g (at least float32)."""
    dt = jnp.result_type(g.dtype, jnp.float32)
    g, m_hat, v_hat, m_prev, p = (jnp.ravel(x).astype(dt) for x in (g, m_hat, v_hat, m_prev, p))
    eps = jnp.asarray(eps, dt)
    r = update_direction(m_hat, v_hat, eps)
    r2 = r * r
    g2 = g * g
    denom = jnp.maximum(v_hat, eps * eps)
    ok = denom > 0  # false only with eps = 0 and v_hat = 0, where g = 0: counts as 0
    g2_over_v = jnp.where(ok, g2 / jnp.where(ok, denom, 1.0), 0.0)
    count = lambda mask: jnp.sum(mask, dtype=jnp.int32).astype(dt)  # noqa: E731
    out = [
        jnp.asarray(g.size, dt), g2.sum(), r.sum(), r2.sum(), (r2 * r).sum(), (r2 * r2).sum(),
        g2_over_v.sum(), count(jnp.abs(r) > SAT_THRESHOLD), count(jnp.sqrt(v_hat) < eps),
        (m_hat * m_hat).sum(), v_hat.sum(), (g * m_prev).sum(), (m_prev * m_prev).sum(),
        (p * p).sum(),
    ]
    return jnp.stack(out)


def hist_counts(r) -> jax.Array:
    """int32 counts (NUM_HIST_BINS,) of r on HIST_EDGES; out-of-range values go to the end
    bins, the last edge belongs to the last bin (numpy.histogram)."""
    r = jnp.ravel(r)
    dt = np.dtype(jnp.result_type(r.dtype, jnp.float32))
    edges = jnp.asarray(_EDGES[dt])
    idx = jnp.clip(jnp.searchsorted(edges, r.astype(dt), side="right") - 1, 0, NUM_HIST_BINS - 1)
    return jnp.zeros(NUM_HIST_BINS, jnp.int32).at[idx].add(1)


def _path_name(path) -> str:
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def tensor_names(tree) -> list[str]:
    """Names of the leaves in flattening order (the row order of step_telemetry)."""
    return [_path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def step_telemetry(grads, prev_adam_state, new_adam_state, params, b1, b2, eps,
                   with_hist: bool = False):
    """Sums (num_tensors, NUM_SUMS) and, if with_hist (static), histograms
    (num_tensors, NUM_HIST_BINS) int32, else None.

    grads: the gradient Adam consumed at this step (optim.consumed_grads); prev_adam_state /
    new_adam_state: optax.ScaleByAdamState before / after the step; params: after the step.
    b1, b2, eps may be traced."""
    count = new_adam_state.count
    bc1 = 1 - b1 ** count
    bc2 = 1 - b2 ** count
    g_l = jax.tree.leaves(grads)
    mu_l = jax.tree.leaves(new_adam_state.mu)
    nu_l = jax.tree.leaves(new_adam_state.nu)
    mp_l = jax.tree.leaves(prev_adam_state.mu)
    p_l = jax.tree.leaves(params)
    if not len(g_l) == len(mu_l) == len(nu_l) == len(mp_l) == len(p_l):
        raise ValueError("step_telemetry: grads, adam states and params differ in structure")
    sums, hists = [], []
    for g, mu, nu, mp, p in zip(g_l, mu_l, nu_l, mp_l, p_l):
        m_hat = mu / bc1.astype(mu.dtype)
        v_hat = nu / bc2.astype(nu.dtype)
        sums.append(tensor_sums(g, m_hat, v_hat, mp, p, eps))
        if with_hist:
            hists.append(hist_counts(update_direction(m_hat, v_hat, jnp.asarray(eps, m_hat.dtype))))
    dt = jnp.result_type(*[s.dtype for s in sums])
    sums = jnp.stack([s.astype(dt) for s in sums])
    return sums, (jnp.stack(hists) if with_hist else None)


def layer_columns(names, depths, kinds, numels, sums, eps: float) -> dict[str, np.ndarray]:
    """Columns for RunWriter.log_layers(columns=...): name, depth, kind, numel and every
    METRIC_NAMES metric, from the (num_tensors, NUM_SUMS) sums of one step."""
    sums = np.asarray(sums, dtype=np.float64)
    if sums.ndim != 2 or sums.shape != (len(names), NUM_SUMS):
        raise ValueError(f"sums: expected shape ({len(names)}, {NUM_SUMS}), got {sums.shape}")
    metrics = finalize(sums, float(eps))
    cols = {"name": np.asarray(names, dtype=object), "depth": np.asarray(depths, np.int32),
            "kind": np.asarray(kinds, dtype=object), "numel": np.asarray(numels, np.int64)}
    cols.update({k: np.asarray(metrics[k]) for k in METRIC_NAMES})
    return cols
