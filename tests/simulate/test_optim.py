"""simulate.optim: schedule, torch-formula clipping, AdamW (torch semantics), update clip."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from adamspike.train_config import OptimSection
from simulate import optim as O


def _section(**kw):
    base = dict(lr=1e-2, min_lr=1e-3, schedule="cosine", warmup_steps=3, b1=0.9, b2=0.95,
                eps=1e-8, weight_decay=0.1, grad_clip=1.0)
    base.update(kw)
    return OptimSection(**base)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_schedule_is_lr_at(schedule):
    opt = _section(schedule=schedule)
    n = 20
    sched = O.lr_schedule(opt, n)
    with jax.enable_x64(True):
        got = np.array([float(sched(jnp.asarray(c))) for c in range(n + 5)])
    want = np.array([opt.lr_at(c + 1, n) for c in range(n + 5)])
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)
    assert got[0] == pytest.approx(opt.lr / 3)
    assert got[n - 1] == pytest.approx(opt.lr if schedule == "constant" else opt.min_lr)


def test_schedule_rejects_zero_steps():
    with pytest.raises(ValueError, match="num_steps"):
        O.lr_schedule(_section(), 0)


def _numpy_adamw_torch(opt, num_steps, params, grads_seq, loss_scale=1.0):
    """torch.optim.AdamW + clip_grad_norm_, written out in numpy float64 (torch's order:
    p *= 1 - lr wd, then p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps))."""
    p = {k: v.copy() for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t, g in enumerate(grads_seq, start=1):
        norm = np.sqrt(sum((x ** 2).sum() for x in g.values()))
        coef = min(1.0, opt.grad_clip * loss_scale / (norm + 1e-6)) if opt.grad_clip > 0 else 1.0
        lr = opt.lr_at(t, num_steps)
        for k in p:
            gk = g[k] * coef
            m[k] = opt.b1 * m[k] + (1 - opt.b1) * gk
            v[k] = opt.b2 * v[k] + (1 - opt.b2) * gk ** 2
            p[k] *= 1 - lr * opt.weight_decay
            denom = np.sqrt(v[k]) / np.sqrt(1 - opt.b2 ** t) + opt.eps
            p[k] -= lr / (1 - opt.b1 ** t) * m[k] / denom
    return p


@pytest.mark.parametrize("loss_scale", [1.0, 8.0])
def test_adamw_matches_torch_formulas(loss_scale):
    rng = np.random.default_rng(0)
    params = {"a": rng.normal(size=(4, 3)), "b": rng.normal(size=(5,))}
    # big gradients (clipping active) then small ones (not clipped)
    grads_seq = [{k: rng.normal(size=x.shape) * s for k, x in params.items()}
                 for s in (3.0, 2.0, 0.1, 0.05, 1.5, 0.01)]
    opt = _section()
    n = len(grads_seq)
    want = _numpy_adamw_torch(opt, n, params, grads_seq, loss_scale)
    with jax.enable_x64(True):
        tx = O.adamw(opt, n, loss_scale=loss_scale)
        p = {k: jnp.asarray(v) for k, v in params.items()}
        state = tx.init(p)
        clipped = []
        for g in grads_seq:
            upd, state = tx.update({k: jnp.asarray(v) for k, v in g.items()}, state, p)
            p = optax.apply_updates(p, upd)
            clipped.append(bool(O.clip_info(state)[2]))
        for k in params:
            np.testing.assert_allclose(np.asarray(p[k]), want[k], rtol=1e-12, atol=1e-14)
    norms = [np.sqrt(sum((x ** 2).sum() for x in g.values())) for g in grads_seq]
    assert clipped == [nm > opt.grad_clip * loss_scale for nm in norms]


def test_clip_torch_formula_and_consumed_grads():
    with jax.enable_x64(True):
        g = {"w": jnp.array([3.0, 4.0])}  # norm 5
        tx = O.adamw(_section(grad_clip=1.0, weight_decay=0.0), 10)
        params = {"w": jnp.zeros(2)}
        state = tx.init(params)
        _, state = tx.update(g, state, params)
        norm, scale, clipped = O.clip_info(state)
        assert float(norm) == 5.0 and bool(clipped)
        assert float(scale) == 1.0 / (5.0 + 1e-6)  # torch: max_norm / (norm + 1e-6)
        consumed = O.consumed_grads(g, state)
        # Adam consumed exactly these: m_1 = (1 - b1) g_consumed
        np.testing.assert_array_equal(np.asarray(O.adam_state(state).mu["w"]),
                                      np.asarray((1 - 0.9) * consumed["w"]))
        # grad_clip = 0: norm still recorded, nothing scaled
        tx0 = O.adamw(_section(grad_clip=0.0), 10)
        _, s0 = tx0.update(g, tx0.init(params), params)
        n0, sc0, c0 = O.clip_info(s0)
        assert float(n0) == 5.0 and float(sc0) == 1.0 and not bool(c0)


def test_update_clip_divides_by_rms_t():
    """After a quiet stretch a loud gradient has rms_t >> 1: the update of that tensor is
    divided by rms_t, a quiet tensor (rms_t <= 1) is left alone."""
    b2, eps = 0.95, 1e-8
    with jax.enable_x64(True):
        adam = O.scale_by_adam_stable(0.9, b2, eps, update_clip=False)
        stable = O.scale_by_adam_stable(0.9, b2, eps, update_clip=True)
        params = {"loud": jnp.zeros(6), "quiet": jnp.zeros(6)}
        s_a, s_s = adam.init(params), stable.init(params)
        rng = np.random.default_rng(1)
        quiet = rng.normal(size=6) * 1e-3
        for t in range(30):  # the quiet tensor's gradient shrinks: g^2 < v_hat, rms_t < 1
            g = {"loud": jnp.asarray(rng.normal(size=6) * 1e-3),
                 "quiet": jnp.asarray(quiet * 0.98 ** t)}
            r_a, s_a = adam.update(g, s_a)
            r_s, s_s = stable.update(g, s_s)
        g = {"loud": jnp.asarray(rng.normal(size=6) * 10.0),
             "quiet": jnp.asarray(quiet * 0.98 ** 30)}
        r_a, s_a = adam.update(g, s_a)
        r_s, s_s = stable.update(g, s_s)
        st = O.adam_state(s_s)
        v_hat = {k: np.asarray(st.nu[k]) / (1 - b2 ** int(st.count)) for k in params}
        rms = {k: np.sqrt(np.mean(np.asarray(g[k]) ** 2 / np.maximum(v_hat[k], eps ** 2)))
               for k in params}
    assert rms["loud"] > 3.0 and rms["quiet"] < 1.0
    assert rms["loud"] <= 1 / np.sqrt(1 - b2) + 1e-9  # bound after a dormant stretch
    np.testing.assert_allclose(np.asarray(r_s["loud"]), np.asarray(r_a["loud"]) / rms["loud"],
                               rtol=1e-12)
    np.testing.assert_array_equal(np.asarray(r_s["quiet"]), np.asarray(r_a["quiet"]))


def test_state_lookup_errors():
    with pytest.raises(ValueError, match="ScaleByAdamState"):
        O.adam_state(optax.sgd(0.1).init({"w": jnp.zeros(2)}))
    with pytest.raises(ValueError, match="ClipState"):
        O.clip_info(optax.adam(0.1).init({"w": jnp.zeros(2)}))
    with pytest.raises(ValueError, match="loss_scale"):
        O.adamw(_section(), 10, loss_scale=0.0)


def _grads_and_run(tx, params, grads_seq):
    p = {k: jnp.asarray(v) for k, v in params.items()}
    state = tx.init(p)
    for g in grads_seq:
        upd, state = tx.update({k: jnp.asarray(v) for k, v in g.items()}, state, p)
        p = optax.apply_updates(p, upd)
    return p, state


@pytest.mark.parametrize("group_eps", [False, True])
def test_bias_correction_offset_1_is_the_seed_stacks_npu_adamw(group_eps):
    """optim.bias_correction_offset = 1 equals AscendSpeed 2023's AdamW (npu_apply_adam_w
    handed beta**t, tests/npu_adamw_reference.py) in float64, clipping and weight decay on,
    with one eps for all tensors and with one per tensor (the per-leaf path); offset 0 (the
    default, torch) differs from it by far more than the tolerance."""
    from tests.npu_adamw_reference import ascendspeed_adamw

    rng = np.random.default_rng(2)
    params = {"a": rng.normal(size=(4, 3)), "b": rng.normal(size=(5,))}
    grads_seq = [{k: rng.normal(size=x.shape) * s for k, x in params.items()}
                 for s in (3.0, 2.0, 0.1, 1e-3, 1.5, 0.01, 0.5, 2e-4)]
    n = len(grads_seq)
    opt = _section(eps=1e-3, bias_correction_offset=1)   # eps near |g|: its placement matters
    eps = {"a": 1e-3, "b": 3e-2} if group_eps else opt.eps
    want = ascendspeed_adamw([params["a"], params["b"]], [[g["a"], g["b"]] for g in grads_seq],
                             [opt.lr_at(t, n) for t in range(1, n + 1)], opt.b1, opt.b2,
                             [eps["a"], eps["b"]] if group_eps else eps, opt.weight_decay,
                             opt.grad_clip)
    with jax.enable_x64(True):
        def chain(offset):
            return O.adamw_chain(opt.b1, opt.b2, eps, O.lr_schedule(opt, n), opt.grad_clip,
                                 opt.weight_decay, bias_correction_offset=offset)
        p, state = _grads_and_run(chain(1), params, grads_seq)
        torch_p, _ = _grads_and_run(chain(0), params, grads_seq)
        if not group_eps:   # the config route builds the same chain
            p_cfg, _ = _grads_and_run(O.adamw(opt, n), params, grads_seq)
            np.testing.assert_array_equal(np.asarray(p_cfg["a"]), np.asarray(p["a"]))
    assert int(O.adam_state(state).count) == n + 1
    for k, w in zip("ab", want):
        np.testing.assert_allclose(np.asarray(p[k]), w, rtol=1e-12, atol=1e-14)
        assert np.abs(np.asarray(torch_p[k]) - w).max() > 1e-4 * np.abs(w).max()
