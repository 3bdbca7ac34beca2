"""simulate.curvature: power iteration with HVPs finds the top eigenvalue of each group's
Hessian block, raw and with Bai et al.'s preconditioner, on a quadratic with known Hessian."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from simulate.curvature import make_curvature_fn


def test_quadratic_known_hessian():
    rng = np.random.default_rng(0)
    shapes = {"a": (3,), "b": (2, 2), "c": (4,)}
    groups = {"a": "embed", "b": "shallow", "c": "shallow"}   # "deep" and "head" have none
    n = sum(int(np.prod(s)) for s in shapes.values())
    Q = np.linalg.qr(rng.standard_normal((n, n)))[0]
    A = Q @ np.diag(np.geomspace(0.1, 20.0, n)) @ Q.T        # SPD, with cross-group terms
    A = (A + A.T) / 2
    Aj = jnp.asarray(A, jnp.float32)

    def flat(p):
        return jnp.concatenate([p[k].reshape(-1) for k in shapes])

    def loss(p, batch):
        x = flat(p) - batch
        return 0.5 * x @ Aj @ x

    params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
    nu = {k: jnp.asarray(rng.uniform(1e-6, 1e-2, s), jnp.float32) for k, s in shapes.items()}
    b1, b2, eps, count = 0.9, 0.95, 1e-3, 7
    fn = make_curvature_fn(loss, groups, ["embed", "shallow", "deep", "head"], num_iters=200)
    raw, pre = fn(params, jnp.zeros(n), nu, jnp.asarray(count), b1, b2, eps, jax.random.PRNGKey(0))

    sizes = [int(np.prod(shapes[k])) for k in shapes]
    starts = np.cumsum([0] + sizes)
    idx = {"embed": np.arange(starts[0], starts[1]),
           "shallow": np.arange(starts[1], starts[3])}
    v = np.concatenate([np.asarray(nu[k]).reshape(-1) for k in shapes])
    c = (1 - b1) / (1 + b1) / (1 - b1 ** count)
    s = c / (np.sqrt(v / (1 - b2 ** count)) + eps)
    for k, g in enumerate(["embed", "shallow"]):
        i = idx[g]
        Hg = A[np.ix_(i, i)]
        want_raw = np.linalg.eigvalsh(Hg).max()
        S = np.diag(np.sqrt(s[i]))
        want_pre = np.linalg.eigvalsh(S @ Hg @ S).max()
        assert float(raw[k]) == pytest.approx(want_raw, rel=1e-3)
        assert float(pre[k]) == pytest.approx(want_pre, rel=1e-3)
        # the full Hessian's top eigenvalue (20) is not what a block reports
        assert want_raw < 20.0 * 0.999
    assert float(raw[2]) == 0.0 and float(pre[3]) == 0.0      # empty groups


def test_bad_iters():
    with pytest.raises(ValueError, match="num_iters"):
        make_curvature_fn(lambda p, b: 0.0, {}, ["embed"], num_iters=0)


def test_trainer_writes_curvature_table(tmp_path):
    from adamspike.config import load_config
    from adamspike.rundir import CURVATURE_COLUMNS, load_run
    from adamspike.train_config import RunConfig
    from simulate.llama_train import train

    cfg = load_config(RunConfig, None, [
        "--model.preset", "tiny", "--model.dim", "16", "--model.num_heads", "2",
        "--model.num_kv_heads", "1", "--model.vocab_size", "16", "--train.num_steps", "6",
        "--train.global_batch_size", "2", "--train.seq_len", "8", "--telemetry.every", "3",
        "--telemetry.hist_every", "0", "--telemetry.curvature_every", "3",
        "--telemetry.curvature_iters", "5"])
    run = load_run(train(cfg, tmp_path / "run", progress=False), tables=("curvature",))
    cur = run.curvature
    assert list(cur.columns) == list(CURVATURE_COLUMNS)
    assert sorted(cur["step"].unique()) == [3, 6]
    assert set(cur["group"].astype(str)) == {"embed", "shallow", "deep", "head"}
    assert np.all(np.isfinite(cur["precond_curvature"])) and np.all(cur["raw_curvature"] != 0)
    assert np.allclose(cur["lr"], [cfg.optim.lr_at(int(s), 6) for s in cur["step"]])
