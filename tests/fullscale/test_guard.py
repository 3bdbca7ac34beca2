"""fullscale.guard.SpikeGuard: the project spike rule (identical to analysis.spikes), rollback
decisions with bounded retries, PaLM-style batch skipping, state that survives resume.
The end-to-end spike -> rollback -> skip run of the trainer is test_guard_end_to_end below."""

from __future__ import annotations

import math

import numpy as np
import pytest

from adamspike.train_config import GuardSection
from analysis.spikes import detect_spikes
from fullscale.guard import SpikeGuard


def _cfg(**kw):
    base = dict(enabled=True, window=16, mad_k=6.0, min_rel_jump=0.2, skip_batches=10,
                max_retries=2)
    return GuardSection(**{**base, **kw})


def _noisy(n, seed=0):
    rng = np.random.default_rng(seed)
    return 2.0 + 1.5 * np.exp(-np.arange(n) / 60) + 0.03 * rng.standard_normal(n)


def test_no_false_alarm_on_a_noisy_decreasing_loss():
    g = SpikeGuard(_cfg())
    assert all(g.observe(s, x).action == "ok" for s, x in enumerate(_noisy(400), 1))


def test_same_decisions_as_the_analysis_rule():
    x = _noisy(200, seed=4)
    x[[60, 61, 130]] *= [1.6, 1.3, 2.5]
    g = SpikeGuard(_cfg(enabled=False))     # disabled: judge every point, never act
    flagged = [s for s, v in enumerate(x) if g.observe(s, v).events]
    spikes = detect_spikes(x, window=16, k=6.0, min_rel_jump=0.2)
    expected = [s for _, r in spikes.iterrows() for s in range(r.start, r.end + 1)]
    assert flagged == expected and 60 in flagged and 130 in flagged


def test_spike_rollback_then_abort_after_max_retries():
    g = SpikeGuard(_cfg(max_retries=2))
    for s, v in enumerate(_noisy(30), 1):
        assert g.observe(s, v).action == "ok"
    d = g.observe(31, 9.0)
    assert d.action == "rollback" and "loss spike" in d.reason and "rollback 1 of at most 2" in d.reason
    (etype, ev), = d.events
    assert etype == "spike" and ev["step"] == 31 and ev["loss"] == 9.0
    assert ev["threshold"] < 9.0 and ev["baseline"] == pytest.approx(np.median(_noisy(30)[-16:]))
    assert g.observe(31, 8.0).action == "rollback"
    d = g.observe(31, 8.0)
    assert d.action == "abort" and "guard.max_retries = 2" in d.reason
    assert [t for t, _ in d.events] == ["spike", "abort"]


def test_nonfinite_loss_and_zero_retries():
    g = SpikeGuard(_cfg(max_retries=0))
    d = g.observe(1, math.nan)                 # even before any history exists
    assert d.action == "abort" and "non-finite loss" in d.reason
    assert d.events[0][0] == "nonfinite_loss"
    g = SpikeGuard(_cfg())
    assert g.observe(1, math.inf).action == "rollback"


def test_incident_ends_after_window_good_steps():
    g = SpikeGuard(_cfg(max_retries=1))
    x = _noisy(80)
    for s in range(1, 30):
        g.observe(s, x[s])
    assert g.observe(30, 9.0).action == "rollback"
    for s in range(30, 30 + 16):               # recovered for `window` steps
        assert g.observe(s, x[s]).action == "ok"
    assert g.retries == 0 and g.num_rollbacks == 1
    assert g.observe(46, 9.0).action == "rollback"   # a new incident may roll back again


def test_rollback_plan_skips_the_spike_window_and_restores_history():
    g = SpikeGuard(_cfg(skip_batches=10))
    x = _noisy(60)
    for s in range(1, 21):
        g.observe(s, x[s])
    at_ckpt = g.state_dict()                   # what checkpoint 20 stores
    for s in range(21, 26):
        g.observe(s, x[s])
    assert g.observe(26, 9.0).action == "rollback"
    plan = g.rollback(26, {"step": 20, "position": {"step": 20, "offset": 4}, "guard": at_ckpt},
                      offset_now=4)
    # 6 batches were read since the checkpoint; at least skip_batches = 10 are skipped
    assert plan.resume_step == 21 and plan.num_skipped == 10
    assert plan.position == {"step": 20, "offset": 14}
    assert [t for t, _ in plan.events] == ["rollback", "skip_batches"]
    skip = plan.events[1][1]
    assert (skip["first_batch"], skip["last_batch"], skip["offset_after"]) == (25, 34, 14)
    assert g.state_dict()["detector"]["history"] == at_ckpt["detector"]["history"]
    assert g.retries == 1                      # counters survive the history reset
    # A window longer than skip_batches: everything read since the checkpoint is skipped.
    plan = SpikeGuard(_cfg(skip_batches=0)).rollback(
        26, {"step": 20, "position": {"step": 20, "offset": 0}, "guard": None}, offset_now=0)
    assert plan.num_skipped == 6 and plan.position["offset"] == 6
    with pytest.raises(ValueError, match="not before the spike step"):
        g.rollback(20, {"step": 20, "position": None, "guard": None}, offset_now=0)


def test_state_round_trip_and_config_mismatch():
    g = SpikeGuard(_cfg())
    for s, v in enumerate(_noisy(40), 1):
        g.observe(s, v)
    g.observe(41, 9.0)
    h = SpikeGuard(_cfg())
    h.load_state_dict(g.state_dict())
    assert h.state_dict() == g.state_dict()
    assert h.observe(42, 9.0).action == g.observe(42, 9.0).action == "rollback"
    with pytest.raises(ValueError, match="window"):
        SpikeGuard(_cfg(window=32)).load_state_dict(g.state_dict())
