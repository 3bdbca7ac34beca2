"""simulate.quadratic: Bai et al.'s eps* boundary, b2 effect, numerics, N-D directions."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from simulate.quadratic import QuadraticSpec, count_spikes, run_quadratic, simulate_quadratic
from adamspike.metrics import SUM_FIELDS
from theory.quadratic import critical_eps as eps_star  # eps* = lr lam (1-b1) / (2 (1+b1))
from theory.quadratic import decay_steps_to_instability

LR, B1 = 1e-2, 0.9


def test_spikes_below_eps_star_and_none_above():
    """1-D, lam = 1, theta0 = 1, lr = 1e-2, b = (0.9, 0.999), 3e4 steps: eps* from the
    formula; spikes at 0.5 eps* and 0.95 eps*, none at 1.05 eps* and 2 eps*."""
    es = eps_star(LR, 1.0, B1)
    factors = (0.5, 0.95, 1.05, 2.0)
    spec = QuadraticSpec(num_steps=30_000)
    out = run_quadratic([{"lr": LR, "b1": B1, "b2": 0.999, "eps": f * es} for f in factors], spec)
    counts = []
    for i, f in enumerate(factors):
        sp = count_spikes(out["log10_loss"][i])
        counts.append(len(sp))
        lam_grad, thr = out["lam_hat_grad"][i], out["threshold"][i]
        if f < 1:
            # Bai's predictor: curvature along the gradient above 2/lr just before each spike
            for s in sp.start:
                assert (lam_grad[max(0, s - 200):s] > thr).any(), (f, s)
            # onset time = theory's pure-decay time from v_hat at step 3000 (within 1%)
            v0 = out["sums"][i][3000 - 1, SUM_FIELDS.index("v_hat")]
            predicted = 3000 + decay_steps_to_instability(v0, LR, 1.0, B1, 0.999, f * es)
            first = np.flatnonzero(lam_grad > thr)[0] + 1
            assert abs(first - predicted) < 0.01 * predicted, (f, first, predicted)
        else:
            assert (lam_grad[5000:] <= thr * (1 + 1e-9)).all(), f
            assert out["log10_loss"][i][-1] < -1000  # converged for good
    assert counts[0] >= 5 and counts[1] >= 1 and counts[2] == 0 and counts[3] == 0, counts


def test_lower_b2_shrinks_spikes():
    spec = QuadraticSpec(num_steps=20_000, record_sums=False)
    out = run_quadratic([{"eps": 1e-8, "b2": 0.999}, {"eps": 1e-8, "b2": 0.95}], spec)
    peaks = [count_spikes(out["log10_loss"][i])["peak"].max() for i in range(2)]
    assert peaks[1] < peaks[0] - 1.0, peaks  # at least 10x lower peak loss


def test_rescaled_equals_plain_float64_and_optax():
    """Before anything underflows the rescaled iteration is the plain one (power-of-2 shifts
    are exact), and the plain one is optax.scale_by_adam."""
    n = 1500
    hp = {"eps": 1e-6, "b2": 0.99, "lr": 3e-2}
    a = run_quadratic(hp, QuadraticSpec(num_steps=n, rescale=True, dim=3, lam_min=0.1))
    b = run_quadratic(hp, QuadraticSpec(num_steps=n, rescale=False, dim=3, lam_min=0.1))
    assert np.isfinite(a["log10_loss"]).all() and a["log10_loss"][-1] < -10
    np.testing.assert_allclose(a["log10_loss"], b["log10_loss"], rtol=1e-9)
    np.testing.assert_allclose(a["sums"], b["sums"], rtol=1e-9, atol=0)
    lams = QuadraticSpec(dim=3, lam_min=0.1).lams()
    with jax.enable_x64(True):
        adam = optax.scale_by_adam(0.9, 0.99, 1e-6)

        def body(c, _):
            th, st = c
            r, st = adam.update(lams * th, st)
            th = th - 3e-2 * r
            return (th, st), 0.5 * jnp.sum(lams * th * th)

        th0 = jnp.ones(3)
        _, loss = jax.lax.scan(body, (th0, adam.init(th0)), None, length=n)
    np.testing.assert_allclose(b["loss"], np.asarray(loss), rtol=1e-9)


@pytest.mark.parametrize("rotate", [False, True])
def test_nd_spikes_along_the_stiff_direction(rotate):
    """eps between eps*(lam_2) and eps*(lam_1): only the lam_max eigen-direction
    destabilises; at every spike peak it carries the loss (also in a rotated basis)."""
    spec = QuadraticSpec(num_steps=30_000, dim=8, lam_min=0.01, lam_max=1.0, record_coords=True,
                         record_sums=False, rotate=rotate)
    lams = spec.lams()
    eps = 0.5 * (eps_star(LR, lams[0], B1) + eps_star(LR, lams[1], B1))
    out = run_quadratic({"eps": eps}, spec)
    sp = count_spikes(out["log10_loss"])
    assert len(sp) >= 3
    z = out["log10_abs_eig" if rotate else "log10_abs_theta"]
    contrib = 2 * z + np.log10(lams)  # log10(lam_i z_i^2), z: eigen-coordinates
    dominant = [int(np.argmax(contrib[p - 1])) for p in sp.peak_step]
    assert dominant == [0] * len(sp)
    if rotate:
        return
    # the preconditioned curvature of the stiff direction passes 2/lr, the others never do
    assert (out["lam_hat_diag"][:, 0] > out["threshold"]).any()
    assert (out["lam_hat_diag"][5000:, 1:] < out["threshold"]).all()


def test_bad_inputs():
    with pytest.raises(ValueError, match="lr_typo"):
        run_quadratic({"lr_typo": 1.0}, QuadraticSpec(num_steps=10))
    with pytest.raises(ValueError, match="num_steps"):
        QuadraticSpec(num_steps=0)
    with pytest.raises(ValueError, match="lam_max"):
        QuadraticSpec(dim=1, lam_min=0.1, lam_max=1.0)
    with pytest.raises(ValueError, match="dtype"):
        QuadraticSpec(dtype="float16")
    with jax.enable_x64(False):
        with pytest.raises(RuntimeError, match="x64"):
            simulate_quadratic({}, QuadraticSpec(num_steps=10))
