"""Galton boards: normalisation, closed-form moments, direct simulation, U-shape threshold."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from theory import bimodality as B
from theory import galton as Gt


def chi2_pvalue(counts, pmf, min_expected=5.0):
    """Pearson chi-square, bins with expected < min_expected pooled."""
    n = counts.sum()
    exp = pmf * n
    order = np.argsort(exp)
    obs_b, exp_b, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order:
        acc_o += counts[i]
        acc_e += exp[i]
        if acc_e >= min_expected:
            obs_b.append(acc_o)
            exp_b.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:
        obs_b[-1] += acc_o
        exp_b[-1] += acc_e
    obs_b, exp_b = np.array(obs_b), np.array(exp_b)
    chi2 = float(((obs_b - exp_b) ** 2 / exp_b).sum())
    return float(stats.chi2.sf(chi2, len(obs_b) - 1))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 200), icc=st.floats(0.0, 1.0), p=st.floats(0.01, 0.99),
       persist=st.floats(0.0, 1.0))
def test_pmfs_sum_to_one_and_match_moments(n, icc, p, persist):
    for pmf in (Gt.binomial_pmf(n, p), Gt.betabinom_pmf(n, icc, p), Gt.markov_pmf(n, persist, p)):
        assert pmf.shape == (n + 1,)
        assert np.all(pmf >= -1e-15)
        assert abs(pmf.sum() - 1.0) < 1e-9
    k = np.arange(n + 1)
    bb = Gt.betabinom_pmf(n, icc, p)
    assert np.dot(k, bb) == pytest.approx(n * p, rel=1e-8, abs=1e-9)
    var_bb = np.dot((k - n * p) ** 2, bb)
    assert var_bb == pytest.approx(n * p * (1 - p) * (1 + (n - 1) * icc), rel=1e-7, abs=1e-9)
    mk = Gt.markov_pmf(n, persist, p)
    mm = Gt.markov_moments(n, persist, p)
    assert np.dot(k, mk) == pytest.approx(mm["mean"], rel=1e-8, abs=1e-9)
    assert np.dot((k - n * p) ** 2, mk) == pytest.approx(mm["var"], rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("persist", [0.0, 0.5, 0.99, 1 - 1e-6, 1 - 1e-12, 1 - 2 ** -53, 1.0])
@pytest.mark.parametrize("n", [1, 2, 7, 60])
def test_markov_variance_is_stable_as_persistence_tends_to_one(n, persist):
    """Found by the property test (n = 1, persist = 1 - 2^-53): the textbook closed form
    cancels catastrophically near a = 1 (it gave var = 2pq at n = 1, where var = pq); the
    DP pmf's variance and the direct sum pq (n + 2 sum (n-k) a^k) agree to rounding."""
    for p in (0.5, 0.03):
        k = np.arange(1, n)
        direct = p * (1 - p) * (n + 2 * float(np.dot(n - k, persist ** k)))
        mm = Gt.markov_moments(n, persist, p)
        assert mm["var"] == pytest.approx(direct, rel=1e-13)
        pmf = Gt.markov_pmf(n, persist, p)
        kk = np.arange(n + 1)
        assert np.dot((kk - n * p) ** 2, pmf) == pytest.approx(mm["var"], rel=1e-9)


@pytest.mark.parametrize("n,icc,p", [(20, 0.4, 0.5), (12, 0.1, 0.3), (30, 0.7, 0.5)])
def test_betabinom_higher_moments_closed_form(n, icc, p):
    pmf = Gt.betabinom_pmf(n, icc, p)
    direct = Gt.pmf_moments(pmf)
    closed = Gt.betabinom_moments(n, icc, p)
    a, b = Gt.betabinom_params(icc, p)
    m, v, sk, ku = stats.betabinom.stats(n, a, b, moments="mvsk")
    assert closed["var_closed_form"] == pytest.approx(float(v), rel=1e-10)
    assert closed["skew"] == pytest.approx(float(sk), abs=1e-8)
    assert closed["kurt_excess"] == pytest.approx(float(ku), rel=1e-8)
    assert np.allclose(Gt.betabinom_pmf(n, icc, p), stats.betabinom.pmf(np.arange(n + 1), n, a, b), rtol=1e-9)
    for key in ("mean", "var", "skew", "kurt_excess"):
        assert closed[key] == pytest.approx(direct[key], rel=1e-8, abs=1e-10)


def test_independent_board_matches_simulation_and_berry_esseen():
    rng = np.random.default_rng(1)
    n, p = 16, 0.5
    draws = (rng.random((200_000, n)) < p).sum(1)
    counts = np.bincount(draws, minlength=n + 1).astype(float)
    assert chi2_pvalue(counts, Gt.binomial_pmf(n, p)) > 1e-3
    for nn, pp in [(5, 0.5), (20, 0.5), (50, 0.2), (400, 0.1)]:
        kd = Gt.kolmogorov_distance(nn, pp)
        assert 0 < kd <= Gt.berry_esseen_bound(nn, pp)
    # distance shrinks like 1/sqrt(n); continuity-corrected normal pmf converges
    assert Gt.kolmogorov_distance(400, 0.5) < Gt.kolmogorov_distance(25, 0.5) / 3.5
    assert np.max(np.abs(Gt.normal_limit_pmf(400) - Gt.binomial_pmf(400))) < 1e-3


@pytest.mark.parametrize("n,icc,p", [(20, 0.4, 0.5), (10, 0.15, 0.3)])
def test_exchangeable_board_matches_simulation(n, icc, p):
    """Exchangeable deflections: draw a board bias from Beta(alpha, beta), then n Bernoullis."""
    rng = np.random.default_rng(2)
    a, b = Gt.betabinom_params(icc, p)
    q = rng.beta(a, b, size=200_000)
    draws = (rng.random((q.size, n)) < q[:, None]).sum(1)
    counts = np.bincount(draws, minlength=n + 1).astype(float)
    pmf = Gt.betabinom_pmf(n, icc, p)
    assert chi2_pvalue(counts, pmf) > 1e-3
    # and the per-bin 3-SE check
    frac = counts / counts.sum()
    se = np.sqrt(pmf * (1 - pmf) / counts.sum())
    assert np.all(np.abs(frac - pmf) <= 3.5 * se + 1e-12)


@pytest.mark.parametrize("n,persist,p", [(20, 0.5, 0.5), (15, 0.8, 0.3)])
def test_markov_board_matches_simulation(n, persist, p):
    rng = np.random.default_rng(3)
    m = 200_000
    x = rng.random(m) < p
    tot = x.astype(int)
    for _ in range(n - 1):
        fresh = rng.random(m) < p
        keep = rng.random(m) < persist
        x = np.where(keep, x, fresh)
        tot += x
    counts = np.bincount(tot, minlength=n + 1).astype(float)
    assert chi2_pvalue(counts, Gt.markov_pmf(n, persist, p)) > 1e-3


@pytest.mark.parametrize("n", [2, 3, 5, 20, 100])
@pytest.mark.parametrize("p", [0.5, 0.3, 0.8, 0.05])
def test_betabinom_u_shape_exactly_at_threshold(n, p):
    thr = B.betabinom_u_threshold(n, p)
    if p == 0.5:
        assert thr == pytest.approx(1 / 3, abs=1e-12)
    for d in (1e-4, 1e-2):
        assert B.is_u_shaped(Gt.betabinom_pmf(n, thr + d, p)), (n, p, thr + d)
        if thr - d > 0:
            assert not B.is_u_shaped(Gt.betabinom_pmf(n, thr - d, p)), (n, p, thr - d)


def test_u_threshold_large_n_limit_and_bc_crossing():
    p = 0.3
    assert B.betabinom_u_threshold(100000, p) == pytest.approx(0.7 / 1.7, abs=1e-4)
    for n in (5, 20, 200):
        icc = B.betabinom_bc_crossing(n)
        assert B.betabinom_bc(n, icc) == pytest.approx(5 / 9, abs=1e-9)
        assert B.betabinom_bc(n, min(1, icc + 0.05)) > 5 / 9 > B.betabinom_bc(n, max(1e-6, icc - 0.05))
    a = B.markov_bc_crossing(20)
    m = Gt.pmf_moments(Gt.markov_pmf(20, a))
    assert B.bc_population(m["skew"], m["kurt_excess"]) == pytest.approx(5 / 9, abs=1e-9)


def test_bimodality_coefficient_forms():
    # Bernoulli(1/2) has BC = 1, a uniform 5/9, a normal 1/3
    assert B.bc_population(0.0, -2.0) == pytest.approx(1.0)
    assert B.bc_population(0.0, -1.2) == pytest.approx(5 / 9)
    assert B.bc_from_raw_moments(0.0, 1.0, 0.0, 3.0) == pytest.approx(1 / 3)
    rng = np.random.default_rng(4)
    assert B.bc_sample(rng.uniform(size=400_000)) == pytest.approx(5 / 9, abs=3e-3)
    assert B.bc_sample(rng.standard_normal(400_000)) == pytest.approx(1 / 3, abs=3e-3)
    # the sample form's small-n correction: the limit n -> inf is the population form
    x = rng.standard_normal(10)
    n = x.size
    assert B.bc_sample(x) != pytest.approx(B.bc_population(stats.skew(x), stats.kurtosis(x)))
    assert 3 * (n - 1) ** 2 / ((n - 2) * (n - 3)) > 3
    assert math.isfinite(B.bc_sample(x))
