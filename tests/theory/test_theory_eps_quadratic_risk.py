"""eps regime, quadratic stability (eps*), the per-layer risk helper."""

import math

import numpy as np
import pytest

from theory import eps_regime as E
from theory import quadratic as Q
from theory.risk import layer_risk


def test_eps_regime_curve_and_limits(check_z):
    from simulate.streams import simulate_streams

    rho = [100.0, 10.0, 1.0, 0.1, 0.01]
    th = E.update_rms_curve(rho, 0.9, 0.95)
    # the reference numbers of the notes: 0.23, 0.11, 0.021, 0.002 at rho = 100, 1, 0.1, 0.01
    assert th[0] == pytest.approx(0.224, abs=1e-3) and th[2] == pytest.approx(0.113, abs=1e-3)
    assert th[3] == pytest.approx(0.0208, abs=2e-4) and th[4] == pytest.approx(0.00227, abs=2e-5)
    fl = E.frozen_limit(rho, 0.9)
    assert th[4] == pytest.approx(fl[4], rel=0.02)              # r ~ m/eps below rho = 0.01
    assert th[0] == pytest.approx(E.scale_invariant_limit(0.9, 0.95), rel=0.02)
    mc = simulate_streams([dict(b1=0.9, b2=0.95, eps=1.0 / r) for r in rho], steps=300,
                          n_coords=32768, seed=21)
    check_z([(f"rho={r}", th[i], mc["r_rms"][i], mc["r_rms_se"][i]) for i, r in enumerate(rho)])
    # correlated, high-SNR stream too
    th2 = E.update_rms(0.5, 0.8, 0.99, phi=0.5, snr=1.0, t=300)
    s = 1 / math.sqrt(2)
    mc2 = simulate_streams([dict(b1=0.8, b2=0.99, eps=2.0, phi=0.5, mu=s, sigma=s)], steps=300,
                           n_coords=32768, seed=22)
    check_z([("rho=0.5", th2, mc2["r_rms"][0], mc2["r_rms_se"][0])])


def test_regime_labels():
    assert [E.regime(r) for r in (0.05, 0.1, 1.0, 10.0, 10.5)] == [
        "frozen", "transition", "transition", "transition", "scale_invariant"]


def test_critical_eps_and_stability():
    es = Q.critical_eps(1e-2, 1.0, 0.9)
    assert es == pytest.approx(2.6316e-4, rel=1e-4)
    assert Q.stability_threshold(1e-2) == 200.0
    # eps >= eps*: stable for every v, including v = 0
    for v in (0.0, 1e-12, 1e-6, 1.0):
        assert not Q.is_unstable(1e-2, 1.0, 0.9, es * 1.0001, v)
    # eps < eps*: unstable exactly below v*
    vs = Q.critical_v(1e-2, 1.0, 0.9, 1e-8)
    assert Q.is_unstable(1e-2, 1.0, 0.9, 1e-8, vs * 0.99)
    assert not Q.is_unstable(1e-2, 1.0, 0.9, 1e-8, vs * 1.01)
    assert Q.preconditioned_curvature(1.0, 0.9, vs, 1e-8) == pytest.approx(200.0, rel=1e-9)
    assert Q.effective_lr(1e-2, 1e-4, 0.0) == pytest.approx(1.0)
    # early steps: the 1/(1-b1^t) factor raises lam_hat
    assert Q.preconditioned_curvature(1.0, 0.9, 1e-4, 0.0, t=1) == pytest.approx(
        10 * Q.preconditioned_curvature(1.0, 0.9, 1e-4, 0.0), rel=1e-12)
    assert Q.decay_steps_to_instability(1e-4, 1e-2, 1.0, 0.9, 0.999, 1e-8) == pytest.approx(
        math.log(vs / 1e-4) / math.log(0.999))
    assert Q.decay_steps_to_instability(1e-4, 1e-2, 1.0, 0.9, 0.999, 1e-3) == math.inf


def test_quadratic_adam_spikes_below_eps_star_only():
    """1-D quadratic, Adam (numpy) from theta=1 after convergence: v decays until lam_hat
    crosses 2/lr.  Measure max |theta| in the late phase for eps just below / above eps*."""
    lr, lam, b1, b2 = 1e-2, 1.0, 0.9, 0.99
    es = Q.critical_eps(lr, lam, b1)

    def run(eps, steps=20000):
        th, m, v, late = 1.0, 0.0, 0.0, 0.0
        for t in range(1, steps + 1):
            g = lam * th
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            th -= lr * (m / (1 - b1 ** t)) / (math.sqrt(v / (1 - b2 ** t)) + eps)
            if t > steps // 2:
                late = max(late, abs(th))
        return late

    assert run(0.5 * es) > 100 * run(2.0 * es)


def test_layer_risk():
    rows = layer_risk([0.05, 1.0, 100.0], [0.0, 0.5, 0.0], 0.9, 0.95, 1e-5, 1e-4, snr=[0.0, 0.3, 3.0],
                      lam=1.0, names=["embed", "mid", "head"])
    assert [r["regime"] for r in rows] == ["frozen", "transition", "scale_invariant"]
    assert rows[0]["frozen_risk"] and not rows[2]["frozen_risk"]
    assert rows[0]["update_rms"] < 0.02 < rows[1]["update_rms"]
    assert rows[2]["bimodal"] and not rows[0]["bimodal"]
    assert rows[2]["sat_frac"] > 0.5
    for r in rows:
        assert r["rms_t_bound"] == pytest.approx(1 / math.sqrt(0.05))
        assert r["eps_star"] == pytest.approx(Q.critical_eps(1e-4, 1.0, 0.9))
        assert r["bai_safe"] is True
    with pytest.raises(ValueError, match="^rho: length"):
        layer_risk([1.0, 2.0], [0.1, 0.2, 0.3], 0.9, 0.95, 1e-5, 1e-4)
