"""Spike detection: injected spikes found at their positions, quiet noise left alone, the
online detector equal to the offline one, and the published z-score rules."""

import math

import numpy as np
import pytest

from analysis.spikes import (RollingSpikeDetector, anomaly_flags, detect_spikes,
                             spike_score_olmo2, zscore_flags)


def _noisy_loss(n, seed, sd=0.02):
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    return (2.0 + 3.0 * np.exp(-t / 400)) * (1 + sd * rng.standard_normal(n))


def test_injected_spikes_found_at_known_positions():
    x = _noisy_loss(3000, seed=1)
    starts, heights, lengths = [500, 1200, 2100, 2700], [0.5, 1.0, 3.0, 0.35], [1, 3, 8, 2]
    for s, h, L in zip(starts, heights, lengths):
        x[s:s + L] *= 1 + h * np.linspace(1.0, 0.6, L)  # decaying bump
    steps = np.arange(3000) + 10
    sp = detect_spikes(x, steps)
    assert list(sp["start"]) == [s + 10 for s in starts]
    assert list(sp["num_points"]) == lengths
    assert list(sp["duration"]) == lengths
    assert sp["recovered"].all() and not sp["nonfinite"].any()
    assert list(sp["peak_step"]) == [s + 10 for s in starts]
    # the baseline is the median of the past 50 points, so on a falling loss it lags the
    # trend by ~25 steps (at step 500 by ~4%): heights agree within 0.1 absolute
    np.testing.assert_allclose(sp["height"], heights, atol=0.1)


def test_nonfinite_and_unrecovered_spike():
    x = _noisy_loss(400, seed=2)
    x[200] = np.nan
    x[300:] *= 3.0  # the run diverges and never comes back
    sp = detect_spikes(x)
    assert list(sp["start"]) == [200, 300]
    assert sp.loc[0, "nonfinite"] and math.isnan(sp.loc[0, "peak"]) and sp.loc[0, "recovered"]
    assert not sp.loc[1, "recovered"] and sp.loc[1, "duration"] == 100
    assert sp.loc[1, "num_points"] == 100
    # absorb=True: the level shift enters the history and the "spike" ends early
    sp2 = detect_spikes(x, absorb=True)
    assert sp2.loc[1, "recovered"] and sp2.loc[1, "num_points"] < 100


@pytest.mark.parametrize("seed", range(5))
def test_no_spikes_in_gaussian_noise(seed):
    # Gaussian noise: the 6-sigma rule with a 50-point MAD gave 0 anomalous points in
    # 10 x 20000 points when measured; allow at most 1 in 20000 (rate <= 5e-5).
    rng = np.random.default_rng(100 + seed)
    x = 10.0 + rng.standard_normal(20000)
    flags, _ = anomaly_flags(x)
    assert flags.sum() <= 1


def test_false_positive_rate_heavy_tails():
    # Student-t(5) noise is heavier-tailed than the MAD-sigma assumes: measured rate ~9e-4
    # over 2e5 points; bound it at 2e-3 so a regression in the band shows up.
    rng = np.random.default_rng(7)
    x = 10.0 + rng.standard_t(5, 40000)
    flags, _ = anomaly_flags(x)
    assert flags.mean() < 2e-3


def test_log_mode_on_decaying_quadratic_loss():
    rng = np.random.default_rng(3)
    t = np.arange(4000)
    x = 1e2 * np.exp(-t / 300) * (1 + 0.05 * rng.standard_normal(4000))  # 6 decades
    x[3000] *= 50.0
    assert list(detect_spikes(x, log=True)["start"]) == [3000]
    x[3500] = 0.0  # an exact zero is low, not a spike
    assert list(detect_spikes(x, log=True)["start"]) == [3000]


def test_online_equals_offline_with_checkpoint():
    rng = np.random.default_rng(4)
    x = _noisy_loss(2000, seed=5, sd=0.05)
    idx = rng.choice(2000, 40, replace=False)
    x[idx] *= rng.uniform(1.1, 4.0, 40)
    x[rng.choice(2000, 5, replace=False)] = np.inf
    x[rng.choice(2000, 5, replace=False)] = np.nan
    for kw in ({}, {"log": True}, {"absorb": True}, {"window": 20, "k": 3.0, "min_history": 20}):
        offline, _ = anomaly_flags(x, **kw)
        det = RollingSpikeDetector(kw.get("window", 50), kw.get("k", 6.0), 0.2,
                                   kw.get("min_history"), log=kw.get("log", False),
                                   absorb=kw.get("absorb", False))
        online = []
        for i, v in enumerate(x):
            if i == 1000:  # a resumed trainer restores the detector from its checkpoint
                state = det.state_dict()
                det = RollingSpikeDetector(det.window, det.k, det.min_rel_jump, det.min_history,
                                           log=det.log, absorb=det.absorb)
                det.load_state_dict(state)
            online.append(det.update(v))
        np.testing.assert_array_equal(np.array(online), offline)
        assert offline.sum() >= 10


def test_detector_rejects_bad_parameters_and_state():
    with pytest.raises(ValueError, match="window"):
        RollingSpikeDetector(1)
    with pytest.raises(ValueError, match="min_history"):
        RollingSpikeDetector(10, min_history=11)
    state = RollingSpikeDetector(10).state_dict()
    with pytest.raises(ValueError, match="window"):
        RollingSpikeDetector(20).load_state_dict(state)


def test_olmo2_spike_score_and_zscore_rules():
    rng = np.random.default_rng(6)
    x = 1.0 + 0.01 * rng.standard_normal(3000)
    assert spike_score_olmo2(x) == 0.0
    x[[1500, 2000, 2500]] += 0.5  # 50 sigma
    assert spike_score_olmo2(x) == pytest.approx(100 * 3 / (3000 - 20))
    x[2800] -= 0.5  # a dip: two-sided rules flag it, Levanter's one-sided rule does not
    oc, lev = zscore_flags(x, "olmo-core"), zscore_flags(x, "levanter")
    assert set(np.flatnonzero(oc)) == {1500, 2000, 2500, 2800}
    assert set(np.flatnonzero(lev)) == {1500, 2000, 2500}
    assert not zscore_flags(x[:60], "levanter").any()  # needs 64 entries of history
    with pytest.raises(ValueError, match="rule"):
        zscore_flags(x, "palm")


def test_the_rule_is_made_from_settings_in_one_place_and_checked():
    """SpikeParams.from_table: fields by name (other keys left to the caller), checked like
    config fields; from_config maps the guard's mad_k; from_flags names the flag."""
    import argparse

    from adamspike.config import ConfigError
    from adamspike.spikes import SpikeParams, add_spike_flags

    p = SpikeParams.from_table({"window": np.int64(30), "k": 4, "heights": [0.1]})
    assert p == SpikeParams(window=30, k=4.0) and isinstance(p.window, int)
    assert SpikeParams.from_config({"guard": {"window": 20, "mad_k": 5.0}}) == \
        SpikeParams(window=20, k=5.0)
    assert SpikeParams.from_config(None) == SpikeParams()
    with pytest.raises(ConfigError, match=r"^\[spikes\] window: must be >= 2, got 1$"):
        SpikeParams.from_table({"window": 1}, name="[spikes] {}".format)
    with pytest.raises(ConfigError, match="k: must be finite"):
        SpikeParams.from_table(k=math.nan)
    with pytest.raises(TypeError, match="windw"):   # a misspelt keyword is not dropped
        detect_spikes([1.0, 2.0], windw=30)
    ap = argparse.ArgumentParser()
    add_spike_flags(ap)
    args = ap.parse_args(["--k", "3", "--log-loss", "yes"])
    assert SpikeParams.from_flags(args) == SpikeParams(k=3.0, log=True)
    assert SpikeParams.from_flags(ap.parse_args([])) == SpikeParams()   # the same defaults
    with pytest.raises(ConfigError, match="^--min-rel-jump: must be >= 0"):
        SpikeParams.from_flags(ap.parse_args(["--min-rel-jump", "-1"]))
