"""The trainer under injected faults and broken state (in-process, tiny model): a NaN
gradient rolls back and recovers, a run whose state ends non-finite exits 3 with one line,
a corrupt RNG file in the newest checkpoint falls back to the previous one and says so."""

from __future__ import annotations

import json
import shutil

import pytest

from adamspike.rundir import load_run
from fullscale import checkpoint as ck
from fullscale.train import main

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = ["--model.preset", "tiny", "--train.global_batch_size", "8", "--train.seq_len", "32",
        "--optim.lr", "3e-3", "--telemetry.enabled", "false"]


def _lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("train:")
            and "step/s" not in ln]


def test_nan_gradient_rolls_back_and_recovers(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["--out", str(out), *TINY, "--train.num_steps", "12", "--checkpoint.every", "4",
               "--guard.enabled", "true", "--guard.window", "4", "--guard.skip_batches", "2",
               "--faults.nan_grad_at_step", "6"])
    assert rc == 0, capsys.readouterr().err
    run = load_run(out, tables=("steps",))
    ev = run.events
    assert ev.query("type == 'fault_injected'")[["step", "fault"]].values.tolist() == [[6, "nan_grad"]]
    bad = ev.query("type == 'nonfinite_loss'")
    assert bad["step"].tolist() == [7]                     # the NaN update shows in step 7's loss
    rb = ev.query("type == 'rollback'").iloc[0]
    assert (rb["from_step"], rb["to_step"]) == (7, 4)
    assert run.steps["step"].tolist() == list(range(1, 13))
    assert run.steps["loss"].notna().all()                 # the trace is the final trajectory's


def test_nonfinite_state_at_the_end_exits_3_with_one_line(tmp_path, capsys):
    """The last update is NaN (its loss was finite): the final checkpoint is refused, and
    the run says so and exits 3 (it used to log "checkpoint_refused" only and exit 0)."""
    out = tmp_path / "run"
    rc = main(["--out", str(out), *TINY, "--train.num_steps", "2",
               "--faults.nan_grad_at_step", "2"])
    err = capsys.readouterr().err
    assert rc == 3 and "Traceback" not in err
    (line,) = _lines(err)
    assert line.startswith("adamspike train: aborted: non-finite model/optimizer state at step 2")
    types = load_run(out, tables=()).events["type"].tolist()
    assert "checkpoint_refused" in types and types.count("abort") == 1
    assert ck.complete(out / "checkpoints") == []


def test_corrupt_rng_file_with_a_matching_hash_falls_back(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--out", str(out), *TINY, "--train.num_steps", "4",
                 "--checkpoint.every", "2"]) == 0
    ref = load_run(out, tables=("steps",)).steps
    # The newest checkpoint's rng file is garbage, and its manifest agrees (hash and size
    # match): only reading it shows the damage.
    newest = ck.step_dir(out / "checkpoints", 4)
    rng = newest / "rng-00000.pt"
    rng.write_bytes(b"\x80garbage" * 10)
    manifest = json.loads((newest / "COMPLETE").read_text())
    manifest["files"][rng.name] = {"size": rng.stat().st_size, "sha256": ck._sha256(rng)}
    (newest / "COMPLETE").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(["--out", str(out), *TINY, "--train.num_steps", "4", "--checkpoint.every", "2",
                 "--resume"]) == 0
    (line,) = _lines(capsys.readouterr().err)
    assert "rng-00000.pt is unreadable" in line and "falling back to" in line
    assert line.endswith("step-00000002")
    run = load_run(out, tables=("steps",))
    assert run.events.query("type == 'resume'")["step"].tolist() == [2]
    rej = run.events.query("type == 'checkpoint_rejected'").iloc[0]
    assert "rng-00000.pt" in rej["problem"]
    assert run.steps["loss"].tolist() == ref["loss"].tolist()   # steps 3-4 re-run, bitwise


@pytest.mark.parametrize("stop", ["fault", "abort"])
def test_a_stopping_run_logs_its_pending_async_save_before_why_it_stops(tmp_path, capsys,
                                                                       monkeypatch, stop):
    """The run fails (a collective's error: 'fault') or aborts at step 3 while the step-2
    async save is still pending: the save completes on the way out and its "checkpoint"
    event comes before the fault / abort, which stays the last event (it used to come
    after: the 2-rank hung-async-save rank-failure test under load)."""
    from fullscale.train import Trainer, TrainingAborted

    inject = Trainer._inject_before

    def fail_at_3(self, step):
        if step == 3:
            assert self.ckpt._pending is not None       # the step-2 save is in flight
            if stop == "fault":
                raise RuntimeError("Timed out waiting 10000ms for recv operation to complete")
            raise TrainingAborted("stopped by the test")
        inject(self, step)

    monkeypatch.setattr(Trainer, "_inject_before", fail_at_3)
    out = tmp_path / "run"
    args = ["--out", str(out), *TINY, "--train.num_steps", "4", "--checkpoint.every", "2",
            "--checkpoint.async_save", "true"]
    if stop == "fault":
        with pytest.raises(RuntimeError, match="Timed out waiting"):
            main(args)
    else:
        assert main(args) == 3, capsys.readouterr().err
    ev = load_run(out, tables=()).events
    assert ev["type"].iloc[-1] == stop, ev.tail()
    assert ev.query("type == 'checkpoint'")["step"].tolist() == [2]
    assert [s for s, _ in ck.complete(out / "checkpoints")] == [2]


def test_a_peer_lost_after_a_checkpoint_is_marked_still_logs_it(tmp_path, capsys, monkeypatch):
    """The closing barrier of the step-2 save fails (a peer hung or died after rank 0 marked
    it complete): step 2 is complete on disk and its "checkpoint" event comes before the
    fault (it was never logged: the 2-rank hung test left a complete checkpoint without
    one)."""
    out = tmp_path / "run"
    marked = out / "checkpoints" / "step-00000002" / ck.MARKER
    barrier = ck._barrier

    def lost_peer():
        if marked.exists():
            raise RuntimeError("Timed out waiting 10000ms for recv operation to complete")
        barrier()

    monkeypatch.setattr(ck, "_barrier", lost_peer)
    with pytest.raises(RuntimeError, match="Timed out waiting"):
        main(["--out", str(out), *TINY, "--train.num_steps", "4", "--checkpoint.every", "1"])
    ev = load_run(out, tables=()).events
    assert ev["type"].iloc[-1] == "fault", ev.tail()
    assert ev.query("type == 'checkpoint'")["step"].tolist() == [1, 2]
    assert [s for s, _ in ck.complete(out / "checkpoints")] == [1, 2]
