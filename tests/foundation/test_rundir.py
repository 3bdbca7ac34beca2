import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from unittest import mock

import numpy as np
import pytest

from adamspike.metrics import METRIC_NAMES, NUM_HIST_BINS
from adamspike.rundir import (LOCK_FILE, SCHEMA_VERSION, RunFormatError, RunLock,
                              RunLockedError, RunWriter, load_run)


def step_row(step, loss=1.0):
    return dict(step=step, tokens=step * 64, loss=loss, lr=1e-3, grad_norm=0.5, clipped=False,
                update_norm=0.1, step_time_s=0.01, skipped=False)


def layer_rows(step, names=("tok_embeddings.weight", "layers.0.attention.wq.weight")):
    rows = []
    for i, n in enumerate(names):
        r = {"name": n, "depth": i - 1, "kind": "embed" if i == 0 else "wq", "numel": 100}
        r.update({m: float(step + i) for m in METRIC_NAMES})
        rows.append(r)
    return rows


def test_roundtrip(tmp_path):
    run = tmp_path / "run"
    with RunWriter(run, backend="jax", config={"optim": {"eps": 1e-8}}) as w:
        for s in range(1, 6):
            w.log_step(**step_row(s, loss=1.0 / s))
            w.log_layers(s, layer_rows(s))
            w.log_hist(s, "layers.0.attention.wq.weight", 0, "wq", np.arange(NUM_HIST_BINS))
        w.event("checkpoint", step=5, path="x")
    r = load_run(run)
    assert r.meta["schema_version"] == SCHEMA_VERSION and r.backend == "jax"
    assert r.config["optim"]["eps"] == 1e-8
    assert list(r.steps.step) == [1, 2, 3, 4, 5]
    np.testing.assert_allclose(r.steps.loss, [1, 1 / 2, 1 / 3, 1 / 4, 1 / 5])
    assert len(r.layers) == 10 and set(r.layers.name) == {"tok_embeddings.weight",
                                                          "layers.0.attention.wq.weight"}
    assert r.layers.query("step == 3 and depth == 0").grad_rms.item() == 4.0
    assert len(r.hists) == 5 and list(r.hists.counts.iloc[0]) == list(range(NUM_HIST_BINS))
    assert r.events.type.tolist() == ["checkpoint"]
    assert len(r.hist_edges) == NUM_HIST_BINS + 1


def test_columnar_layers(tmp_path):
    with RunWriter(tmp_path / "r", backend="torch") as w:
        cols = {"name": ["a", "b"], "depth": [0, 1], "kind": ["wq", "wk"], "numel": [4, 4]}
        cols.update({m: np.array([0.5, 1.5]) for m in METRIC_NAMES})
        w.log_layers(7, columns=cols)
        w.log_step(**step_row(7))
    r = load_run(tmp_path / "r")
    assert r.layers.step.tolist() == [7, 7] and r.layers.rho.tolist() == [0.5, 1.5]


def test_refuses_to_overwrite(tmp_path):
    run = tmp_path / "run"
    with RunWriter(run, backend="jax") as w:
        w.log_step(**step_row(1))
    before = (run / "run.json").read_bytes()
    with pytest.raises(RunFormatError, match="exists"):
        RunWriter(run, backend="jax")
    assert (run / "run.json").read_bytes() == before
    assert load_run(run).steps.step.tolist() == [1]


def test_missing_columns_named(tmp_path):
    with RunWriter(tmp_path / "r", backend="jax") as w:
        with pytest.raises(RunFormatError, match="grad_norm"):
            row = step_row(1)
            del row["grad_norm"]
            w.log_step(**row)


def test_resume_truncates_without_duplicates(tmp_path):
    run = tmp_path / "run"
    with RunWriter(run, backend="torch", flush_every_rows=3) as w:
        for s in range(1, 11):
            w.log_step(**step_row(s, loss=float(s)))
            w.log_layers(s, layer_rows(s))
    # resume from step 6: rows 7..10 are dropped and rewritten with new values
    with RunWriter(run, backend="torch", resume_from_step=6, flush_every_rows=3) as w:
        for s in range(7, 13):
            w.log_step(**step_row(s, loss=100.0 + s))
            w.log_layers(s, layer_rows(s))
    r = load_run(run)
    assert r.steps.step.tolist() == list(range(1, 13))
    assert r.steps.loss.tolist() == [float(s) for s in range(1, 7)] + [100.0 + s for s in range(7, 13)]
    assert len(r.layers) == 24 and not r.layers.duplicated(["step", "name"]).any()
    assert r.events.type.tolist() == ["resume"] and r.events.step.tolist() == [6]


def test_resume_wrong_backend(tmp_path):
    with RunWriter(tmp_path / "r", backend="jax") as w:
        w.log_step(**step_row(1))
    with pytest.raises(RunFormatError, match="backend"):
        RunWriter(tmp_path / "r", backend="torch", resume_from_step=1)


@pytest.mark.parametrize("case", ["missing", "empty", "schema", "badjson"])
def test_bad_run_dirs(tmp_path, case):
    d = tmp_path / "r"
    if case != "missing":
        d.mkdir()
    if case == "schema":
        (d / "run.json").write_text(json.dumps({"schema_version": 999, "backend": "jax"}))
    if case == "badjson":
        (d / "run.json").write_text("{not json")
    with pytest.raises(RunFormatError, match={"missing": "does not exist", "empty": "no run.json",
                                              "schema": "schema_version 999",
                                              "badjson": "invalid JSON"}[case]):
        load_run(d)


def test_torn_event_line_is_counted(tmp_path):
    with RunWriter(tmp_path / "r", backend="jax") as w:
        w.event("alarm", step=3, rule="rms_t")
    with open(tmp_path / "r" / "events.jsonl", "a") as fh:
        fh.write('{"type": "checkp')
    r = load_run(tmp_path / "r")
    assert r.events.type.tolist() == ["alarm"] and r.torn_event_lines == 1


WRITER = textwrap.dedent("""
    import sys, time
    from adamspike.rundir import RunWriter
    w = RunWriter(sys.argv[1], backend="jax", flush_every_rows=5, flush_every_s=1e9)
    s = 0
    while True:
        s += 1
        w.log_step(step=s, tokens=s, loss=1.0, lr=1.0, grad_norm=1.0, clipped=False,
                   update_norm=1.0, step_time_s=0.0, skipped=False)
        if s % 5 == 0:
            print(s, flush=True)
        time.sleep(0.001)
""")


def test_kill_9_loses_at_most_last_flush(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(run)], stdout=subprocess.PIPE,
                            text=True)
    flushed = 0
    deadline = time.time() + 60
    while flushed < 40 and time.time() < deadline:
        flushed = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    steps = load_run(run).steps.step.tolist()
    # every reported flush is on disk, contiguous from 1; nothing half-written is visible
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= flushed
    assert not any(p.name.endswith(".parquet") and p.name.startswith(".")
                   for p in (run / "steps").iterdir() if p.suffix == ".parquet")


def test_vhists_parts_without_the_later_g_below_eps_column_read_as_nulls(tmp_path):
    import pandas as pd
    import pyarrow as pa

    from adamspike.metrics import NUM_VHIST_BINS
    from adamspike.rundir import _atomic_write_table
    with RunWriter(tmp_path / "r", backend="jax", config={}, env={}) as w:
        w.log_vhist(10, "a", 0, "param", [1] * NUM_VHIST_BINS, 3)
    old = pa.table({"step": [20], "name": ["a"], "depth": pa.array([0], pa.int32()),
                    "kind": ["param"], "counts": [[2] * NUM_VHIST_BINS]})
    _atomic_write_table(tmp_path / "r" / "vhists" / "part-000001.parquet", old)
    vh = load_run(tmp_path / "r", tables=("vhists",)).vhists
    assert list(vh["step"]) == [10, 20]
    assert vh["g_below_eps"].iloc[0] == 3 and pd.isna(vh["g_below_eps"].iloc[1])


# ----------------------------------------------------------------------------- ownership

def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_lock_is_exclusive_and_a_stale_one_is_taken_over(tmp_path):
    run = tmp_path / "run"
    w = RunWriter(run, backend="jax")
    rec = json.loads((run / LOCK_FILE).read_text())
    assert rec["pid"] == os.getpid() and rec["flock"] is True
    code = ("import sys; from adamspike.rundir import RunLock, RunLockedError\n"
            "try: RunLock(sys.argv[1]).acquire(new=False)\n"
            "except RunLockedError as e: print(e); sys.exit(2)")
    other = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True)
    assert other.returncode == 2 and f"pid {os.getpid()} on host" in other.stdout
    w.close()
    assert (run / LOCK_FILE).read_text() == ""          # released: no stale record left
    # A writer killed while holding it leaves its record; the flock itself is free.
    (run / LOCK_FILE).write_text(json.dumps({"host": "h", "pid": _dead_pid(), "since": "t"}))
    w = RunWriter(run, backend="jax", resume_from_step=0)
    assert w.lock.stale["host"] == "h"
    w.close()
    ev = load_run(run, tables=()).events
    assert ev["type"].tolist()[-1] == "lock_taken_over" and ev["previous"].iloc[-1]["host"] == "h"
    # Without flock (some network file systems) the record decides: a live pid on this host
    # holds the directory, a dead one does not.
    def no_flock(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    with mock.patch.object(fcntl, "flock", no_flock):
        host = socket.gethostname()
        (run / LOCK_FILE).write_text(json.dumps({"host": host, "pid": os.getppid(), "since": "t"}))
        with pytest.raises(RunLockedError, match=f"pid {os.getppid()}"):
            RunLock(run).acquire(new=False)
        (run / LOCK_FILE).write_text(json.dumps({"host": host, "pid": _dead_pid(), "since": "t"}))
        lock = RunLock(run).acquire(new=False)
        assert lock.stale is not None and json.loads((run / LOCK_FILE).read_text())["flock"] is False
        lock.release()


def test_new_run_paths_and_resume_truncation_of_events(tmp_path):
    (tmp_path / "afile").write_text("x")
    for bad, msg in ((tmp_path / "afile", "is a file"), (tmp_path / "afile" / "sub", "is a file")):
        with pytest.raises(RunFormatError, match=msg):
            RunWriter(bad, backend="jax")
    assert (tmp_path / "afile").read_text() == "x"
    run = tmp_path / "run"
    with RunWriter(run, backend="jax", flush_every_s=1e9) as w:
        for s in (1, 2, 3):
            w.log_step(**step_row(s))
            w.event("alarm", step=s, rule="r")
        w.event("fault", step=3, error="x")
    (run / "steps" / ".part-000009.parquet.tmp-123").write_bytes(b"half")   # a killed flush
    with RunWriter(run, backend="jax", resume_from_step=1) as w:
        pass
    run_ = load_run(run)
    assert run_.steps["step"].tolist() == [1]
    ev = run_.events
    assert ev.query("type == 'alarm'")["step"].tolist() == [1]
    assert "fault" in set(ev["type"])                     # lifecycle events stay
    assert ev.query("type == 'resume'")["discarded_events"].tolist() == [2]
    assert len((run / "events.discarded.jsonl").read_text().splitlines()) == 2
    assert not list((run / "steps").glob(".*.tmp-*"))


def test_append_event_starts_its_own_line_after_a_torn_one(tmp_path):
    """An event appended without a writer (a signal inside a resume's checkpoint load)
    after a torn last line: the fragment stays a line of its own (skipped and counted on
    read) and the new event is read whole; an intact file gets no blank line."""
    from adamspike.rundir import append_event, read_events

    append_event(tmp_path, "start", step=0)
    append_event(tmp_path, "checkpoint", step=4, path="x")     # a field named path
    with open(tmp_path / "events.jsonl", "ab") as fh:
        fh.write(b'{"time": 1, "type": "spi')                  # killed mid-line
    append_event(tmp_path, "fault", step=None, signal="SIGINT")
    lines = (tmp_path / "events.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b"" and b"" not in lines[:-1]
    ev, torn = read_events(tmp_path)
    assert list(ev["type"]) == ["start", "checkpoint", "fault"] and torn == 1
    assert ev["path"].iloc[1] == "x" and ev["signal"].iloc[2] == "SIGINT"


def test_a_read_outliving_a_rollback_and_its_rerun_is_one_moment(tmp_path, monkeypatch):
    """The live-read race of tests/fullscale/test_faults_part2.py made deterministic: a
    reader takes flushed.json's cut (step 6), reads the steps table, and before it reads
    the layers table the writer rolls back to step 4 and re-runs to step 6 again. flushed.json
    says 6 again, so a bound on the step alone took the re-run's layers with the first
    trajectory's steps; the cut's part files keep the read to one trajectory."""
    import adamspike.rundir as rd
    run = tmp_path / "run"
    w = RunWriter(run, backend="torch", config={}, flush_every_s=1e9)

    def step(s: int, v: float) -> None:
        w.log_step(step=s, tokens=s, loss=v, lr=1.0, grad_norm=1.0, clipped=False,
                   update_norm=1.0, step_time_s=0.0, skipped=False)
        w.log_layers(s, [{"name": "t", "depth": 0, "kind": "param", "numel": 1, "rho": v}])
        w.flush()

    for s in range(1, 7):
        step(s, float(s))
    read_table = rd._read_table
    moved = []

    def read_then_move(path, table, *a, **kw):
        df = read_table(path, table, *a, **kw)
        if table == "steps" and not moved:        # the writer moves between two tables
            w.rewind(4)
            for s in (5, 6):
                step(s, 1000.0 + s)
            moved.append(True)
        return df

    monkeypatch.setattr(rd, "_read_table", read_then_move)
    r = rd.load_run(run, tables=("steps", "layers"))
    assert r.snapshot_step == 6 and r.steps["loss"].tolist() == [1, 2, 3, 4, 5, 6]
    assert r.layers["rho"].tolist() == r.steps["loss"].tolist()
    monkeypatch.setattr(rd, "_read_table", read_table)
    again = rd.load_run(run, tables=("steps", "layers"))       # the next read: the re-run
    assert again.steps["loss"].tolist() == again.layers["rho"].tolist() == [1, 2, 3, 4, 1005, 1006]
    w.close()
