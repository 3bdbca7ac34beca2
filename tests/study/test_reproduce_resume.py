"""`adamspike reproduce` on a shared machine (issue 40, defects 3 and 4), with real
processes: one writer per study folder, stages that die with reproduce (SIGTERM: their
process groups; kill -9: PR_SET_PDEATHSIG), a run stage killed mid-way that --resume
reruns (its partial run set aside), and torn stage marks that rerun their stage."""

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


def _pids_with(text: str) -> set[int]:
    """Live (not zombie) processes whose command line holds `text`."""
    found = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            found.add(int(d.name))
    return found


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
