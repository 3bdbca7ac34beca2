"""fullscale.guard.SpikeGuard: the project spike rule (identical to analysis.spikes), rollback
decisions with bounded retries, PaLM-style batch skipping, state that survives resume.
The end-to-end spike -> rollback -> skip run of the trainer is test_guard_end_to_end below."""

from __future__ import annotations

import math

import numpy as np
import pytest

from adamspike.train_config import GuardSection
from analysis.spikes import detect_spikes
from fullscale import checkpoint
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


def test_rollback_plan_skips_the_spike_window_and_keeps_the_pre_incident_history():
    g = SpikeGuard(_cfg(skip_batches=10))
    x = _noisy(60)
    for s in range(1, 21):
        g.observe(s, x[s])
    at_ckpt = g.state_dict()                   # what checkpoint 20 stores
    for s in range(21, 26):
        g.observe(s, x[s])
    before_spike = g.state_dict()["detector"]["history"]
    assert g.observe(26, 9.0).action == "rollback"
    plan = g.rollback(26, {"step": 20, "position": {"step": 20, "offset": 4}, "guard": at_ckpt},
                      offset_now=4)
    # 6 batches were read since the checkpoint; at least skip_batches = 10 are skipped
    assert plan.resume_step == 21 and plan.num_skipped == 10
    assert plan.position == {"step": 20, "offset": 14}
    assert [t for t, _ in plan.events] == ["rollback", "skip_batches"]
    skip = plan.events[1][1]
    assert (skip["first_batch"], skip["last_batch"], skip["offset_after"]) == (25, 34, 14)
    # the detector keeps the history it judged the spike against, not checkpoint 20's
    assert g.state_dict()["detector"]["history"] == before_spike != at_ckpt["detector"]["history"]
    assert g.retries == 1                      # counters survive the rollback
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


# ----------------------------------------------------------------------------- end to end

GUARD_RUN = """
[model]
preset = "tiny"
[optim]
lr = 3e-3
warmup_steps = 5
schedule = "constant"
[train]
num_steps = 60
global_batch_size = 8
seq_len = 32
seed = 0
[data]
poison_steps = [40]
[telemetry]
every = 10
hist_every = 0
[checkpoint]
every = 10
keep = 2
[guard]
enabled = true
window = 20
skip_batches = 5
max_retries = 2
"""


def _train(tmp_path, name, *overrides):
    import os
    import subprocess
    import sys
    from pathlib import Path

    config = tmp_path / "guard.toml"
    config.write_text(GUARD_RUN)
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "fullscale.train", "--config", str(config),
                           "--out", str(out), *overrides], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1",
                                            "PYTHONPATH": str(root)})
    return proc, out


def _train_here(capsys, out, *argv):
    """`python -m fullscale.train --out OUT ARGV` in this process (tests.fullscale.trainers):
    for the runs whose process is not what a case checks (no background save, whose
    thread's traceback only a process would print)."""
    from tests.fullscale.trainers import main_here

    return main_here(["--out", str(out), *argv], capsys)


@pytest.mark.slow
def test_guard_end_to_end_spike_rollback_skip_recover(tmp_path, capsys):
    from adamspike.rundir import load_run

    config = tmp_path / "guard.toml"
    config.write_text(GUARD_RUN)
    out = tmp_path / "run"
    proc = _train_here(capsys, out, "--config", str(config))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = load_run(out, tables=("steps",))
    ev = run.events
    guard_events = ev[ev["type"].isin(["spike", "nonfinite_loss", "rollback", "skip_batches",
                                       "abort"])]
    assert guard_events["type"].tolist() == ["spike", "rollback", "skip_batches"]
    spike, rollback, skip = (guard_events.iloc[i] for i in range(3))
    assert spike["step"] == 40 and spike["loss"] > spike["threshold"]
    assert (rollback["from_step"], rollback["to_step"]) == (40, 30)
    assert rollback["checkpoint"].endswith("step-00000030")
    # batches 31..40 were read since the checkpoint (> skip_batches = 5): all are skipped
    assert (skip["first_batch"], skip["last_batch"], skip["offset_after"]) == (31, 40, 10)

    steps = run.steps.set_index("step")
    assert steps.index.tolist() == list(range(1, 61))      # each step once, re-run rows kept
    before = steps.loss.loc[30:39].mean()
    after = steps.loss.loc[41:50].mean()
    assert steps.loss.loc[40] < spike["threshold"]         # step 40 now reads a clean batch
    assert after < 1.05 * before, (before, after)
    print(f"spike loss {spike['loss']:.3f} (threshold {spike['threshold']:.3f}); mean loss "
          f"steps 30-39 {before:.3f}, 41-50 after recovery {after:.3f}")

    # The skip offset and the guard state survive a resume: cut a copy back to its step-50
    # checkpoint and resume it; the trace is bitwise that of the uninterrupted run.
    import shutil

    out2 = tmp_path / "split"
    shutil.copytree(out, out2)
    assert [s for s, _ in checkpoint.complete(out2 / "checkpoints")] == [50, 60]
    shutil.rmtree(checkpoint.step_dir(out2 / "checkpoints", 60))
    proc = _train_here(capsys, out2, "--config", str(config), "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    split = load_run(out2, tables=("steps",))
    assert split.steps["loss"].tolist() == run.steps["loss"].tolist()
    assert split.events.query("type == 'resume'")["step"].tolist() == [50]


@pytest.mark.slow
def test_guard_end_to_end_gives_up_after_max_retries(tmp_path):
    from adamspike.rundir import load_run

    proc, out = _train(tmp_path, "run", "--guard.max_retries", "0", "--train.num_steps", "45",
                       "--checkpoint.async_save", "true")
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "guard.max_retries = 0" in proc.stderr and "Traceback" not in proc.stderr
    types = load_run(out, tables=()).events["type"].tolist()
    assert types.count("spike") == 1 and "rollback" not in types
    # Nothing after the spike was checkpointed: the newest state is the good one of step 30,
    # whose async save the abort found pending; it was completed (and hashed) on close, and
    # its checkpoint event logged then, before the spike's events and the abort (the
    # stopping run's last event).
    assert types[-3:] == ["checkpoint", "spike", "abort"]
    assert checkpoint.complete(out / "checkpoints")[-1][0] == 30
    newest = checkpoint.step_dir(out / "checkpoints", 30)
    assert checkpoint.read_manifest(newest)["finalized"] == "at close"   # with hashes
    checkpoint.verify(newest)
    assert types.count("abort") == 1                       # logged once


@pytest.mark.slow
def test_guard_gives_up_on_persistently_poisoned_batches(tmp_path, capsys):
    """Every batch from 40 on is bad (faults.poison_batches). The spike at step 40 is judged
    against steps 20-39; the rollback target, the step-20 checkpoint, holds the losses of
    steps 1-20, still falling fast, whose wide band let the poisoned losses pass as normal:
    the model trained on them (loss 4.6 -> 0.19) and exited 0. The guard keeps the
    pre-incident baseline instead, so every retry spikes again, and after max_retries it
    gives up: exit 3, one clear line, the step-20 checkpoint intact."""
    from pathlib import Path

    from adamspike.rundir import load_run

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "run"
    proc = _train_here(
        capsys, out, "--config", str(root / "configs" / "tiny.toml"),
        "--train.num_steps", "60", "--checkpoint.every", "20",
        "--telemetry.enabled", "false", "--guard.enabled", "true", "--guard.window", "20",
        "--guard.max_retries", "2", "--faults.poison_batches", "40,100000")
    assert proc.returncode == 3, proc.stderr[-3000:]
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("adamspike train")]
    assert len(err) == 1 and "spike guard gave up" in err[0] and "step-00000020" in err[0], err
    assert "Traceback" not in proc.stderr
    run = load_run(out, tables=("steps",))
    ev = run.events
    spikes = ev[ev["type"] == "spike"]
    assert len(spikes) == 3                                 # the first one + max_retries = 2
    assert spikes["baseline"].nunique() == 1                # the same pre-incident band
    assert ev["type"].tolist().count("abort") == 1
    assert [s for s, _ in checkpoint.complete(out / "checkpoints")] == [20]
    checkpoint.verify(checkpoint.step_dir(out / "checkpoints", 20))
    assert run.steps["step"].max() == 39                    # no poisoned batch trained on
