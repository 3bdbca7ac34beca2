"""analysis.stats: BCa coverage by simulation, exact tests against hand values, Holm,
degenerate input, equal progress on synthetic curves."""

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from analysis import stats as S


def _coverage(n: int, reps: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    hit = 0
    for i in range(reps):
        c = rng.normal(size=n)
        t = c + rng.normal(0.3, 1.0, size=n)       # true mean difference 0.3
        lo, hi, note = S.bca_interval(t, c, seed=i)
        assert note == ""
        hit += lo <= 0.3 <= hi
    return hit / reps


def _tol(p: float, reps: int) -> float:
    return 3.0 * math.sqrt(p * (1 - p) / reps)      # 3 binomial standard deviations


def test_bca_coverage_large_n_is_nominal():
    # 200 replications of n = 40 normal differences: 95 % +- 3 binomial sd (0.046)
    cov = _coverage(40, 200, seed=11)
    assert abs(cov - 0.95) <= _tol(0.95, 200), cov


def test_bca_coverage_n10_is_the_known_small_sample_undercoverage():
    # At n = 10 a bootstrap interval uses the plug-in sd (divisor n), so its coverage is
    # about P(|t_9| < 1.96 sqrt(9/10)) = 0.904, not 95 %: the exact tests, not the
    # interval, decide a row at n = 10 (measured here, 200 replications).
    expected = 1 - 2 * sps.t.sf(1.959964 * math.sqrt(9 / 10), df=9)
    assert 0.90 < expected < 0.91
    cov = _coverage(10, 200, seed=12)
    assert abs(cov - expected) <= _tol(expected, 200), cov
    assert cov < 0.95


def test_degenerate_all_equal_differences():
    c = np.arange(10) * 1e-9           # seeds differ by 1e-9, difference exactly -2 each
    t = c - 2.0
    lo, hi, note = S.bca_interval(t, c)
    assert lo == hi == pytest.approx(-2.0)
    assert note.startswith("degenerate")
    r = S.paired_test(t, c)
    assert (r.ci_low, r.ci_high) == pytest.approx((-2.0, -2.0))
    assert r.sign_p == pytest.approx(2 / 2 ** 10) and r.perm_p == pytest.approx(2 / 2 ** 10)
    assert "degenerate" in r.note
    # nearly degenerate (one pair differs): a finite BCa interval, no NaN
    lo, hi, note = S.bca_interval(np.r_[np.zeros(9), 1.0], np.zeros(10))
    assert note == "" and np.isfinite([lo, hi]).all() and lo <= 0.1 <= hi
    z = S.paired_test(np.ones(10), np.ones(10))     # all zero differences
    assert z.ci_low == z.ci_high == 0 and z.sign_p == 1.0 and z.perm_p == 1.0


def test_sign_test_exact_values():
    d = np.array([1.0] * 8 + [-1.0] * 2)
    p, npos, nneg = S.sign_test(d)
    # 2 * (C(10,0) + C(10,1) + C(10,2)) / 2^10
    assert (npos, nneg) == (8, 2) and p == pytest.approx(2 * (1 + 10 + 45) / 1024)
    p, _, _ = S.sign_test([1.0] * 9 + [-1.0], alternative="greater")
    assert p == pytest.approx((10 + 1) / 1024)
    p, npos, nneg = S.sign_test([0.0, 0.0] + [0.5] * 8)   # ties dropped: n = 8
    assert (npos, nneg) == (8, 0) and p == pytest.approx(2 / 256)


def test_permutation_test_exact_value():
    # |d| = 1 for all 10 pairs, one negative: |sum| >= 8 in 2 x 11 of 2^10 sign patterns
    c = np.zeros(10)
    t = np.array([1.0] * 9 + [-1.0])
    p, exact = S.permutation_test(t, c)
    assert exact and p == pytest.approx(22 / 1024)


def test_min_seeds_and_bad_input():
    with pytest.raises(ValueError, match=">= 10 paired seeds"):
        S.paired_test(np.ones(5), np.zeros(5))
    with pytest.raises(ValueError, match="same seeds"):
        S.paired_differences([1, 2], [1])
    with pytest.raises(ValueError, match="finite"):
        S.paired_differences([1, np.nan], [1, 2])


def test_holm_hand_example():
    # sorted .005 .01 .03 .04 -> 4(.005)=.02, 3(.01)=.03, 2(.03)=.06, max(.06, 1(.04))=.06
    adj = S.holm([0.01, 0.04, 0.03, 0.005])
    assert adj == pytest.approx([0.03, 0.06, 0.06, 0.02])
    adj = S.holm([0.5, np.nan, 0.01])                    # NaN is not a test: m = 2
    assert adj[0] == pytest.approx(0.5) and np.isnan(adj[1]) and adj[2] == pytest.approx(0.02)
    df = S.correct_rows(pd.DataFrame({"p": [0.01, 0.04, 0.03, 0.005]}))
    assert df["reject_holm"].tolist() == [True, False, False, True]
    assert "Holm" in df.attrs["multiplicity"] and "4" in df.attrs["multiplicity"]


# ----------------------------------------------------------------------------- equal progress

T = 1200


def _curve(spikes, rng, slow: float = 1.0) -> pd.DataFrame:
    """Loss 0.1 + 3 exp(-t / (300 slow)) with 0.5 % noise; loss x 3 for 3 steps at spikes."""
    t = np.arange(1, T + 1)
    loss = (0.1 + 3.0 * np.exp(-t / (300.0 * slow))) * (1 + 0.005 * rng.standard_normal(T))
    for s in spikes:
        loss[(t >= s) & (t < s + 3)] *= 3.0
    return pd.DataFrame({"step": t, "loss": loss})


def _arms(slowed: bool, n: int = 10):
    rng = np.random.default_rng(5)
    ctrl, trt = [], []
    for _ in range(n):
        # spikes away from the half-way point, where the control reaches the target
        s = np.sort(rng.choice(np.r_[150:520, 680:1150:1], size=4, replace=False))
        ctrl.append(_curve(s, rng))
        if slowed:   # the same run at half speed: spike at 2s, loss curve stretched x 2
            trt.append(_curve(2 * s[2 * s < T - 5], rng, slow=2.0))
        else:        # same progress, half the spikes
            trt.append(_curve(s[::2], rng))
    return ctrl, trt


def test_equal_progress_slowed_copy_says_slowing():
    ctrl, trt = _arms(slowed=True)
    ep = S.equal_progress(ctrl, trt)
    assert (ep.per_seed["control_spikes"] == 4).all()        # the detector sees every spike
    assert ep.spikes_full.mean_diff < 0 and ep.spikes_full.ci_high < 0
    # at equal progress the slowed copy has exactly the control's spikes before the target
    assert (ep.per_seed["treatment_spikes_before_target"]
            == ep.per_seed["control_spikes_before_target"]).all()
    assert ep.final_loss.ci_low > 0
    assert ep.verdict.startswith("removes spikes only by slowing training")


def test_equal_progress_real_remedy():
    ctrl, trt = _arms(slowed=False)
    ep = S.equal_progress(ctrl, trt)
    assert ep.spikes_at_target.ci_high < 0
    assert ep.verdict.startswith("reduces spikes at equal progress")


def test_paired_rows_with_holm():
    """The claims table's path (analysis.claims): paired_test per row, correct_rows over them."""
    rng = np.random.default_rng(7)
    c = rng.normal(size=10)
    pairs = {"shift": (c + 2.0 + 0.1 * rng.normal(size=10), c),
             "null": (c + 0.1 * rng.normal(size=10), c),
             "quadratic": (np.full(10, -2.0), np.zeros(10))}
    rows = [{"id": k, **S.paired_test(t, k_).as_dict()} for k, (t, k_) in pairs.items()]
    by = S.correct_rows(pd.DataFrame(rows)).set_index("id")
    assert by.loc["shift", "reject_holm"] and not by.loc["null", "reject_holm"]
    # Holm over 3 rows: the smallest p is multiplied by 3
    assert by.loc["shift", "p_holm"] == pytest.approx(3 * by.loc["shift", "p"])
    assert "degenerate" in by.loc["quadratic", "note"]
