"""The Poisson GLM of adamspike.spike_rate on synthetic counts with known coefficients."""

import numpy as np
import pandas as pd
import pytest

from adamspike import spike_rate as SR


def _synthetic(n=400, seed=0, beta=(0.3, 0.8, -1.2)):
    rng = np.random.default_rng(seed)
    x1 = rng.uniform(-2, 2, n)          # e.g. log10 rho
    x2 = rng.uniform(-3, -1, n)         # e.g. log10 (1 - b2)
    steps = rng.integers(500, 5000, n).astype(float)
    rate = np.exp(beta[0] + beta[1] * x1 + beta[2] * (x2 + 2))
    k = rng.poisson(rate * steps / 1000)
    return pd.DataFrame({"source": "synthetic", "run": [f"r{i}" for i in range(n)],
                         "width": np.where(np.arange(n) % 4 == 0, 64.0, 32.0),
                         "seed": np.arange(n) % 3, "num_spikes": k.astype(float),
                         "num_steps": steps, "log10_rho_shallow": x1, "log10_rho_deep": np.nan,
                         "log10_one_minus_b2": x2, "log10_lr_over_eps": np.nan,
                         "log10_tokens_per_step": np.nan})


def test_glm_recovers_known_coefficients_within_its_interval():
    beta = (0.3, 0.8, -1.2)
    t = _synthetic(beta=beta)
    m = SR.fit(t, n_boot=100, seed=1)
    assert m.features == ["log10_rho_shallow", "log10_one_minus_b2"]
    c = m.coefficients()
    truth = {"intercept": beta[0] + 2 * beta[2], "log10_rho_shallow": beta[1],
             "log10_one_minus_b2": beta[2]}
    for name, v in truth.items():
        lo, hi = c[name]["ci"]
        assert lo <= v <= hi, (name, v, c[name])
        blo, bhi = c[name]["boot_ci"]
        assert blo <= v <= bhi, (name, v, c[name])
        assert c[name]["se"] < 0.1
    # Poisson data: the dispersion is about 1
    assert 0.7 < m.dispersion < 1.3
    # the 90 % rate interval at a new point covers the true rate in about 90 % of data sets
    covered = 0
    for s in range(20):
        iv = SR.fit(_synthetic(n=200, seed=100 + s, beta=beta), n_boot=0).rate_interval(
            np.array([[0.0, -2.0]]))
        covered += bool(iv["lo"][0] <= np.exp(beta[0]) <= iv["hi"][0])
    assert covered >= 15


def test_model_round_trips_through_json_and_flags_extrapolation():
    m = SR.fit(_synthetic(n=120, seed=3), n_boot=20)
    m2 = SR.model_from_json(m.to_json())
    X = np.array([[0.1, -2.0], [5.0, -0.5]])
    np.testing.assert_allclose(m2.rate(X), m.rate(X))
    assert m2.extrapolation({"log10_rho_shallow": 5.0, "log10_one_minus_b2": -2.0}) == \
        {"log10_rho_shallow": "above", "log10_one_minus_b2": "inside"}
    with pytest.raises(SR.SpikeRateError, match="version"):
        SR.model_from_json({**m.to_json(), "version": 99})


def test_heldout_validation_beats_the_constant_rate_on_informative_data():
    t = _synthetic(n=300, seed=5)
    v = SR.validate(t, n_boot=20)
    assert "width 64" in v["split"]
    assert v["n_heldout"] == 75
    assert v["model"]["log_loss"] < v["baseline"]["log_loss"]
    assert v["model"]["brier"] < v["baseline"]["brier"]
    cal = v["calibration"]
    assert cal["n_runs"].sum() == 75
    big = cal[cal["n_runs"] >= 10]     # bins with enough runs to judge calibration
    assert len(big) and np.all(np.abs(big["mean_predicted"] - big["observed_fraction"]) < 0.25)


def test_zero_spike_data_still_scores_and_says_so():
    t = _synthetic(n=60, seed=2)
    t["num_spikes"] = 0.0
    v = SR.validate(t, n_boot=10)
    assert v["all_heldout_zero"] and v["heldout_spikes"] == 0
    assert np.isfinite(v["model"]["log_loss"]) and np.isfinite(v["baseline"]["brier"])


def test_p_spike_and_poisson_scores():
    assert SR.p_spike(1.0, 1000) == pytest.approx(1 - np.exp(-1))
    s = SR.scores(np.array([0.5, 0.5]), np.array([1, 0]))
    assert s["brier"] == pytest.approx(0.25) and s["log_loss"] == pytest.approx(np.log(2))
