"""The JAX trainer's PaLM-style spike guard (simulate.guard): rollback to an in-memory
snapshot and batch skipping on a poisoned batch, rows after a rollback, abort, bad config."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from adamspike.config import ConfigError, load_config
from adamspike.rundir import load_run
from adamspike.train_config import GuardSection, RunConfig
from simulate import llama_train as lt
from simulate.guard import SnapshotGuard

STEPS, POISON, EVERY = 60, 40, 10
BASE = ["--model.preset", "tiny", "--optim.lr", "1e-2", "--optim.warmup_steps", "5",
        "--optim.schedule", "constant", "--train.num_steps", str(STEPS),
        "--train.global_batch_size", "8", "--train.seq_len", "16", "--data.task", "markov",
        "--data.poison_steps", str(POISON), "--telemetry.hist_every", "0",
        "--guard.window", "20", "--guard.skip_batches", "5", "--checkpoint.every", str(EVERY)]


def _run(tmp_path, name, *extra):
    cfg = load_config(RunConfig, None, BASE + list(extra))
    return load_run(lt.train(cfg, tmp_path / name, progress=False))


def _events(run, kind):
    ev = run.events
    return ev[ev.type == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guard")
    return (tmp, _run(tmp, "plain"), _run(tmp, "guarded", "--guard.enabled", "true"))


def test_unguarded_run_logs_the_spike_and_trains_on_it(runs):
    _, plain, _ = runs
    spikes = _events(plain, "spike")
    assert list(spikes.step.astype(int)) == [POISON]
    assert _events(plain, "rollback").empty
    s = plain.steps.set_index("step")
    assert s.loss[POISON] > s.loss.drop(index=POISON).max() + 1.0


def test_guard_rolls_back_and_skips_the_poisoned_batch(runs):
    tmp, plain, guarded = runs
    types = list(guarded.events.type)
    i = types.index("spike")
    assert types[i:i + 3] == ["spike", "rollback", "skip_batches"]
    spike = _events(guarded, "spike").iloc[0]
    assert int(spike.step) == POISON and spike.loss > 2 * spike.baseline
    rb = _events(guarded, "rollback").iloc[0]
    # last good snapshot: step 30 (taken after step 30, its loss judged normal at step 31)
    assert (int(rb.from_step), int(rb.to_step), int(rb.retry)) == (POISON, 30, 1)
    sk = _events(guarded, "skip_batches").iloc[0]
    # batches 31..40 were read since the snapshot: max(guard.skip_batches = 5, 10) = 10
    assert (int(sk.step), int(sk.first_batch), int(sk.last_batch)) == (31, 31, 40)
    assert (int(sk.num_batches), int(sk.offset_before), int(sk.offset_after)) == (10, 0, 10)
    assert len(_events(guarded, "rollback")) == 1 and _events(guarded, "abort").empty
    end = _events(guarded, "end").iloc[0]
    assert int(end.num_rollbacks) == 1 and int(end.num_skipped_batches) == 10

    # rows: every step once, in the files themselves (the abandoned rows were never written)
    for table, key in (("steps", ["step"]), ("layers", ["step", "name"])):
        raw = pd.concat([pq.read_table(p).to_pandas() for p in sorted((tmp / "guarded" / table)
                                                                      .glob("part-*.parquet"))])
        assert not raw.duplicated(key).any(), table
    s, p = guarded.steps.set_index("step"), plain.steps.set_index("step")
    assert list(s.index) == list(range(1, STEPS + 1))
    assert sorted(guarded.layers.step.unique()) == list(range(1, STEPS + 1))
    # the kept trace: identical to the unguarded run up to the snapshot, then the re-run on
    # batches 41.. (step s reads batch s + 10): no spike at step 40 any more
    np.testing.assert_array_equal(s.loss.loc[:30], p.loss.loc[:30])
    assert not np.allclose(s.loss.loc[31:39], p.loss.loc[31:39])
    assert s.loss[POISON] < 1.2 * s.loss.loc[30:39].median()
    # and the detector the guard runs online finds no spike in the kept trace
    from analysis.spikes import detect_spikes
    assert np.isfinite(s.loss).all()
    assert detect_spikes(s.loss.to_numpy(), s.index.to_numpy(), window=20, k=6.0,
                         min_rel_jump=0.2).empty
    assert not detect_spikes(p.loss.to_numpy(), p.index.to_numpy(), window=20, k=6.0,
                             min_rel_jump=0.2).empty


def test_no_retries_left_aborts_and_keeps_the_rows_before(tmp_path):
    run = _run(tmp_path, "abort", "--guard.enabled", "true", "--guard.max_retries", "0")
    types = list(run.events.type)
    assert types[-3:] == ["spike", "abort", "end"] and "rollback" not in types
    assert "guard.max_retries = 0" in _events(run, "abort").iloc[0].reason
    assert list(run.steps.step) == list(range(1, POISON))   # the spike step is not trained on


def test_guard_needs_snapshots(tmp_path):
    cfg = load_config(RunConfig, None, BASE + ["--guard.enabled", "true", "--checkpoint.every", "0"])
    with pytest.raises(ConfigError, match="checkpoint.every"):
        lt.train(cfg, tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()


def _policy(**kw):
    cfg = GuardSection(**{"enabled": True, "window": 8, "skip_batches": 3, "max_retries": 2, **kw})
    return SnapshotGuard(cfg, every=5, params="p0", opt_state="s0")


def test_policy_snapshots_retries_and_incidents():
    g = _policy()
    for step in range(1, 6):
        assert g.observe(step, 1.0 + 0.01 * (step % 2)).action == "ok"
        g.after_step(step, f"p{step}", f"s{step}", 0)
    assert g.good.step == 0 and g.candidate.step == 5      # not judged yet
    assert g.observe(6, 5.0).action == "rollback"          # spike right after the snapshot
    snap, offset, events = g.rollback(6, 0)
    assert snap.step == 0 and snap.params == "p0" and g.candidate is None
    assert offset == 6 and events[1][1]["num_batches"] == 6   # max(3, batches 1..6 read)
    for step in range(1, 8):                                # re-run from the initial state
        assert g.observe(step, 1.0).action == "ok"
        g.after_step(step, f"q{step}", f"t{step}", offset)
    assert g.good.step == 5 and g.good.params == "q5" and g.good.offset == 6
    assert g.observe(8, math.nan).action == "rollback"      # retry 2 of this incident
    snap, offset, events = g.rollback(8, 6)
    assert snap.step == 5 and offset == 6 + 3 and events[0][1]["retry"] == 2
    d = g.observe(6, 9.0)                                   # retries used up
    assert d.action == "abort" and [e[0] for e in d.events] == ["spike", "abort"]
    # an incident ends after `window` normal steps: the counter resets
    g2 = _policy(max_retries=1)
    for step in range(1, 10):
        g2.observe(step, 1.0)
    assert g2.observe(10, 5.0).action == "rollback"
    g2.rollback(10, 0)
    for step in range(10, 18):
        assert g2.observe(step, 1.0).action == "ok"
    assert g2.retries == 0 and g2.observe(18, 5.0).action == "rollback"


def test_policy_disabled_only_reports():
    g = _policy(enabled=False)
    for step in range(1, 10):
        g.observe(step, 1.0)
        g.after_step(step, "p", "s", 0)
    d = g.observe(10, 4.0)
    assert d.action == "ok" and [e[0] for e in d.events] == ["spike"] and g.candidate is None
    ev = json.loads(json.dumps(d.events[0][1]))   # plain JSON payloads
    assert ev["step"] == 10 and ev["loss"] == 4.0 and ev["baseline"] == 1.0
