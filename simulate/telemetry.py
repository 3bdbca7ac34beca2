"""Per-tensor Adam telemetry in JAX (jittable): adamspike/metrics.py, computed on device.

For each tensor, from the gradient g Adam consumed (after clipping), the bias-corrected
state after the step m_hat = mu_t / (1-b1^t), v_hat = nu_t / (1-b2^t), the raw momentum
before the step m_prev = mu_{t-1} and the parameter p after the step, `tensor_sums` returns
the SUM_FIELDS sums (n, sum g^2, sum r^k for k=1..4, sum g^2/max(v_hat, eps^2), #|r|>0.9,
#sqrt(v_hat)<eps, sum m_hat^2, sum v_hat, sum g m_prev, sum m_prev^2, sum p^2) with
r = m_hat / (sqrt(v_hat) + eps); `adamspike.metrics.finalize` turns them into METRIC_NAMES
on the host (`layer_columns`). `hist_counts` bins r on HIST_EDGES, values outside clipped
into the end bins, exactly as `adamspike.metrics.histogram`.

Precision: sums are accumulated in the tensors' dtype (float64 under jax.enable_x64),
per block of BLOCK elements and then per tensor; the counts (sat, eps_small) are sums of
0/1 in that dtype, exact up to 2^24 elements per tensor in float32; n and the histograms
(int32) are exact. Histogram edges are
rounded up to the compute dtype, which makes `edge_lo <= r < edge_hi` in float32 the same
decision as numpy's comparison in float64.

Speed: on CPU, with eps > 0 known at trace time (static b1, b2, eps, or traced ones with
eps_positive and their exact bits: simulate.program's step) and one dtype (the trainers' case),
`step_telemetry` hands the sums and histograms to simulate.native_telemetry, the C loop
shared with the torch trainer, as an FFI call inside the jitted step: on the tiny LLaMA
step it costs ~0.15 ms where XLA's reductions below cost ~0.3 ms (paired 1.019-1.029
against 1.051-1.059, bench/bench_telemetry_jax.py). Elsewhere (traced hyperparameters in
vmapped sweeps, eps = 0, other backends) the XLA code below runs.

Tensors are taken in `tensor_names(tree)` order (jax's flattening order: sorted keys for a
dict; nested keys joined by "."), the row order of the returned arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from adamspike.metrics import (HIST_EDGES, METRIC_NAMES, NUM_HIST_BINS, NUM_VHIST_BINS,
                               SAT_THRESHOLD, SUM_FIELDS, VHIST_EDGES, finalize)
from simulate import native_telemetry

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


BLOCK = 1024  # elements per block of the packed layout (see step_telemetry)
LANES = 128   # minor axis of a block, (BLOCK // LANES, LANES): the width of the accumulators


def _elementwise_terms(g, m_hat, v_hat, r, m_prev, p, eps, valid):
    """r and the 13 per-element terms whose sums are SUM_FIELDS[1:] (count terms as 0/1),
    given r = update_direction(m_hat, v_hat, eps); r is set to 0 where not `valid`
    (padding: 0/0 when eps = 0)."""
    r = jnp.where(valid, r, 0.0)
    r2 = r * r
    g2 = g * g
    denom = jnp.maximum(v_hat, eps * eps)
    ok = denom > 0  # false only with eps = 0 and v_hat = 0, where g = 0: counts as 0
    g2_over_v = jnp.where(ok, g2 / jnp.where(ok, denom, 1.0), 0.0)
    one = lambda mask: mask.astype(r.dtype)  # noqa: E731
    return r, [g2, r, r2, r2 * r, r2 * r2, g2_over_v, one(jnp.abs(r) > SAT_THRESHOLD),
               one(jnp.sqrt(v_hat) < eps), m_hat * m_hat, v_hat, g * m_prev, m_prev * m_prev,
               p * p]


def tensor_sums(g, m_hat, v_hat, m_prev, p, eps) -> jax.Array:
    """The SUM_FIELDS sums of one tensor, shape (NUM_SUMS,), dtype of g (at least float32)."""
    dt = jnp.result_type(g.dtype, jnp.float32)
    g, m_hat, v_hat, m_prev, p = (jnp.ravel(x).astype(dt) for x in (g, m_hat, v_hat, m_prev, p))
    eps = jnp.asarray(eps, dt)
    _, terms = _elementwise_terms(g, m_hat, v_hat, update_direction(m_hat, v_hat, eps), m_prev,
                                  p, eps, True)
    return jnp.stack([jnp.asarray(g.size, dt)] + [t.sum() for t in terms])


def hist_bins(r) -> jax.Array:
    """int32 bin index in [0, NUM_HIST_BINS) of each element of r on HIST_EDGES, as
    numpy.histogram after clipping: out-of-range values go to the end bins, the last edge
    belongs to the last bin, NaN to the last bin. The uniform grid gives a first guess
    floor((r - lo) / width), off by at most one bin from rounding; one comparison with the
    (rounded-up) edge on each side makes it exact (no binary search)."""
    dt = np.dtype(jnp.result_type(r.dtype, jnp.float32))
    r = r.astype(dt)
    edges = jnp.asarray(_EDGES[dt])
    lo, width = HIST_EDGES[0], (HIST_EDGES[-1] - HIST_EDGES[0]) / NUM_HIST_BINS
    last = NUM_HIST_BINS - 1
    idx = jnp.clip(jnp.floor((r - lo) / width), 0, last).astype(jnp.int32)
    idx = idx - (r < edges[idx]).astype(jnp.int32)
    idx = idx + (r >= edges[idx + 1]).astype(jnp.int32)
    return jnp.where(jnp.isnan(r), last, jnp.clip(idx, 0, last))


def hist_counts(r) -> jax.Array:
    """int32 counts (NUM_HIST_BINS,) of r on HIST_EDGES; out-of-range values go to the end
    bins, the last edge belongs to the last bin (numpy.histogram)."""
    return jnp.zeros(NUM_HIST_BINS, jnp.int32).at[hist_bins(jnp.ravel(r))].add(1)


def vhist_counts(v_hat, eps) -> jax.Array:
    """int32 counts (NUM_VHIST_BINS,) of sqrt(v_hat)/eps on VHIST_EDGES, binned as
    adamspike.metrics.vhist_bins (searchsorted side="right" - 1, clipped; NaN to the last
    bin). Computed in the tensor's dtype (at least float32): a value within a rounding of
    an edge may land in the neighbouring bin of the float64 reference."""
    dt = jnp.result_type(v_hat.dtype, jnp.float32)
    x = jnp.sqrt(jnp.ravel(v_hat).astype(dt)) / jnp.asarray(eps, dt)
    idx = jnp.searchsorted(jnp.asarray(VHIST_EDGES, dt), x, side="right") - 1
    idx = jnp.clip(jnp.where(jnp.isnan(x), NUM_VHIST_BINS - 1, idx), 0, NUM_VHIST_BINS - 1)
    return jnp.bincount(idx, length=NUM_VHIST_BINS).astype(jnp.int32)


def step_vhists(new_adam_state, b2, eps) -> jax.Array:
    """(num_tensors, NUM_VHIST_BINS) int32 sqrt(v_hat)/eps histograms of every tensor
    (tensor_names order), v_hat = nu / (1 - b2^count) after the step. Called on histogram
    steps only (a searchsorted per element). eps: a scalar or one per tensor (per-group eps)."""
    nu_l = jax.tree.leaves(new_adam_state.nu)
    eps_l = _per_tensor(eps, len(nu_l))
    bc2 = 1 - b2 ** new_adam_state.count
    return jnp.stack([vhist_counts(nu / bc2.astype(nu.dtype), e) for nu, e in zip(nu_l, eps_l)])


def _per_tensor(eps, num_tensors: int) -> list:
    """eps as one value per tensor: a list/tuple of num_tensors values, or a scalar repeated."""
    if isinstance(eps, (list, tuple)):
        if len(eps) != num_tensors:
            raise ValueError(f"eps: {len(eps)} values for {num_tensors} tensors")
        return list(eps)
    return [eps] * num_tensors


def grad_below_eps(grads, eps, grad_scale=None) -> jax.Array:
    """(num_tensors,) int32: coordinates with |g| < eps of the gradient Adam consumed
    (grads times grad_scale, clip_info's factor, when given), tensor_names order. eps: a
    scalar or one per tensor."""
    out = []
    leaves = jax.tree.leaves(grads)
    for g, eps in zip(leaves, _per_tensor(eps, len(leaves))):
        dt = jnp.result_type(g.dtype, jnp.float32)
        g = g.astype(dt) * (1 if grad_scale is None else jnp.asarray(grad_scale).astype(dt))
        out.append(jnp.sum(jnp.abs(g) < jnp.asarray(eps, dt), dtype=jnp.int32))
    return jnp.stack(out)


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


def _pack(leaves, dt, block):
    """Concatenate raveled leaves, each zero-padded to a multiple of `block` (one concatenate
    with constant zero pieces, no pad kernels), as (num_blocks, block); returns it and the
    number of blocks of each leaf."""
    parts, nblocks = [], []
    for x in leaves:
        x = jnp.ravel(x).astype(dt)
        nb = max(1, -(-x.size // block))
        parts.append(x)
        if nb * block > x.size:
            parts.append(jnp.zeros(nb * block - x.size, dt))
        nblocks.append(nb)
    return jnp.concatenate(parts).reshape(-1, block), nblocks


def _column_sums(terms):
    """Sums over axis 1 of same-shaped (num_blocks, rows, LANES) terms in one variadic
    reduce: a single XLA loop that reads the inputs once and keeps LANES-wide accumulators
    per term (reducing a non-minor axis vectorises; 13 separate reductions or a reduce over
    the minor axis cost twice as much on XLA:CPU). Returns (num_blocks, len(terms))."""
    zeros = tuple(jnp.zeros((), terms[0].dtype) for _ in terms)
    cols = jax.lax.reduce(tuple(terms), zeros,
                          lambda a, b: tuple(x + y for x, y in zip(a, b)), (1,))
    return jnp.stack(cols, axis=1).sum(axis=2)


def step_telemetry(grads, prev_adam_state, new_adam_state, params, b1, b2, eps,
                   with_hist: bool = False, grad_scale=None, native: bool = True,
                   bits=None, eps_positive: bool = False):
    """`_step_telemetry` (below), with eps a scalar or a list of one Python float per
    tensor (per-group eps, adamspike.mitigations): the tensors of each eps value are then
    summed by one call, and the rows put back in tensor order."""
    if not isinstance(eps, (list, tuple)):
        return _step_telemetry(grads, prev_adam_state, new_adam_state, params, b1, b2, eps,
                               with_hist, grad_scale, native, bits, eps_positive)
    leaves = [jax.tree.leaves(x) for x in (grads, prev_adam_state.mu, new_adam_state.mu,
                                           new_adam_state.nu, params)]
    if len(eps) != len(leaves[0]):
        raise ValueError(f"step_telemetry: {len(eps)} eps values for {len(leaves[0])} tensors")
    order, sums, hists = [], [], []
    for e in sorted(set(eps)):
        idx = [i for i, x in enumerate(eps) if x == e]
        g, mp, mu, nu, p = ([x[i] for i in idx] for x in leaves)
        s, h = _step_telemetry(g, new_adam_state._replace(mu=mp), new_adam_state._replace(mu=mu, nu=nu),
                               p, b1, b2, float(e), with_hist, grad_scale, native)
        order += idx
        sums.append(s)
        hists.append(h)
    inv = np.argsort(np.asarray(order))
    return (jnp.concatenate(sums)[inv],
            jnp.concatenate(hists)[inv] if with_hist else None)


def _step_telemetry(grads, prev_adam_state, new_adam_state, params, b1, b2, eps,
                    with_hist: bool = False, grad_scale=None, native: bool = True,
                    bits=None, eps_positive: bool = False):
    """Sums (num_tensors, NUM_SUMS) and, if with_hist (static), histograms
    (num_tensors, NUM_HIST_BINS) int32, else None.

    grads: the gradient Adam consumed at this step (optim.consumed_grads), or, with
    grad_scale (a scalar, optim.clip_info's factor), the raw gradient that times grad_scale
    is the consumed one: the product is then taken inside the telemetry's own loops (the
    same float multiply, so the same consumed gradient) instead of materialising a scaled
    copy of every tensor; prev_adam_state / new_adam_state: optax.ScaleByAdamState before /
    after the step; params: after the step. b1, b2, eps may be traced. native (static): on
    CPU, with static b1, b2, eps > 0 and one dtype, the sums come from
    simulate.native_telemetry's C loop (an FFI call in the same jitted step) instead of
    the XLA reductions below; so too with b1, b2, eps traced (float32 scalars) when
    eps_positive (static) says eps > 0 and bits (traced, native_telemetry.exact_bits) gives
    the loop b1 and eps exactly. eps_positive also spares the padding's mask, as a static
    eps > 0 does: the same operations as the static path, on inputs instead of constants.

    Layout (speed): a per-tensor loop of 13 reductions costs ~14 small XLA kernels per
    tensor. Instead every tensor is seen as (num_blocks, BLOCK // LANES, LANES) blocks and
    its 13 terms are summed per block by one variadic reduce (`_column_sums`), then over
    its blocks. A tensor that fills whole blocks (size a multiple of BLOCK, in the compute
    dtype: most weight matrices) is only reshaped, a free bitcast, and read in place; the
    others are packed together into one zero-padded array (one concatenate per input) whose
    per-block sums are added per tensor by a (tensors, blocks) 0/1 matrix product. Copying
    every tensor into one packed array cost as much as the reduction itself. Padding
    (g = m = v = p = 0) contributes 0 to every sum except `sqrt(v_hat) < eps`, whose padded
    count is known and subtracted; r there is 0 / (0 + eps) = 0 when eps > 0, and is masked
    to 0 only when eps may be 0 (traced, or 0), the mask costing as much again on XLA:CPU."""
    g_l = jax.tree.leaves(grads)
    mu_l = jax.tree.leaves(new_adam_state.mu)
    nu_l = jax.tree.leaves(new_adam_state.nu)
    mp_l = jax.tree.leaves(prev_adam_state.mu)
    p_l = jax.tree.leaves(params)
    if not len(g_l) == len(mu_l) == len(nu_l) == len(mp_l) == len(p_l):
        raise ValueError("step_telemetry: grads, adam states and params differ in structure")
    dt = jnp.result_type(*[x.dtype for x in g_l], jnp.float32)
    count = new_adam_state.count
    bc1 = (1 - b1 ** count).astype(dt)
    bc2 = (1 - b2 ** count).astype(dt)
    eps_t = jnp.asarray(eps, dt)
    if grad_scale is not None and any(x.dtype != dt for x in g_l):  # scale in their dtype
        g_l = [x * jnp.asarray(grad_scale).astype(x.dtype) for x in g_l]
        grad_scale = None
    scale = None if grad_scale is None else jnp.asarray(grad_scale).astype(dt)
    if native and native_telemetry.usable((g_l, mu_l, nu_l, mp_l, p_l), dt, b1, b2, eps,
                                          eps_positive and bits is not None):
        return native_telemetry.step_sums(g_l, mu_l, nu_l, mp_l, p_l, bc1, bc2, scale, b1,
                                          eps, dt, with_hist, bits)
    shape = (-1, BLOCK // LANES, LANES)

    def block_terms(g, mu, nu, mp, p, valid):
        """r and the (num_blocks, 13) block sums of inputs of one shape, viewed as
        (num_blocks, rows, LANES). m_hat, v_hat and r come first, in the inputs' shape: in a
        whole tensor's shape they are optax's own expressions, which XLA computes once for
        both the update and the telemetry."""
        m_hat, v_hat = mu / bc1, nu / bc2
        r = update_direction(m_hat, v_hat, eps_t)
        g, m_hat, v_hat, mp, p, r = (x.reshape(shape) for x in (g, m_hat, v_hat, mp, p, r))
        if scale is not None:
            g = g * scale
        r, terms = _elementwise_terms(g, m_hat, v_hat, r, mp, p, eps_t, valid)
        return r, _column_sums(terms)

    leaves = list(zip(g_l, mu_l, nu_l, mp_l, p_l))
    sizes = np.array([x.size for x in g_l])
    whole = [i for i, xs in enumerate(leaves)
             if sizes[i] % BLOCK == 0 and all(x.dtype == dt for x in xs)]
    packed = [i for i in range(len(leaves)) if i not in set(whole)]
    rows, rs = [None] * len(leaves), {}
    for i in whole:   # in place: no padding, nothing to mask
        rs[i], block_sums = block_terms(*leaves[i], True)
        rows[i] = block_sums.sum(axis=0)
    num_pad = np.zeros(len(leaves), np.int64)
    if packed:
        g, nblocks = _pack([g_l[i] for i in packed], dt, BLOCK)
        mu, nu, mp, p = (_pack([x[i] for i in packed], dt, BLOCK)[0]
                         for x in (mu_l, nu_l, mp_l, p_l))
        num_pad[packed] = np.asarray(nblocks) * BLOCK - sizes[packed]
        if eps_positive or isinstance(eps, (int, float)) and eps > 0:
            valid = True
        else:
            valid = np.concatenate([np.arange(nb * BLOCK) < sizes[i]
                                    for nb, i in zip(nblocks, packed)])
            valid = jnp.asarray(valid.reshape(shape))
        r_packed, block_sums = block_terms(g, mu, nu, mp, p, valid)
        owner = np.repeat(np.arange(len(packed)), nblocks)
        seg = np.zeros((len(packed), owner.size), np.dtype(dt))
        seg[owner, np.arange(owner.size)] = 1
        tensor = jnp.dot(jnp.asarray(seg), block_sums, precision=jax.lax.Precision.HIGHEST)
        for j, i in enumerate(packed):
            rows[i] = tensor[j]
    eps_col = SUM_FIELDS.index("eps_small") - 1
    tensor = jnp.stack(rows).at[:, eps_col].add(
        jnp.where(eps_t > 0, -jnp.asarray(num_pad, dt), 0))
    sums = jnp.concatenate([jnp.asarray(sizes, dt)[:, None], tensor], axis=1)
    if not with_hist:
        return sums, None
    # One binning pass over every r and one scatter into (num_tensors, bins); the
    # padding's r = 0 lands in 0's bin and is taken out again.
    r_all = [jnp.ravel(rs[i]) for i in whole]
    offsets = [np.full(sizes[i], i * NUM_HIST_BINS) for i in whole]
    if packed:
        r_all.append(jnp.ravel(r_packed))
        offsets.append(np.repeat(np.asarray(packed)[owner] * NUM_HIST_BINS, BLOCK))
    flat = jnp.asarray(np.concatenate(offsets), jnp.int32) + hist_bins(jnp.concatenate(r_all))
    hists = jnp.zeros(len(leaves) * NUM_HIST_BINS, jnp.int32).at[flat].add(1)
    hists = hists.reshape(len(leaves), NUM_HIST_BINS)
    zero_bin = int(np.searchsorted(_EDGES[np.dtype(dt)], 0.0, side="right")) - 1
    return sums, hists.at[:, zero_bin].add(-jnp.asarray(num_pad, jnp.int32))


def layer_columns(names, depths, kinds, numels, sums, eps) -> dict[str, np.ndarray]:
    """Columns for RunWriter.log_layers(columns=...): name, depth, kind, numel and every
    METRIC_NAMES metric, from the (num_tensors, NUM_SUMS) sums of one step; eps a scalar
    or one per tensor."""
    sums = np.asarray(sums, dtype=np.float64)
    if sums.ndim != 2 or sums.shape != (len(names), NUM_SUMS):
        raise ValueError(f"sums: expected shape ({len(names)}, {NUM_SUMS}), got {sums.shape}")
    metrics = finalize(sums, np.asarray(eps, dtype=np.float64))
    cols = {"name": np.asarray(names, dtype=object), "depth": np.asarray(depths, np.int32),
            "kind": np.asarray(kinds, dtype=object), "numel": np.asarray(numels, np.int64)}
    cols.update({k: np.asarray(metrics[k]) for k in METRIC_NAMES})
    return cols
