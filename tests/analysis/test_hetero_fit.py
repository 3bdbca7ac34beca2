"""The heterogeneous update_rms prediction (analysis.fits) against a Monte-Carlo of Adam
on coordinates with a known spread of rho, and the band table on a run directory."""

import math

import numpy as np
import pytest

from adamspike.metrics import NUM_VHIST_BINS, vhistogram
from analysis.fits import ExactUpdateRms, UpdateRmsModel, heterogeneous_update_rms

B1, B2, EPS = 0.9, 0.9, 1.0
STEPS, COORDS, REPS = 120, 4000, 8


def _adam_mc(seed=0):
    """Adam state after STEPS steps of i.i.d. N(0, s_i^2) gradients, s_i / eps log-uniform
    over 10^-1.5 .. 10^1.5 (rho from 0.03 to 30: frozen, transition and scale-invariant
    coordinates in one tensor). Returns per replica: measured update_rms, vhist counts."""
    rng = np.random.default_rng(seed)
    s = EPS * 10.0 ** rng.uniform(-1.5, 1.5, (REPS, COORDS))
    m = np.zeros_like(s)
    v = np.zeros_like(s)
    for t in range(1, STEPS + 1):
        g = s * rng.standard_normal(s.shape)
        m = B1 * m + (1 - B1) * g
        v = B2 * v + (1 - B2) * g * g
    m_hat, v_hat = m / (1 - B1 ** STEPS), v / (1 - B2 ** STEPS)
    r = m_hat / (np.sqrt(v_hat) + EPS)
    meas = np.sqrt(np.mean(r * r, axis=1))
    counts = np.stack([vhistogram(v_hat[k], EPS) for k in range(REPS)])
    return meas, counts, s


def test_heterogeneous_prediction_matches_monte_carlo_within_its_se():
    meas, counts, s = _adam_mc()
    assert counts.shape == (REPS, NUM_VHIST_BINS)
    model = ExactUpdateRms(B1, B2, (0.0, 0.0))
    pred = heterogeneous_update_rms(counts, np.zeros(REPS), model)
    mean, se = meas.mean(), meas.std(ddof=1) / math.sqrt(REPS)
    # stated tolerance: 3 SE of the Monte-Carlo mean + 1 % for the bin-centre quadrature
    # (8 bins per decade) and the 0.25-decade interpolation of the exact table
    assert abs(pred.mean() - mean) < 3 * se + 0.01 * mean, (pred.mean(), mean, se)
    # the per-tensor (homogeneous) model at the tensor's rms rho misses by far more
    rho_tensor = np.sqrt(np.mean(s ** 2, axis=1)) / EPS
    homog = UpdateRmsModel(B1, B2)(rho_tensor, np.zeros(REPS))
    assert abs(homog.mean() - mean) > 10 * se + 0.05 * mean, (homog.mean(), mean)


def test_exact_model_limits():
    ex = ExactUpdateRms(B1, 0.95, (0.0, 0.1))
    # frozen: linear in rho with slope sqrt((1-b1)/(1+b1)); scale-invariant: flat
    c = math.sqrt((1 - B1) / (1 + B1))
    assert float(ex(1e-4, 0.0)) == pytest.approx(1e-4 * c, rel=0.02)
    assert float(ex(1e5, 0.0)) == pytest.approx(float(ex(1e4, 0.0)), rel=1e-12)
    assert float(ex(1e5, 0.0)) == pytest.approx(float(ex(1e3, 0.0)), rel=2e-3)
    # b2 > 0.99: the deterministic-v limit
    dv = ExactUpdateRms(B1, 0.999)
    assert dv.method == "deterministic-v limit"
    assert float(dv(100.0, 0.0)) == pytest.approx(c * 100 / 101)
