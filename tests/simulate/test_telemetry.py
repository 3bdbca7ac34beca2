"""simulate.telemetry equals adamspike.metrics (numpy reference) on real optax state."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from adamspike import metrics
from adamspike.train_config import OptimSection
from simulate import native_telemetry as N
from simulate import optim as O
from simulate import telemetry as T


def _jitted(b1, b2, eps, path, **kw):
    """step_telemetry(g, prev, new, params) jitted with b1, b2, eps static, on the native
    path (simulate.native_telemetry: an FFI call) or on XLA's (native=False); checks which
    one the traced program takes."""
    native = path == "native"

    def fn(g, prev, new, params):
        return T.step_telemetry(g, prev, new, params, b1, b2, eps, with_hist=True,
                                native=native, **kw)

    def call(*args):
        assert (N.TARGET in str(jax.make_jaxpr(fn)(*args))) == native
        return jax.jit(fn)(*args)

    return call


def _loss(p, x, y):
    h = jnp.tanh(x @ p["l0.weight"].T + p["l0.bias"])
    return jnp.mean((h @ p["l1.weight"].T - y) ** 2)


@functools.lru_cache(maxsize=None)
def _run(dtype, num_steps=7, eps=1e-6):
    """Real training steps of a small net; returns what telemetry needs at the last step.
    Deterministic, so computed once per (dtype, num_steps, eps) for the module: the three
    telemetry paths of a case read the same state (each call compiles its own gradient and
    update programs)."""
    rng = np.random.default_rng(0)
    params = {"l0.weight": rng.normal(size=(32, 8)) * 0.5, "l0.bias": np.zeros(32),
              "l1.weight": rng.normal(size=(1, 32)) * 0.01}
    params = {k: jnp.asarray(v, dtype) for k, v in params.items()}
    x = jnp.asarray(rng.normal(size=(64, 8)), dtype)
    y = jnp.asarray(np.sin(rng.normal(size=(64, 1))), dtype)
    opt = OptimSection(lr=3e-2, b1=0.9, b2=0.95, eps=eps, weight_decay=0.01, grad_clip=0.5,
                       schedule="constant")
    tx = O.adamw(opt, num_steps)
    state = tx.init(params)
    grad_fn = jax.jit(jax.grad(_loss))
    for _ in range(num_steps):
        grads = grad_fn(params, x, y)
        prev = O.adam_state(state)
        upd, state = jax.jit(tx.update)(grads, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, upd)
    g = O.consumed_grads(grads, state)
    return opt, g, prev, O.adam_state(state), params


def _reference(opt, g, prev, new, params):
    t = int(new.count)
    rows, rs = [], []
    for k in T.tensor_names(g):
        m_hat = np.asarray(new.mu[k], np.float64) / (1 - opt.b1 ** t)
        v_hat = np.asarray(new.nu[k], np.float64) / (1 - opt.b2 ** t)
        rows.append(metrics.shard_sums(np.asarray(g[k]), m_hat, v_hat, np.asarray(prev.mu[k]),
                                       np.asarray(params[k]), opt.eps))
        rs.append(metrics.update_direction(m_hat, v_hat, opt.eps))
    return np.stack(rows), rs


# path: "traced" (b1, b2, eps traced: XLA's reductions), "native" (static: the C loop by
# FFI), "xla" (static, native=False)
@pytest.mark.parametrize("path", ["traced", "native", "xla"])
@pytest.mark.parametrize("eps,regime", [(1e-6, "sat_frac"), (3e-3, "eps_frac")])
@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 1e-5), (jnp.float64, 1e-12)])
def test_metrics_equal_numpy_reference(dtype, rtol, eps, regime, path):
    with jax.enable_x64(dtype == jnp.float64):
        opt, g, prev, new, params = _run(dtype, eps=eps)
        if path == "traced":
            sums, hists = jax.jit(T.step_telemetry, static_argnames="with_hist")(
                g, prev, new, params, opt.b1, opt.b2, opt.eps, with_hist=True)
        else:
            sums, hists = _jitted(opt.b1, opt.b2, opt.eps, path)(g, prev, new, params)
        assert sums.dtype == dtype and hists.shape == (3, metrics.NUM_HIST_BINS)
        want_sums, rs = _reference(opt, g, prev, new, params)
        names = T.tensor_names(g)
        cols = T.layer_columns(names, [0, 0, 1], ["param", "param", "param"],
                               [int(want_sums[i, 0]) for i in range(3)], np.asarray(sums), opt.eps)
        for i, name in enumerate(names):
            want = metrics.finalize(want_sums[i], opt.eps)
            for m in metrics.METRIC_NAMES:
                np.testing.assert_allclose(cols[m][i], want[m], rtol=rtol, atol=0, err_msg=m)
        # the run is in the regime it is meant to exercise (saturated r / v below eps^2)
        assert np.any(cols[regime] > 0) and np.all(np.isfinite(cols["grad_mom_cos"]))
        # count-like sums are exact
        np.testing.assert_array_equal(np.asarray(sums)[:, [0, 7, 8]], want_sums[:, [0, 7, 8]])
        if dtype == jnp.float64:  # r identical -> identical bins
            for i in range(3):
                np.testing.assert_array_equal(np.asarray(hists[i]), metrics.histogram(rs[i]))
        assert (np.asarray(hists).sum(axis=1) == want_sums[:, 0]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_histogram_edges_and_clipping_match_numpy(dtype):
    e = metrics.HIST_EDGES.astype(dtype)
    nz = e[e != 0]  # the ulp neighbours of 0 are denormals, which XLA CPU flushes to 0
    near = np.concatenate([e, np.nextafter(nz, dtype(-np.inf)), np.nextafter(nz, dtype(np.inf))])
    r = np.concatenate([near, np.array([-5.0, 7.0, np.inf, -np.inf, 0.0], dtype)]).astype(dtype)
    rng = np.random.default_rng(3)
    r = np.concatenate([r, rng.normal(size=2000).astype(dtype)])
    with jax.enable_x64(dtype == np.float64):
        got = np.asarray(jax.jit(T.hist_counts)(jnp.asarray(r)))
    np.testing.assert_array_equal(got, metrics.histogram(r))
    assert got.sum() == r.size


def test_eps_zero_and_zero_state():
    """eps = 0 with v_hat = 0 somewhere (g = 0 there): g2_over_v counts those as 0 like the
    reference; sqrt(v_hat) < 0 is never true."""
    with jax.enable_x64(True):
        g = jnp.array([0.0, 1.0, -2.0])
        v_hat = jnp.array([0.0, 1.0, 4.0])
        m_hat = jnp.array([0.0, 0.5, -2.0])
        s = np.asarray(T.tensor_sums(g, m_hat, v_hat, m_hat, g, 0.0))
    with np.errstate(invalid="ignore"):  # r = 0/0 at the dead coordinate
        want = metrics.shard_sums(np.asarray(g), np.asarray(m_hat), np.asarray(v_hat),
                                  np.asarray(m_hat), np.asarray(g), 0.0)
    # r = 0/0 = nan at the dead coordinate in both; compare the rest
    ok = [i for i, f in enumerate(metrics.SUM_FIELDS) if not f.startswith("r") and f != "sat"]
    np.testing.assert_allclose(s[ok], want[ok], rtol=1e-15)


def test_layer_columns_shape_error():
    with pytest.raises(ValueError, match="sums"):
        T.layer_columns(["a"], [0], ["param"], [3], np.zeros((2, T.NUM_SUMS)), 1e-8)


def _odd_sized_state(dtype, eps):
    """A pytree whose sizes straddle the packing block (1, < BLOCK, > BLOCK, not multiples:
    packed) or fill whole blocks (BLOCK, and 2 BLOCK as a matrix: read in place). (Edge
    placement is test_histogram_edges_and_clipping_match_numpy's job: here jitted and numpy
    r differ by an ulp, XLA turning x / c into x * (1/c).)"""
    rng = np.random.default_rng(7)
    shapes = {"a": (1,), "b": (3, 5), "c": (T.BLOCK,), "d": (T.BLOCK + 37,), "e": (9, 300),
              "f": (4, T.BLOCK // 2)}
    t, b1, b2 = 4, 0.9, 0.95
    g, mu, nu, mp, p = ({k: rng.normal(size=s) * sc for k, s in shapes.items()}
                        for sc in (1.0, 0.3, 1.0, 0.3, 1.0))
    nu = {k: v * v * (1e-4 if k == "e" else 1.0) for k, v in nu.items()}  # "e": sqrt(v) < eps
    cast = lambda tree: {k: jnp.asarray(v, dtype) for k, v in tree.items()}  # noqa: E731
    new = optax.ScaleByAdamState(count=jnp.asarray(t, jnp.int32), mu=cast(mu), nu=cast(nu))
    prev = new._replace(mu=cast(mp))
    return cast(g), prev, new, cast(p), b1, b2


@pytest.mark.parametrize("eps,path", [(1e-2, "traced"), (0.0, "traced"), (1e-2, "native")])
@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 2e-5), (jnp.float64, 1e-12)])
def test_packed_layout_odd_sizes(dtype, rtol, eps, path):
    """The packed (block-padded) and in-place computations equal the numpy reference per
    tensor, for sizes that do not fill whole blocks (padding adds nothing to any sum or
    histogram) and for those that do; so does the native loop (no padding: each tensor's
    last block is partial), for the same sizes."""
    with jax.enable_x64(dtype == jnp.float64):
        g, prev, new, params, b1, b2 = _odd_sized_state(dtype, eps)
        if path == "traced":
            sums, hists = jax.jit(T.step_telemetry, static_argnames="with_hist")(
                g, prev, new, params, b1, b2, eps, with_hist=True)
        else:
            sums, hists = _jitted(b1, b2, eps, path)(g, prev, new, params)
        sums, hists = np.asarray(sums), np.asarray(hists)
        bc1, bc2 = (np.asarray(1 - b ** new.count, dtype) for b in (b1, b2))
        r_jit = jax.jit(lambda mu, nu: T.update_direction(mu / bc1, nu / bc2,
                                                          jnp.asarray(eps, dtype)))
        for i, k in enumerate(T.tensor_names(g)):
            m_hat = np.asarray(new.mu[k]) / bc1
            v_hat = np.asarray(new.nu[k]) / bc2
            with np.errstate(invalid="ignore", divide="ignore"):
                want = metrics.shard_sums(np.asarray(g[k]), m_hat, v_hat, np.asarray(prev.mu[k]),
                                          np.asarray(params[k]), eps)
            np.testing.assert_array_equal(sums[i, [0, 7, 8]], want[[0, 7, 8]], err_msg=k)
            np.testing.assert_allclose(sums[i], want, rtol=rtol, atol=0, err_msg=k)
            # the histogram equals that of this tensor's own (jitted) r alone
            r = r_jit(new.mu[k], new.nu[k])
            np.testing.assert_array_equal(hists[i], np.asarray(T.hist_counts(r)), err_msg=k)
            if dtype == jnp.float64:
                np.testing.assert_array_equal(
                    hists[i], metrics.histogram(metrics.update_direction(m_hat, v_hat, eps)))
        assert (hists.sum(axis=1) == sums[:, 0]).all()
        if eps > 0:
            assert sums[4, 8] > 0  # "e" is in the eps regime: the padded-count correction matters


def test_hist_bins_nan_goes_to_last_bin():
    got = np.asarray(T.hist_counts(jnp.array([np.nan, 0.0], jnp.float32)))
    assert got[-1] == 1 and got.sum() == 2


@pytest.mark.parametrize("eps", [1e-2, 3e-5])
def test_static_eps_and_grad_scale_paths_equal_traced(eps):
    """With eps a Python float > 0 the padding is not masked (r = 0 / eps = 0 there), and with
    grad_scale the raw gradient is scaled inside the packed computation: both give exactly
    the counts and histograms of the general path (eps traced, pre-scaled gradient), and
    float sums that equal the numpy reference as closely as the general path's do (the
    two programs fuse, and so round, differently)."""
    g, prev, new, params, b1, b2 = _odd_sized_state(jnp.float32, eps)
    scale = jnp.float32(0.37)
    scaled = jax.tree.map(lambda x: x * scale, g)
    general = jax.jit(T.step_telemetry, static_argnames="with_hist")(
        scaled, prev, new, params, b1, b2, eps, with_hist=True)
    fast = jax.jit(lambda g, s: T.step_telemetry(g, prev, new, params, b1, b2, eps,
                                                 with_hist=True, grad_scale=s,
                                                 native=False))(g, scale)
    (sums_g, hist_g), (sums_f, hist_f) = general, fast
    np.testing.assert_array_equal(np.asarray(hist_f), np.asarray(hist_g))
    np.testing.assert_array_equal(np.asarray(sums_f)[:, [0, 7, 8]], np.asarray(sums_g)[:, [0, 7, 8]])
    bc1, bc2 = (np.float32(1 - b ** new.count) for b in (b1, b2))
    for i, k in enumerate(T.tensor_names(g)):
        want = metrics.shard_sums(np.asarray(scaled[k]), np.asarray(new.mu[k]) / bc1,
                                  np.asarray(new.nu[k]) / bc2, np.asarray(prev.mu[k]),
                                  np.asarray(params[k]), eps)
        np.testing.assert_allclose(np.asarray(sums_f)[i], want, rtol=2e-5, atol=0, err_msg=k)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_native_equals_xla_path(dtype):
    """The C loop and XLA's reductions on the same real state: the same r (so the same
    histograms, bit for bit) and counts; the other sums to the compute dtype's rounding
    (they add in different orders; the loop's totals are float64)."""
    with jax.enable_x64(dtype == jnp.float64):
        opt, g, prev, new, params = _run(dtype, eps=1e-6)
        scale = jnp.asarray(0.37, dtype)
        args = (jax.tree.map(lambda x: x / scale, g), prev, new, params)
        (sn, hn), (sx, hx) = (_jitted(opt.b1, opt.b2, opt.eps, path, grad_scale=scale)(*args)
                              for path in ("native", "xla"))
        np.testing.assert_array_equal(np.asarray(hn), np.asarray(hx))
        np.testing.assert_array_equal(np.asarray(sn)[:, [0, 7, 8]], np.asarray(sx)[:, [0, 7, 8]])
        rtol = 1e-5 if dtype == jnp.float32 else 1e-12
        np.testing.assert_allclose(np.asarray(sn), np.asarray(sx), rtol=rtol, atol=0)


def test_native_path_under_vmap_equals_one_call_per_member():
    """Under vmap (a sweep's seeds) the FFI call gets every operand broadcast to the batch
    and loops over it: each member's sums and histograms are those of its own call."""
    states = [_odd_sized_state(jnp.float32, 1e-2) for _ in range(3)]
    states = [jax.tree.map(lambda x, k=k: x * (1 + 0.1 * k), st[:4]) for k, st in enumerate(states)]
    b1, b2 = 0.9, 0.95

    def one(g, prev, new, params):
        return T.step_telemetry(g, prev, new, params, b1, b2, 1e-2, with_hist=True)

    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    assert N.TARGET in str(jax.make_jaxpr(jax.vmap(one))(*stacked))
    sums, hists = jax.jit(jax.vmap(one))(*stacked)
    for k, st in enumerate(states):
        s1, h1 = jax.jit(one)(*st)
        np.testing.assert_array_equal(np.asarray(sums[k]), np.asarray(s1))
        np.testing.assert_array_equal(np.asarray(hists[k]), np.asarray(h1))


def test_native_path_only_where_it_applies():
    """A traced or zero eps, or mixed dtypes, keep XLA's reductions."""
    g, prev, new, params, b1, b2 = _odd_sized_state(jnp.float32, 1e-2)

    def traced(g, prev, new, params, eps):
        return T.step_telemetry(g, prev, new, params, b1, b2, eps)

    assert N.TARGET not in str(jax.make_jaxpr(traced)(g, prev, new, params, 1e-2))
    for eps, grads in ((0.0, g), (1e-2, {**g, "a": g["a"].astype(jnp.bfloat16)})):
        jaxpr = jax.make_jaxpr(lambda *a, e=eps: T.step_telemetry(*a, b1, b2, e))(grads, prev, new, params)
        assert N.TARGET not in str(jaxpr)


def test_native_kernel_unavailable_is_a_warning_and_xla_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAMSPIKE_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(N, "_STATE", {})
    g, prev, new, params, b1, b2 = _odd_sized_state(jnp.float32, 1e-2)
    with pytest.warns(RuntimeWarning, match="native CPU kernel is unavailable"):
        jaxpr = jax.make_jaxpr(lambda *a: T.step_telemetry(*a, b1, b2, 1e-2))(g, prev, new, params)
    assert N.TARGET not in str(jaxpr)
    assert not list((tmp_path / "kernels").glob("*/*.so"))
