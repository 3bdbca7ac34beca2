"""Bimodality of r across coordinates and second-moment transients vs the JAX Monte-Carlo."""

import math

import numpy as np
import pytest

from theory import adam_moments as A
from theory import transients as T
from theory.bimodality import r_bimodality


def _kappa_v(b2, mu, phi, t):
    vm = A.v_moments(b2, 1.0, mu, phi, t, bias_correct=True)
    return vm["var"] / vm["mean"] ** 2


# (b1, b2, phi, snr): inside the stated region (kappa_v <= 0.03) and two outside
INSIDE = [(0.8, 0.99, 0.0, 1.0), (0.9, 0.99, 0.5, 0.3), (0.95, 0.99, 0.0, 3.0), (0.9, 0.999, 0.9, 1.0),
          (0.8, 0.999, 0.5, 3.0), (0.95, 0.999, 0.9, 0.3), (0.9, 0.999, 0.0, 0.3), (0.95, 0.99, 0.5, 1.0)]
OUTSIDE = [(0.9, 0.95, 0.0, 1.0), (0.9, 0.95, 0.9, 1.0)]


def test_r_bimodality_second_order_vs_mc():
    """Stated accuracy of theory.bimodality.r_bimodality (second_order): where
    kappa_v = Var v_hat/(E v_hat)^2 <= 0.03, |BC - BC_mc| <= 0.03 and |sat - sat_mc| <= 0.03
    (v's fluctuation enters BC through E r^4, at second order only).  Outside, BC is
    underestimated: b2 = 0.95 (kappa_v ~ 0.05-0.4): by 0.04 at phi = 0 and by ~0.5 at phi = 0.9
    (the MC is *more* bimodal: v's own noise spreads r toward +-1)."""
    from simulate.streams import simulate_streams

    t = 1000
    cfgs = INSIDE + OUTSIDE
    mc = simulate_streams([dict(b1=a, b2=b, phi=p, mu=s, sigma=1.0, eps=1e-3) for a, b, p, s in cfgs],
                          steps=t, n_coords=8192, mu_sign="random", seed=11)
    for i, (b1, b2, phi, snr) in enumerate(cfgs):
        kv = _kappa_v(b2, snr, phi, t)
        th = r_bimodality(b1, b2, 1e-3, snr, phi, t=t)
        dbc = abs(th["bc"] - mc["bc"][i])
        dsat = abs(th["sat_frac"] - mc["sat_frac"][i])
        slack = 3 * max(mc["bc_se"][i], mc["sat_frac_se"][i])
        if (b1, b2, phi, snr) in INSIDE:
            assert kv <= 0.03, (b1, b2, phi, snr, kv)
            assert dbc <= 0.03 + slack, (b1, b2, phi, snr, th["bc"], mc["bc"][i])
            assert dsat <= 0.03 + slack, (b1, b2, phi, snr, th["sat_frac"], mc["sat_frac"][i])
        else:
            assert kv > 0.03
            assert th["bc"] < mc["bc"][i] - 0.03      # the documented failure direction


def test_bc_crosses_5_9_between_snr_03_and_1():
    lo = r_bimodality(0.9, 0.999, 0.0, 0.3)["bc"]
    hi = r_bimodality(0.9, 0.999, 0.0, 1.0)["bc"]
    assert lo < 5 / 9 < hi


def test_constant_gradient_peaks():
    assert T.constant_after_dormancy_peak(0.9, 0.999) == (12, pytest.approx(6.57, abs=5e-3))
    assert T.constant_after_dormancy_peak(0.9, 0.99) == (13, pytest.approx(2.13, abs=5e-3))
    assert T.constant_after_dormancy_peak(0.9, 0.95) == (20, pytest.approx(1.10, abs=5e-3))
    for b2, bound in ((0.999, 31.62), (0.99, 10.0), (0.95, 4.472)):
        assert T.dormant_rms_t_bound(b2) == pytest.approx(bound, abs=1e-2)


def test_rms_t_bound_approached_for_dormant_v():
    for b2 in (0.95, 0.99):
        o = T.step_up(0.9, b2, 1e4, steps=2)
        assert o["rms_t"][0] < o["bound"]
        assert o["rms_t"][0] == pytest.approx(o["bound"], rel=2e-3)
        assert o["peak_step"] == 1


def test_step_up_transient_vs_mc(check_z):
    """rms_t, rms r, E|r| for k = 1..20 loud steps after 800 quiet ones (exact theory with
    the finite quiet stretch and bias correction), z-score family check."""
    from simulate.streams import simulate_streams

    quiet, steps = 800, 20
    cfgs = [(0.9, 0.95, 10.0, 0.0), (0.9, 0.99, 3.0, 0.0), (0.9, 0.999, 10.0, 0.0),
            (0.8, 0.95, 3.0, 0.5), (0.95, 0.99, 10.0, -0.5)]
    total = quiet + steps
    sig = np.ones((len(cfgs), total))
    for i, c in enumerate(cfgs):
        sig[i, quiet:] = c[2]
    mc = simulate_streams([dict(b1=a, b2=b, phi=p, eps=1e-8) for a, b, _, p in cfgs], steps=total,
                          n_coords=16384, record="all", sigma_t=sig, seed=12)
    rows = []
    for i, (b1, b2, kappa, phi) in enumerate(cfgs):
        th = T.step_up(b1, b2, kappa, steps, phi=phi, eps=1e-8, quiet=quiet)
        for k in range(steps):
            j = quiet + k
            for key in ("rms_t", "r_rms", "r_abs"):
                rows.append((f"{key} k={k + 1} {cfgs[i]}", th[key][k], mc[key][i, j], mc[key + "_se"][i, j]))
    check_z(rows, "step-up transients")
