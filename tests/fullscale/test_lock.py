"""One writer per run directory: a second trainer on a live run is refused at once (exit 2,
one line naming the holder, no traceback) and the live run is unharmed. The stale lock a
killed run leaves is taken over on --resume (tests/fullscale/test_crash.py checks the
"lock_taken_over" event after each of its kills; tests/foundation/test_rundir.py the lock
itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from adamspike.rundir import RunLockedError, RunWriter, load_run

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
TRAIN_ARGS = ["train", "--config", str(ROOT / "configs" / "tiny.toml"), "--train.num_steps", "20",
              "--checkpoint.every", "10", "--telemetry.enabled", "false"]
TRAIN = [sys.executable, "-m", "study", *TRAIN_ARGS]
# `python -m study ARGS` (study/__main__.py) once a line comes on stdin: its imports done
# first ("ready" on stdout), so the process can start alongside the live run and its
# refusal is timed without torch's imports
STUDY_ON_GO = ("import sys\nimport fullscale.train\nfrom study.cli import main\n"
               "print('ready', flush=True)\nsys.stdin.readline()\nsys.exit(main())\n")


def _lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.strip() and "step/s" not in ln
            and not ln.startswith("train:")]


@pytest.mark.slow
def test_second_writer_on_a_live_run_is_refused(tmp_path):
    live = tmp_path / "live"
    # The live run holds its lock while it waits 15 s at step 11 (faults.hang_rank_at_step;
    # a sleep, no CPU): time enough for a second process, started with it and waiting with
    # its imports done, to be refused (a second or two; it was 40 s when the second process
    # started only then, imports and all: the test then mostly waited out the sleep).
    proc = subprocess.Popen([*TRAIN, "--out", str(live), "--faults.hang_rank_at_step", "0,11",
                             "--faults.hang_s", "15"], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    second = subprocess.Popen([sys.executable, "-c", STUDY_ON_GO, *TRAIN_ARGS, "--out", str(live),
                               "--resume"], env=ENV, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        events = live / "events.jsonl"
        while not (events.is_file() and '"fault_injected"' in events.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        holder = json.loads((live / "writer.lock").read_text())
        assert holder["pid"] == proc.pid and holder["host"]
        before = sorted(p.name for p in (live / "checkpoints").iterdir())
        with pytest.raises(RunLockedError, match=f"pid {proc.pid}"):      # any RunWriter
            RunWriter(live, backend="torch", resume_from_step=10)

        assert second.stdout.readline() == "ready\n", second.communicate(timeout=120)
        t0 = time.monotonic()
        _, second_err = second.communicate("go\n", timeout=120)
        elapsed = time.monotonic() - t0
        print(f"second writer refused after {elapsed:.1f} s (its imports done before)")
        assert second.returncode == 2 and "Traceback" not in second_err, second_err[-3000:]
        (line,) = _lines(second_err)
        assert f"in use by another writer (pid {proc.pid} on host {holder['host']}" in line
        assert elapsed < 30
        assert proc.poll() is None, "the live run ended before the second writer was refused"
        assert sorted(p.name for p in (live / "checkpoints").iterdir()) == before
    finally:
        if second.poll() is None:
            second.kill()
            second.communicate()
        _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]                  # the live run is unharmed
    run = load_run(live, tables=("steps",))
    assert run.steps["step"].tolist() == list(range(1, 21))
    types = run.events["type"].tolist()
    assert types.count("start") == 1 and "resume" not in types and types[-1] == "end"
    assert (live / "writer.lock").read_text() == ""           # released
