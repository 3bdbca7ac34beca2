"""sqrt(v_hat)/eps histograms of the JAX toys (simulate.telemetry.vhist_counts /
step_vhists) equal adamspike.metrics.vhistogram, and the MLP toy writes them."""

import jax
import jax.numpy as jnp
import numpy as np

from adamspike.metrics import NUM_VHIST_BINS, VHIST_EDGES, vhist_bins, vhistogram
from adamspike.rundir import load_run
from simulate.telemetry import step_vhists, vhist_counts


def _away_from_edges(x, rel=1e-5):
    """Drop values within `rel` of an edge (float32 rounding may move them one bin)."""
    d = np.min(np.abs(np.log(x[:, None] / VHIST_EDGES[None, :])), axis=1)
    return x[d > rel]


def test_vhist_counts_equal_numpy_reference():
    rng = np.random.default_rng(0)
    eps = 1e-5
    x = _away_from_edges(10.0 ** rng.uniform(-6, 8, 4000))
    v = ((x * eps) ** 2).astype(np.float32)
    got = np.asarray(vhist_counts(jnp.asarray(v), eps))
    np.testing.assert_array_equal(got, vhistogram(v.astype(np.float64), eps))
    assert got[0] > 0 and got[-1] > 0 and got.sum() == len(v)
    # zero, inf and NaN go where the reference puts them
    odd = np.array([0.0, np.inf, np.nan], np.float32)
    np.testing.assert_array_equal(np.asarray(vhist_counts(jnp.asarray(odd), eps)),
                                  vhistogram(odd, eps))


def test_step_vhists_bias_corrects_and_keeps_leaf_order():
    import optax
    nu = {"a": jnp.full((3,), 4e-6), "b": jnp.full((5,), 1e-12)}
    st = optax.ScaleByAdamState(count=jnp.asarray(10, jnp.int32), mu=nu, nu=nu)
    b2, eps = 0.95, 1e-3
    got = np.asarray(step_vhists(st, b2, eps))
    assert got.shape == (2, NUM_VHIST_BINS)
    for row, (v, n) in zip(got, ((4e-6, 3), (1e-12, 5))):
        x = np.sqrt(v / (1 - b2 ** 10)) / eps
        assert row[vhist_bins([x])[0]] == n and row.sum() == n


def test_mlp_run_writes_vhists(tmp_path):
    # (the tiny LLaMA trainer's vhists: tests/simulate/test_llama_train.py)
    from adamspike.train_config import OptimSection
    from simulate import mlp, runner

    spec = mlp.MLPSpec(kind="sin", seed=0)
    opt = OptimSection(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, grad_clip=0.0,
                       schedule="constant", warmup_steps=0)
    tr = mlp.train(spec, opt, 40, hist_every=20, progress=False)
    assert tr["vhists"].shape == (2, len(tr["names"]), NUM_VHIST_BINS)
    sq = jax.tree.map(np.asarray, tr["final_params"])
    assert all(tr["vhists"][1, k].sum() == np.size(sq[n]) for k, n in enumerate(tr["names"]))
    out = runner.write_run(tmp_path / "mlp", tr, config={}, problem={"kind": "mlp"},
                           progress=False)
    vh = load_run(out, tables=("vhists",)).vhists
    assert sorted(vh["step"].unique()) == [20, 40] and len(vh) == 2 * len(tr["names"])
    np.testing.assert_array_equal(vh.sort_values(["step", "name"])["g_below_eps"],
                                  tr["g_below_eps"].ravel())


def test_grad_below_eps_counts_the_consumed_gradient():
    from simulate.telemetry import grad_below_eps
    g = {"a": jnp.array([0.5, 2.0, -0.1, 3.0]), "b": jnp.array([[1e-3, -5.0]])}
    np.testing.assert_array_equal(np.asarray(grad_below_eps(g, 1.0)), [2, 1])
    # with the clip factor 0.1: |g| * 0.1 < 1 everywhere but none of b's -5 -> 0.5 < 1
    np.testing.assert_array_equal(np.asarray(grad_below_eps(g, 1.0, 0.1)), [4, 2])
