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


def _irls_every_iteration(Z, k, offset, ridge, max_iter=100, tol=1e-10):
    """poisson_irls as first written: every one of max_iter Newton iterations, no shortcut."""
    import math
    p = Z.shape[1]
    pen = np.full(p, float(ridge))
    pen[0] = 0.0
    beta = np.zeros(p)
    beta[0] = math.log(max(k.sum(), 0.5) / np.exp(offset).sum())

    def loglik(b):
        eta = offset + Z @ b
        return float(k @ eta - np.exp(np.minimum(eta, 700)).sum() - 0.5 * (pen * b * b).sum())

    ll = loglik(beta)
    for _ in range(max_iter):
        mu = np.exp(np.minimum(offset + Z @ beta, 700))
        grad = Z.T @ (k - mu) - pen * beta
        H = (Z * mu[:, None]).T @ Z + np.diag(pen)
        H[np.diag_indices(p)] += 1e-12
        step = np.linalg.solve(H, grad)
        t = 1.0
        while t > 1e-8:
            new = beta + t * step
            new_ll = loglik(new)
            if new_ll >= ll - 1e-12:
                break
            t /= 2
        done = abs(new_ll - ll) < tol * (1 + abs(ll)) and np.max(np.abs(t * step)) < 1e-8
        beta, ll = new, new_ll
        if done:
            break
    mu = np.exp(np.minimum(offset + Z @ beta, 700))
    return beta, (Z * mu[:, None]).T @ Z + np.diag(pen)


def test_irls_stops_at_a_repeat_with_the_bits_of_every_iteration(monkeypatch):
    """A fit whose iterates repeat (a fixed point or a rounding cycle short of the tolerance:
    the cell bootstrap's refits ran all 100 iterations) ends on the same bits as the full loop:
    informative, zero-count, separable and NaN designs."""
    rng = np.random.default_rng(3)
    cases = []
    for n, p in ((40, 3), (100, 4), (12, 2)):
        X = rng.standard_normal((n, p - 1))
        Z = np.column_stack([np.ones(n), X])
        off = np.log(rng.uniform(0.5, 2.0, n))
        cases.append((Z, rng.poisson(np.exp(off + X @ rng.normal(0, 0.7, p - 1))).astype(float), off))
        cases.append((Z, np.zeros(n), off))                          # no event at all
        sep = (X[:, 0] > 0).astype(float) * rng.integers(1, 4, n)     # events on one side only
        cases.append((Z, sep, off))
    Zn = cases[0][0].copy()
    Zn[3, 1] = np.nan                                                 # a NaN in the design
    cases.append((Zn, cases[0][1], cases[0][2]))
    solve, solves = np.linalg.solve, []
    monkeypatch.setattr(np.linalg, "solve", lambda *a: solves.append(1) or solve(*a))
    shortened = 0
    for Z, k, off in cases:
        for max_iter in (100, 7):
            solves.clear()
            b0, H0 = _irls_every_iteration(Z, k, off, 0.1, max_iter=max_iter)
            full = len(solves)
            solves.clear()
            b, H = SR.poisson_irls(Z, k, off, 0.1, max_iter=max_iter)
            assert b.tobytes() == b0.tobytes() and H.tobytes() == H0.tobytes()
            shortened += full == max_iter == 100 and len(solves) < 50
    assert shortened >= 1        # a fit the full loop ran to its end is cut short, same bits
