"""Fits to theory recover parameters of traces generated from theory."""

import math

import numpy as np
import pandas as pd
import pytest

from adamspike.rundir import load_run
from analysis.fits import (UpdateRmsModel, check_rms_t, find_step_ups,
                           fit_update_rms, phi_from_cos, spike_regimes, transient_curve)
from analysis.spikes import detect_spikes
from theory.adam_moments import grad_mom_cos
from theory.eps_regime import update_rms


def test_phi_inversion_round_trip():
    phis = np.array([-0.5, 0.0, 0.2, 0.45, 0.8])
    cos = [grad_mom_cos(0.9, phi=float(p)) for p in phis]
    np.testing.assert_allclose(phi_from_cos(cos, 0.9), phis, atol=2e-3)


def test_tabulated_model_matches_exact_theory():
    model = UpdateRmsModel(0.9, 0.95)
    for rho, phi in ((0.003, 0.0), (0.5, 0.1), (3.0, 0.3), (1e3, 0.2)):
        exact = update_rms(rho, 0.9, 0.95, phi)
        assert model(rho, phi) == pytest.approx(exact, rel=0.02)


def _layers_from_theory(eps_scale, seed=0, n=3000, b1=0.9, b2=0.95, noise=0.05):
    rng = np.random.default_rng(seed)
    rho = 10 ** rng.uniform(-2, 2, n)
    phi = rng.uniform(0.0, 0.5, n)
    cos = np.interp(phi, np.linspace(-0.99, 0.99, 397),
                    [grad_mom_cos(b1, phi=float(p)) for p in np.linspace(-0.99, 0.99, 397)])
    u = UpdateRmsModel(b1, b2)(rho * eps_scale, phi) * np.exp(noise * rng.standard_normal(n))
    return pd.DataFrame({"step": np.arange(n) + 100, "name": [f"t{i % 50}" for i in range(n)],
                         "depth": rng.integers(-1, 10, n), "rho": rho, "update_rms": u,
                         "grad_mom_cos": cos + 0.003 * rng.standard_normal(n)})


@pytest.mark.parametrize("eps_scale", [1.0, 3.0, 0.2])
def test_update_rms_fit_recovers_eps_scale(eps_scale):
    fit = fit_update_rms(_layers_from_theory(eps_scale), 0.9, 0.95)
    assert fit.eps_scale == pytest.approx(eps_scale, rel=0.03)
    assert fit.r2_log_fitted > 0.98
    if eps_scale != 1.0:
        assert fit.r2_log < fit.r2_log_fitted
    assert set(fit.by_group["regime"]) == {"frozen", "transition", "scale_invariant"}


def test_eps_scale_not_identifiable_when_all_scale_invariant():
    df = _layers_from_theory(1.0)
    df = df[df["rho"] > 20]
    fit = fit_update_rms(df, 0.9, 0.95)
    assert not fit.eps_scale_identifiable and fit.frac_eps_sensitive == 0.0
    assert fit.r2_log > 0  # the no-parameter prediction still holds there


def test_update_rms_fit_on_synthetic_run(synthetic_run):
    run = load_run(synthetic_run)
    fit = fit_update_rms(run.layers, 0.9, 0.95)
    assert fit.eps_scale == pytest.approx(1.0, rel=0.05) and fit.r2_log > 0.9
    with pytest.raises(ValueError, match="lacks column"):
        fit_update_rms(run.layers.drop(columns=["grad_mom_cos"]), 0.9, 0.95)


def test_deterministic_v_limit_for_large_b2():
    model = UpdateRmsModel(0.9, 0.999)
    assert model.method == "deterministic-v limit"
    assert model(100.0, 0.3) == pytest.approx(0.29926, rel=0.005)  # exact theory value


def test_step_up_detection_and_bound_check():
    steps = np.arange(1, 61)
    gr = np.where(steps < 40, 1e-3, 5e-3) * (1 + 0.01 * np.sin(steps))
    curve = transient_curve(0.9, 0.95, 5.0, 21)
    rt = np.ones(60)
    rt[39:60] = curve[:21]
    rt[5] = 7.0  # above 1/sqrt(1-0.95) = 4.47: impossible for a well-formed v_hat
    layers = pd.DataFrame({"step": steps, "name": "w", "depth": 0, "grad_rms": gr, "rms_t": rt})
    ev = find_step_ups(layers)
    assert list(ev["onset"]) == [40] and ev["kappa"].iloc[0] == pytest.approx(5.0, rel=0.02)
    chk = check_rms_t(layers, 0.9, 0.95)
    assert chk.bound == pytest.approx(1 / math.sqrt(0.05))
    assert chk.frac_above_bound == pytest.approx(1 / 60) and chk.max_over_bound > 1.5
    assert chk.transient_r2 > 0.99


def test_regime_per_spike(synthetic_run):
    run = load_run(synthetic_run)
    spikes = detect_spikes(run.steps["loss"], run.steps["step"])
    cfg = dict(run.config)
    reg = spike_regimes(run.layers, spikes, cfg).set_index(["spike_id", "group"])
    assert reg.loc[(0, "shallow"), "regime"] == "transition"   # rho ~ 0.3, ramping up
    assert reg.loc[(0, "deep"), "regime"] == "scale_invariant"  # rho ~ 20
    assert reg["eps_star"].isna().all()
    cfg["problem"] = {"lam_max": 1.0}
    reg = spike_regimes(run.layers, spikes, cfg)
    # eps* = lr lam (1-b1) / (2 (1+b1)) = 1e-3 * 0.1 / 3.8
    assert reg["eps_star"].iloc[0] == pytest.approx(1e-3 * 0.1 / 3.8)
    assert not reg["eps_above_eps_star"].iloc[0]  # eps = 1e-5 < 2.6e-5
