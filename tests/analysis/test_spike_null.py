"""The plan's spike classes and their noise nulls (analysis.spike_null), and the many-series
form of the one rule (adamspike.spikes.anomaly_flags_many) it runs on."""

from __future__ import annotations

import numpy as np
import pytest

from adamspike.plan import load_plan
from adamspike.spikes import (SpikeParams, anomaly_flags, anomaly_flags_many, detect_spikes,
                              spike_durations_many)
from analysis.spike_null import (cell_against_null, cell_nulls, class_params, null_lanes,
                                 trend_residuals)

PLAN = load_plan("science4")


def lanes(n_lanes=4, n=600, seed=0, df=5, noise=0.05):
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    trend = 3 + 5 * np.exp(-t / 100)
    return [trend + noise * rng.standard_t(df, n) for _ in range(n_lanes)]


@pytest.mark.parametrize("params", [SpikeParams(window=50, k=4, min_rel_jump=0.1),
                                    SpikeParams(window=20, k=20, min_rel_jump=0.3, min_duration=3),
                                    SpikeParams(window=10, k=3, log=True, absorb=True),
                                    SpikeParams(window=7, k=6, min_history=2)])
def test_the_many_series_rule_makes_the_online_rules_decisions(params):
    rng = np.random.default_rng(1)
    X = 3 + 0.05 * rng.standard_t(3, (25, 300))
    X[3, 100:110] *= 2
    X[5, 290:] *= 3        # cut off by the end: censored
    X[7, 50] = np.nan
    X[9, 60] = -1.0        # non-positive under log: low, never anomalous
    F = anomaly_flags_many(X, params)
    durs = spike_durations_many(X, params)
    for i in range(len(X)):    # the same program's decisions: exact
        assert (F[i] == anomaly_flags(X[i], params)[0]).all()
        assert sorted(durs[i].tolist()) == sorted(detect_spikes(X[i], params=params)["duration"].tolist())


@pytest.mark.parametrize("params", [SpikeParams(window=50, k=4, min_rel_jump=0.1),
                                    SpikeParams(window=9, k=3, min_rel_jump=0.0, min_history=9),
                                    SpikeParams(window=6, k=2, log=True),
                                    SpikeParams(window=5, k=1, min_rel_jump=0.05, absorb=True,
                                                min_history=1)])
def test_the_many_series_rule_matches_the_online_rule_on_random_series(params):
    """Random series with NaN, +-inf, zeros, negatives, ties and spikes, some shorter than
    the window (histories never full) and some in which every row is judged at once (the
    vectorised rule's no-copy path): every decision as the online rule's."""
    rng = np.random.default_rng(11)
    for n, R, dirty in ((4, 6, True), (30, 40, True), (120, 40, True), (90, 8, False)):
        X = np.round(2 + rng.standard_t(2, (R, n)), 1)          # heavy tails, many ties
        X[rng.random((R, n)) < 0.03] *= 4                         # spikes
        if dirty:
            for bad in (np.nan, np.inf, -np.inf, 0.0, -1.0):
                X[rng.random((R, n)) < 0.02] = bad
        else:                                                     # every row judged at once
            X = np.abs(X) + 0.1
        F = anomaly_flags_many(X, params)
        for i in range(R):
            assert (F[i] == anomaly_flags(X[i], params)[0]).all(), (n, i)


def test_visible_class_needs_size_and_duration_the_secondary_does_not():
    x = lanes(1)[0].copy()
    x[300] *= 2.0                    # a one-step doubling: not visible (lasts 1 step)
    x[450:460] *= 1.8                # ten steps at 1.8x: visible
    vis = detect_spikes(x, params=class_params(PLAN, "visible"))
    sec = detect_spikes(x, params=class_params(PLAN, "secondary"))
    assert vis["start"].tolist() == [450] and vis["duration"].iloc[0] == 10
    assert {300, 450} <= set(sec["start"])


def test_noise_alone_does_not_beat_its_null_and_real_spikes_do():
    null = dict(PLAN["spikes"]["null"], replicates=40)     # p can reach 1/41 < alpha
    noise = lanes(4, seed=2)
    for cls in ("visible", "secondary"):
        r = cell_against_null(noise, class_params(PLAN, cls), null, seed=3)
        assert not r["beats"], (cls, r)
    spiky = [x.copy() for x in noise]
    spiky[0][300:310] *= 2.0
    spiky[2][450:456] *= 1.5
    r = cell_against_null(spiky, class_params(PLAN, "visible"), null, seed=3)
    assert r["count"] == 2 and sorted(r["durations"]) == [6, 10]
    assert r["student_t"]["p"] < 0.05 and r["shuffle"]["p"] < 0.05 and r["beats"]
    assert r["student_t"]["mean"] < 0.5           # the fitted noise rarely makes one


def test_null_lanes_keep_the_trend_and_the_residuals_scale():
    x = lanes(1, seed=4)[0]
    rng = np.random.default_rng(0)
    for kind in ("student_t", "shuffle"):
        z = null_lanes(x, kind, 50, rng, 51)
        assert z.shape == (50, len(x))
        # centred on the lane's trend (tolerance: the median of 50 draws of noise of scale
        # 0.05 strays ~0.01 from the fitted location)
        trend = trend_residuals(x, 51)[0]
        assert np.abs(np.median(z, axis=0) - trend).mean() < 0.02
    with pytest.raises(ValueError, match="null"):
        null_lanes(x, "gauss", 2, rng, 51)


def test_a_cells_nulls_are_judged_in_one_pass_with_the_per_lane_counts():
    """cell_against_null judges the lanes of one length in one call and shares a cell's null
    draws between classes: the same counts, p and durations as drawing and judging each lane
    on its own, in lane order, from each null's stream (the rule as first written)."""
    null = dict(PLAN["spikes"]["null"], replicates=15)
    a, b = lanes(2, n=300, seed=5), lanes(1, n=200, seed=6)
    xs = [a[0], b[0], a[1]]                                  # two lengths, interleaved
    xs[2][250:262] *= 2.0
    tw = int(null["trend_window"])
    per_lane = {}                # the draws as first written: lane by lane, per null stream
    for j, kind in enumerate(("student_t", "shuffle")):
        rng = np.random.default_rng([7, j])
        per_lane[kind] = [null_lanes(x, kind, 15, rng, tw) for x in xs]
    nulls = cell_nulls(xs, null, seed=7)
    for cls in ("visible", "secondary"):
        params = class_params(PLAN, cls)
        got = cell_against_null(xs, params, null, nulls=nulls)
        if cls == "visible":
            assert got == cell_against_null(xs, params, null, seed=7)
        assert got["count"] >= 1
        for kind, draws in per_lane.items():
            totals, durs = np.zeros(15, dtype=np.int64), []
            for z in draws:
                d = spike_durations_many(z, params)
                totals += [len(g) for g in d]
                durs += [int(v) for g in d for v in g]
            assert got[kind]["mean"] == totals.mean()
            assert got[kind]["p"] == (1 + int((totals >= got["count"]).sum())) / 16
            assert np.array_equal(got[kind]["median_duration"],
                                  np.median(durs) if durs else np.nan, equal_nan=True)
