"""`adamspike reproduce` on a shared machine (issue 40, defects 3 and 4), with real
processes: one writer per study folder, stages that die with reproduce (SIGTERM: their
process groups; kill -9: the guard leading each stage's group, told by PR_SET_PDEATHSIG,
kills the group, the stage's own workers too), a kill -9 inside each kind of stage that
--resume finishes (a run stage: its partial run set aside; a cell stage: only the missing
cells computed; a report stage: its partial output set aside, no orphan worker), and torn
stage marks that rerun their stage."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from study import reproduce

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _start(out: Path, study: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "study", "reproduce", "--study", str(study),
                             "--out", str(out), "--jobs", "2", *extra], env=ENV, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name: state, ppid, pgrp, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _live(pick) -> set[int]:
    """Live (not zombie) processes for which pick(their /proc folder, stat fields) holds."""
    found = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = _stat(int(d.name))
                if fields[0] != "Z" and pick(d, fields):
                    found.add(int(d.name))
            except OSError:     # gone while read
                continue
    return found


def _pids_with(text: str) -> set[int]:
    """Live processes whose command line holds `text`."""
    return _live(lambda d, _: text in (d / "cmdline").read_bytes().replace(
        b"\0", b" ").decode(errors="replace"))


def _group_of(pid: int) -> int:
    return int(_stat(pid)[2])


def _pids_in_group(pgid: int) -> set[int]:
    """Live processes of process group `pgid`."""
    return _live(lambda _, fields: int(fields[2]) == pgid)


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_one_writer_and_stages_die_with_reproduce(tmp_path):
    """Two `watch` stages (they follow a log until stopped): a second reproduce on the live
    folder is refused in one line; SIGTERM to reproduce stops both stages (exit 143, one
    line); kill -9 of a resumed reproduce kills its stages too (PDEATHSIG)."""
    out = tmp_path / "study"
    log = tmp_path / "job.log"
    log.write_text("")
    study = tmp_path / "study.toml"
    study.write_text("".join(f'[stages.w{i}]\nargs = ["watch", "--poll", "0.2", "{log}"]\n'
                             for i in (1, 2)))
    a = _start(out, study)
    try:
        stages = _wait(lambda: len(_pids_with(f"watch --poll 0.2 {log}")) == 2
                       and _pids_with(f"watch --poll 0.2 {log}"), 120, "both stages")
        b = subprocess.run([sys.executable, "-m", "study", "reproduce", "--study", str(study),
                            "--out", str(out), "--resume"], env=ENV, cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert b.returncode == 2, b.stderr
        assert len(b.stderr.strip().splitlines()) == 1 and "in use by another writer" in b.stderr
        assert f"pid {a.pid}" in b.stderr or str(a.pid) in b.stderr
        assert _pids_with(f"watch --poll 0.2 {log}") == stages     # untouched
        a.send_signal(signal.SIGTERM)
        rc = a.wait(60)
        err = a.stderr.read()
        assert rc == 128 + signal.SIGTERM, err
        assert "interrupted by SIGTERM; stopped 2 running stage(s)" in err
        assert not _pids_with(f"watch --poll 0.2 {log}")
        assert not (out / ".stages" / "w1.json").exists()

        c = _start(out, study, "--resume")         # the lock was released: it may resume
        _wait(lambda: len(_pids_with(f"watch --poll 0.2 {log}")) == 2, 120, "resumed stages")
        c.kill()                                    # kill -9: no handler runs
        c.wait(30)
        _wait(lambda: not _pids_with(f"watch --poll 0.2 {log}"), 10, "orphans to die")
    finally:
        for p in [a] + ([c] if "c" in locals() else []):
            if p.poll() is None:
                p.kill()
        for pid in _pids_with(f"watch --poll 0.2 {log}"):
            os.kill(pid, signal.SIGKILL)


def test_run_stage_killed_mid_way_resumes(tmp_path):
    """The quick study's quadratic stage killed with kill -9 once its run.json exists:
    --resume sets the partial run aside (one line) and reruns the stage; the rerun's rows
    start as the killed attempt's did (deterministic), and a second --resume does nothing."""
    out = tmp_path / "Q"
    cmd = [sys.executable, "-m", "study", "reproduce", "--quick", "--jobs", "1",
           "--only", "quadratic_spike", "--out", str(out)]
    a = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    run = out / "runs" / "quadratic_eps1e-8"
    try:
        _wait(lambda: (run / "run.json").exists() or a.poll() is not None, 240, "run.json")
        assert a.poll() is None, "the stage finished before the kill"
        a.kill()
        a.wait(30)
    finally:
        if a.poll() is None:
            a.kill()
    _wait(lambda: not _pids_with(str(run)), 10, "the stage to die with reproduce")
    r = subprocess.run(cmd + ["--resume"], env=ENV, cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "quadratic_spike: an interrupted attempt left runs/quadratic_eps1e-8; moved to " \
           ".stale/quadratic_spike-0/" in r.stderr
    stale = out / ".stale" / "quadratic_spike-0" / "runs" / "quadratic_eps1e-8"
    assert (stale / "run.json").exists()
    res = json.loads((out / "stages.json").read_text())
    assert [(s["name"], s["status"]) for s in res] == [("quadratic_spike", "ok")]
    new = pd.read_parquet(run / "steps")
    old = pd.read_parquet(stale / "steps") if any((stale / "steps").iterdir()) else new.iloc[:0]
    assert len(new) > len(old)
    pd.testing.assert_frame_equal(new.iloc[:len(old)].reset_index(drop=True)[["step", "loss"]],
                                  old.reset_index(drop=True)[["step", "loss"]])
    again = subprocess.run(cmd + ["--resume"], env=ENV, cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0 and "rerunning" not in again.stderr
    assert not (out / ".stale" / "quadratic_spike-1").exists()


@pytest.mark.parametrize("damage", ["torn", "flip", "empty", "not-ok"])
def test_torn_stage_mark_reruns_its_stage(tmp_path, monkeypatch, capsys, damage):
    ran = []

    def fake_run(st, out, env):
        ran.append(st.name)
        return {"name": st.name, "title": st.title, "status": "ok", "returncode": 0,
                "seconds": 0.0, "log": "", "missing_outputs": [], "argv": st.argv}

    monkeypatch.setattr(reproduce, "_run_stage", fake_run)
    plan = [reproduce.Stage("a", "t", []), reproduce.Stage("b", "t", [], needs=["a"])]
    marks = tmp_path / ".stages"
    marks.mkdir()
    reproduce._schedule(plan, tmp_path, {}, marks, resume=False, jobs=1)
    assert ran == ["a", "b"] and reproduce.read_mark(marks, "a")["status"] == "ok"
    mark = marks / "a.json"
    text = mark.read_text()
    mark.write_text({"torn": text[:len(text) // 2], "flip": text.replace('"returncode": 0', '"returncode": 1'),
                     "empty": "", "not-ok": text.replace('"ok"', '"failed"')}[damage])
    ran.clear()
    capsys.readouterr()
    res = reproduce._schedule(plan, tmp_path, {}, marks, resume=True, jobs=1)
    assert ran == ["a"] and [r["status"] for r in res] == ["ok", "ok"]
    err = [l for l in capsys.readouterr().err.splitlines() if "rerunning" in l]
    assert len(err) == 1 and f"{mark}:" in err[0] and "rerunning stage a" in err[0]
    assert reproduce.read_mark(marks, "a") is not None          # rewritten whole


# ------------------------------------------------ kill -9 inside a cell stage and a report stage
def _reproduce(out: Path, study: Path, *extra: str) -> subprocess.Popen:
    """reproduce in its own process group (the test kills that whole group with -9)."""
    return subprocess.Popen([sys.executable, "-m", "study", "reproduce", "--study", str(study),
                             "--out", str(out), "--jobs", "1", *extra], env=ENV, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _kill_group_when(a: subprocess.Popen, cond, what: str) -> None:
    """kill -9 reproduce's process group once cond() holds (the stage is mid-way)."""
    try:
        _wait(lambda: cond() or a.poll() is not None, 300, what)
        assert a.poll() is None, "the study finished before the kill: " + a.stderr.read()[-2000:]
        os.killpg(a.pid, signal.SIGKILL)
        a.wait(30)
    finally:
        if a.poll() is None:
            a.kill()


def _finish(out: Path, study: Path, *extra: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "study", "reproduce", "--study", str(study),
                        "--out", str(out), "--jobs", "1", *extra], env=ENV, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _stamp(p: Path) -> tuple:
    st = p.stat()
    return st.st_ino, st.st_mtime_ns, p.read_bytes()


FIRST_STAGE = '[stages.info]\nargs = ["model", "info", "--config", "tiny", "--json"]\n' \
              'stdout_to = "info.json"\noutputs = ["info.json"]\n\n'


@pytest.mark.slow
def test_cell_stage_killed_mid_way_resumes_without_recomputing_stored_cells(tmp_path):
    """A sweep stage (simulate.sweep.run_cells: one cell file per finished cell) killed with
    kill -9 of reproduce's process group after its first cell is stored, the second still
    computing: the stage dies with it; --resume computes only the missing cell (the stored
    one keeps its inode, time and bytes; the finished stage before it is not rerun) and the
    sweep's tables are byte-identical to an uninterrupted study's."""
    grid = tmp_path / "grid.toml"
    grid.write_text('[sweep]\nproblem = "quadratic"\nseeds = 2\n\n[fixed]\nquadratic.lam_min = 1.0\n'
                    'quadratic.lam_max = 1.0\nquadratic.noise = 1e-9\n\n[grid]\n'
                    # two static groups, run in this order: a short one, then a long one
                    'train.num_steps = [300, 400000]\noptim.eps = [1e-8]\n')
    study = tmp_path / "study.toml"
    study.write_text(FIRST_STAGE + f'[stages.sweep]\nargs = ["sweep", "run", "--grid", "{grid}", '
                     '"--out", "{out}/sweep", "--no-progress"]\nafter = ["info"]\n'
                     'outputs = ["sweep/runs.csv"]\n')
    ref = tmp_path / "ref"
    _finish(ref, study)
    out = tmp_path / "study"
    cells = out / "sweep" / "cells"
    a = _reproduce(out, study)
    # a stored cell of the one store: its JSON (written last, after its tables)
    def done_cells():
        return sorted(p for p in cells.rglob("*.json") if not p.name.endswith(".prov.json"))
    _kill_group_when(a, lambda: cells.is_dir() and bool(done_cells()), "the first stored cell")
    _wait(lambda: not _pids_with(str(out / "sweep")), 10, "the stage to die with reproduce")
    stored = sorted(p for p in cells.rglob("*") if p.is_file())
    assert len(done_cells()) == 1 and not (out / "sweep" / "runs.csv").exists()
    assert not (out / ".stages" / "sweep.json").exists()
    before = {p: _stamp(p) for p in stored + [out / "info.json", out / "logs" / "info.log"]}
    _finish(out, study, "--resume")
    for p in stored + [out / "info.json", out / "logs" / "info.log"]:
        assert _stamp(p) == before[p], f"{p} was written again"
    res = json.loads((out / "stages.json").read_text())
    assert [(s["name"], s["status"]) for s in res] == [("info", "ok"), ("sweep", "ok")]
    for rel in ("sweep/runs.csv", "sweep/runs.parquet",
                *(p.relative_to(ref).as_posix() for p in sorted((ref / "sweep" / "cells").rglob("*"))
                  # provenance (host, time) differs by nature; the cells' content may not
                  if p.is_file() and not p.name.endswith(".prov.json"))):
        assert (out / rel).read_bytes() == (ref / rel).read_bytes(), rel


@pytest.mark.slow
def test_report_stage_killed_mid_way_resumes_with_no_orphan(tmp_path):
    """An analyze stage with --jobs 2 (its runs in pool worker processes, forked from a
    forkserver) killed with kill -9 of reproduce's process group once the small run's tables
    exist and the large run's worker still computes: no stage process, forkserver or worker
    survives (pool workers of a dead parent otherwise wait forever on its queue, ppid 1);
    --resume sets the partial analysis aside in one line, reruns only that stage, and its
    tables are byte-identical to an uninterrupted study's."""
    from analysis.synthetic import write_synthetic_run
    small = write_synthetic_run(tmp_path / "runs" / "small", num_steps=200, spikes=(100,))
    large = write_synthetic_run(tmp_path / "runs" / "large", num_steps=6000,
                                spikes=(1000, 3000, 5000), seed=1)
    study = tmp_path / "study.toml"
    study.write_text(FIRST_STAGE + f'[stages.analyze]\nargs = ["analyze", "{small}", "{large}", '
                     '"--jobs", "2", "--no-figures", "--out", "{out}/analysis"]\n'
                     'after = ["info"]\noutputs = ["analysis"]\nfresh = ["analysis"]\n')
    ref = tmp_path / "ref"
    _finish(ref, study)
    out = tmp_path / "study"
    analysis = out / "analysis"
    a = _reproduce(out, study)
    group = []     # the stage's process group: its guard, the stage, the forkserver, workers

    def workers_running() -> bool:
        stage = _pids_with(str(analysis))    # the workers' command line is the forkserver's
        try:
            group[:] = [_group_of(min(stage))] if stage else []
        except OSError:                      # gone between the two reads
            return False
        return bool(group) and len(_pids_in_group(group[0])) >= 4

    _kill_group_when(a, lambda: (analysis / "small" / "summary.json").exists()
                     and not (analysis / "large" / "summary.json").exists()
                     and workers_running(), "the small run's tables")
    _wait(lambda: not _pids_with(str(analysis)) and not _pids_in_group(group[0]), 10,
          "the stage, its forkserver and its workers to die")
    assert not (out / ".stages" / "analyze.json").exists()
    before = {p.name: _stamp(p) for p in (out / "info.json", out / "logs" / "info.log")}
    r = _finish(out, study, "--resume")
    assert "analyze: an interrupted attempt left analysis; moved to .stale/analyze-0/" in r.stderr
    for p in (out / "info.json", out / "logs" / "info.log"):
        assert _stamp(p) == before[p.name], f"{p} was written again"
    tables = sorted(p.relative_to(ref) for p in (ref / "analysis").rglob("*.csv"))
    assert len(tables) > 5
    assert tables == sorted(p.relative_to(out) for p in analysis.rglob("*.csv"))
    for rel in tables:
        assert (out / rel).read_bytes() == (ref / rel).read_bytes(), rel
