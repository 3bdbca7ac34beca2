"""`adamspike watch` on real jobs and real faults, each with a real watch process (follow
with --poll 0.05 then SIGINT, or --once): a new job after a truncation or a rotation is a
new history and its spike is found; a job's start is no grad-norm spike; the probe's own
lines are events; a missing folder is an error, a missing file is waited for; hooks run
once per episode, beside the follower, killed at their timeout; iterations printed twice
are no restarts; the follower survives a directory, an unreadable file, a link loop,
binary garbage and a NUL in events.jsonl, says once what it cannot read and resumes; an
idle look at a run directory costs the same at 1 MB and 30 MB of events.jsonl."""

import errno
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from analysis.watch import MAX_LINE_BYTES, LogFollower, RunFollower, _Notes, _Stop, watch
from tests.analysis.test_watch import core_line, offline, overflow_line

ROOT = Path(__file__).resolve().parents[2]


def steady(steps, level, seed=0, spikes=None, gn=0.3):
    """Iteration lines at a flat loss level with 0.2 % noise; `spikes`: step -> factor."""
    rng = np.random.default_rng(seed)
    spikes = spikes or {}
    return [core_line(i, level * (1 + 0.002 * rng.standard_normal()) * spikes.get(i, 1.0),
                      gn * math.exp(0.03 * rng.standard_normal()))
            for i in steps]


def write(path, lines, mode="a"):
    with open(path, mode) as fh:
        fh.write("".join(ln + "\n" for ln in lines))


class Watch:
    """A `python -m study watch ... --json` process; its stdout events and stderr lines
    collected by threads."""

    def __init__(self, *args, prefix=(), poll=0.05):
        cmd = [*prefix, sys.executable, "-m", "study", "watch", *map(str, args), "--json",
               "--poll", str(poll)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.events, self.err = [], []
        self._threads = [threading.Thread(target=self._read, args=(self.proc.stdout, True)),
                         threading.Thread(target=self._read, args=(self.proc.stderr, False))]
        for t in self._threads:
            t.start()

    def _read(self, stream, is_out):
        for line in stream:
            if is_out:
                self.events.append(json.loads(line))
            else:
                self.err.append(line.rstrip("\n"))

    def wait_for(self, pred, timeout=30.0):   # generous: a loaded 2-core CI box
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if pred(self):
                return True
            assert self.proc.poll() is None, "watch ended:\n" + "\n".join(self.err)
            time.sleep(0.02)
        raise AssertionError("timed out; stderr:\n" + "\n".join(self.err)
                             + "\nevents: " + repr(self.kinds()))

    def started(self):
        self.wait_for(lambda w: any("following" in e for e in w.err))

    def has(self, kind, step=None):
        return any(e["kind"] == kind and (step is None or e["step"] == step)
                   for e in self.events)

    def said(self, text):
        return sum(text in e for e in self.err)

    def kinds(self):
        return [(e["kind"], e["step"]) for e in self.events]

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        rc = self.proc.wait(timeout=15)
        for t in self._threads:
            t.join(5)
        return rc


def run_once(*args):
    r = subprocess.run([sys.executable, "-m", "study", "watch", *map(str, args), "--once",
                        "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    return r.returncode, [json.loads(ln) for ln in r.stdout.splitlines()], r.stderr


# ------------------------------------------------------------------ a new job

@pytest.mark.parametrize("how", ["truncate", "rotate"])
def test_a_new_job_starts_a_new_history_and_its_spike_is_found(tmp_path, how):
    """An old job at loss 5 (iterations 1-120); then a new job (another run, resumed from
    its own checkpoint at 60) at loss 2 with a x1.5 spike at 70 writes the file from its
    start. Judged against the old job's history (median 5) the spike is not one; as a new
    history it is, as `analyze` finds on the new job's file alone."""
    log = tmp_path / "train.log"
    write(log, steady(range(1, 121), 5.0))
    new_job = steady(range(61, 101), 2.0, seed=1, spikes={70: 1.5})
    w = Watch(log)
    try:
        w.started()
        time.sleep(1.5)                       # the old job read (time for a loaded box)
        if how == "truncate":
            write(log, new_job, mode="w")
        else:
            os.rename(log, tmp_path / "train.log.1")
            write(log, new_job, mode="w")
        w.wait_for(lambda w: w.has("loss_spike", 70))
    finally:
        rc = w.stop()
    assert rc == 0
    assert [k for k in w.kinds() if k[0] in ("new_job", "restart", "loss_spike")] == \
        [("new_job", 61), ("loss_spike", 70)]
    assert w.said("was truncated" if how == "truncate" else "was replaced") == 1
    alone = tmp_path / "new.log"
    write(alone, new_job)
    assert offline(alone, tmp_path / "out")["loss_spike"] == [70]


def test_a_rotated_file_that_continues_the_job_keeps_the_history(tmp_path):
    log = tmp_path / "train.log"
    write(log, steady(range(1, 61), 3.0))
    w = Watch(log)
    try:
        w.started()
        time.sleep(1.5)          # the first 60 lines read (it failed at 0.4 s at load ~12)
        os.rename(log, tmp_path / "train.log.1")
        write(log, steady(range(61, 66), 3.0, seed=2, spikes={64: 1.6}), mode="w")
        w.wait_for(lambda w: w.has("loss_spike", 64))
    finally:
        assert w.stop() == 0
    assert not w.has("new_job")
    assert w.said("continues the job") == 1


def test_a_job_start_is_no_grad_norm_spike(tmp_path):
    """The grad norm of a job's first iterations moves by large factors (x5 at iteration
    2 here): the rule's default warm-up, in watch as in analyze; a later grad-norm spike is
    still found by both."""
    rng = np.random.default_rng(3)
    lines = []
    for i in range(1, 121):
        gn = {1: 2.0, 2: 10.0, 3: 6.0}.get(i, 0.5 * math.exp(0.05 * rng.standard_normal()))
        lines.append(core_line(i, 4.0 - 0.005 * i + 0.005 * rng.standard_normal(),
                               gn * (8.0 if i == 90 else 1.0)))
    log = tmp_path / "start.log"
    write(log, lines)
    rc, evs, _ = run_once(log)
    assert rc == 0
    assert [e["step"] for e in evs if e["kind"] == "grad_norm_spike"] == [90]
    assert offline(log, tmp_path / "out")["grad_norm_spike"] == [90]


# ------------------------------------------------------------------ the probe's lines

def test_the_probes_lines_are_events(tmp_path):
    """The lines fullscale.megatron_probe prints (its `_say`: `adamspike probe: ...`,
    here behind torchrun's `[default0]:` rank prefix) are events with their step."""
    p = "[default0]:adamspike probe: "
    lines = steady(range(1, 41), 3.0)
    lines.insert(0, p + "on, run directory /scratch/probe: telemetry every 10 steps, "
                       "curvature proxy off; skip-step on (budget 3) (docs/mindspeed_probe.md)")
    lines.insert(30, p + "step 30: loss spike 9.1 > threshold 3.6 (median 3): optimizer "
                         "update skipped on every rank (1 of budget 3; ADAMSPIKE_PROBE_SKIP=0 "
                         "turns skipping off)")
    lines.insert(35, p + "step 34: ALARM rms_t_shallow: rms_t = 0.0123 < 0.05 "
                         "(configs/alarms.toml)")
    lines.append(p + "disabled on every rank at step 40 (rank 3: RuntimeError: boom); "
                     "training continues without it")
    log = tmp_path / "probe.log"
    write(log, lines)
    rc, evs, err = run_once(log)
    assert rc == 0, err
    got = [(e["kind"], e["step"]) for e in evs if e["category"] == "probe"]
    assert got == [("probe_skip", 30), ("probe_alarm", 34), ("probe_disabled", 40)]
    assert "optimizer update skipped on every rank" in evs[0]["detail"]
    assert "the job runs the adamspike probe (on, run directory /scratch/probe" in err


def test_the_probe_still_prints_what_watch_recognises():
    """The wording probe_event keys on, in the probe's own `_say` calls (the lines above
    are written after them; tests/fullscale/test_megatron_probe_actions.py checks the
    probe prints them)."""
    # the probe is the package fullscale/probe/ (fullscale/megatron_probe.py: its entry shim)
    src = "\n".join(p.read_text() for p in sorted((ROOT / "fullscale" / "probe").glob("*.py")))
    assert 'print(f"adamspike probe: {msg}"' in src
    for said in ('self._say(f"step {step}: ALARM {alarm[\'rule\']}',
                 'self._say(f"step {step}: {what}: optimizer update skipped on every rank ',
                 'self._say(f"step {step}: ALARM skip budget spent',
                 'self._say(f"step {step}: {text} ({action})")',
                 'self._say(f"disabled on every rank at step {step} (rank',
                 'print(f"adamspike probe: not started', 'print(f"adamspike probe: not installed',
                 '_PROBE._say(f"on, run directory {out}'):
        assert said in src, said


# ------------------------------------------------------------------ paths

def test_a_missing_folder_is_an_error_and_a_missing_file_is_waited_for(tmp_path):
    r = subprocess.run([sys.executable, "-m", "study", "watch", str(tmp_path / "no" / "x.log")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().count("\n") == 0 and "does not exist" in r.stderr
    log = tmp_path / "later.log"
    w = Watch(log)
    try:
        w.wait_for(lambda w: w.said("does not exist (yet): waiting") == 1)
        time.sleep(0.3)
        write(log, steady(range(1, 31), 3.0, spikes={25: 2.0}))
        w.wait_for(lambda w: w.has("loss_spike", 25))
    finally:
        assert w.stop() == 0
    assert w.said("does not exist (yet)") == 1


# ------------------------------------------------------------------ hooks

def overflow_episode_log():
    """120 iterations; an fp16 overflow cascade at 60-65 (DeepSpeed OVERFLOW lines,
    loss-scale cuts, stale grad norms: 18 numerics events) and a loss spike at 100."""
    rng = np.random.default_rng(4)
    lines, scale = [], 65536.0
    gn = 0.3
    for i in range(1, 121):
        if 60 <= i <= 65:
            lines.append(overflow_line(scale, scale / 2))
            scale /= 2
            if i > 60:
                lines.append(overflow_line(scale, scale / 2))
                scale /= 2
        else:
            gn = 0.3 * math.exp(0.03 * rng.standard_normal())
        loss = 3.0 * (1 + 0.002 * rng.standard_normal()) * (2.0 if i == 100 else 1.0)
        lines.append(core_line(i, loss, gn, scale=scale))
    return lines


def hook_cmd(out):
    """A hook that appends the event it gets on stdin (JSON) to `out`."""
    return f"cat >> {shlex.quote(str(out))}"


def hooked(out):
    return [json.loads(ln) for ln in out.read_text().splitlines()] if out.exists() else []


def test_hooks_run_once_per_episode(tmp_path):
    log = tmp_path / "fp16.log"
    write(log, overflow_episode_log())
    out = tmp_path / "hooks.jsonl"
    rc, evs, err = run_once(log, "--on-event", hook_cmd(out))
    assert rc == 0, err
    numerics = [e for e in evs if e["category"] == "numerics"]
    assert len(numerics) == 18 and {e["episode"] for e in numerics} == {numerics[0]["episode"]}
    hooks = [(e["kind"], e["step"], e["episode"]) for e in hooked(out)]
    spikes = [e for e in evs if e["category"] == "spike"]
    # one hook for the overflow episode (its first event), one per spike episode
    assert len(hooks) == 1 + len({e["episode"] for e in spikes}) <= 4
    assert hooks[0] == (numerics[0]["kind"], numerics[0]["step"], numerics[0]["episode"])
    assert ("loss_spike", 100, next(e["episode"] for e in spikes if e["step"] == 100)) in hooks


def test_a_slow_hook_never_blocks_the_follower_and_is_killed_once(tmp_path):
    """A hook that would sleep 60 s: events keep coming at once, the hook is killed after
    --on-event-timeout (said once for several), and SIGINT still exits 0 promptly."""
    log = tmp_path / "live.log"
    write(log, steady(range(1, 31), 3.0))
    w = Watch(log, "--on-event", "sleep 60", "--on-event-timeout", "0.5")
    try:
        w.started()
        time.sleep(0.3)
        for s in (40, 60, 80):                 # three episodes, far apart
            write(log, steady(range(31 if s == 40 else s - 19, s), 3.0, seed=s)
                  + [core_line(s, 9.0)])
            t0 = time.monotonic()
            w.wait_for(lambda w: w.has("loss_spike", s))
            assert time.monotonic() - t0 < 1.5
        time.sleep(1.2)
    finally:
        t0 = time.monotonic()
        rc = w.stop()
    assert rc == 0 and time.monotonic() - t0 < 5
    assert w.said("--on-event ran past 0.5 s: killed") == 1
    assert any("killed" in e and "--on-event:" in e for e in w.err)   # the count at the end


def test_iterations_printed_twice_are_not_restarts(tmp_path):
    """Two ranks print every training_log line: no restart, the same events and hooks as
    the single print (the issue saw 154 hooks for 150 iterations)."""
    single = overflow_episode_log()
    twice = [ln for ln in single for _ in range(2)]
    res = {}
    for name, lines in (("single", single), ("twice", twice)):
        log = tmp_path / f"{name}.log"
        write(log, lines)
        out = tmp_path / f"{name}.hooks"
        if name == "twice":                     # the watch process
            rc, evs, err = run_once(log, "--on-event", hook_cmd(out))
            assert rc == 0, err
            assert err.count("printed again with the same values") == 1
        else:                                   # the reference, in this process
            evs = watch(log, once=True, quiet=True, on_event=hook_cmd(out))
        res[name] = ([(e["kind"], e["step"]) for e in evs], len(hooked(out)))
    assert not any(k == "restart" for k, _ in res["twice"][0])
    assert res["twice"] == res["single"]
    assert 2 <= res["single"][1] <= 4


# ------------------------------------------------------------------ a follower that never dies

def test_the_log_replaced_by_a_directory_and_a_link_loop(tmp_path):
    log = tmp_path / "train.log"
    write(log, steady(range(1, 41), 3.0))
    w = Watch(log)
    try:
        w.started()
        time.sleep(0.3)
        os.rename(log, tmp_path / "train.log.1")
        log.mkdir()
        w.wait_for(lambda w: w.said("cannot read") == 1)
        time.sleep(0.3)                               # many looks: said once
        log.rmdir()
        os.symlink(log, log)                          # a link to itself: ELOOP
        w.wait_for(lambda w: w.said("cannot read") == 2)
        time.sleep(0.3)
        log.unlink()
        write(log, steady(range(41, 61), 3.0, seed=5, spikes={55: 2.0}), mode="w")
        w.wait_for(lambda w: w.has("loss_spike", 55))
        assert w.said("can be read: following it") == 1
    finally:
        assert w.stop() == 0
    assert w.said("cannot read") == 2
    assert any("Is a directory" in e for e in w.err)
    assert any("symbolic links" in e for e in w.err)
    assert not w.has("new_job")                       # 41 continues 40


def _unreadable_prefix():
    """How this test makes a file unreadable to the watcher: as root, the watcher runs
    without the capabilities that let root read any file (setpriv) and the file belongs to
    another user, mode 0600 (logrotate's `create 0600 user`); otherwise mode 0."""
    if os.geteuid() != 0:
        return (), lambda p: os.chmod(p, 0)
    if not shutil.which("setpriv"):
        pytest.skip("root without setpriv: cannot make a file unreadable to the watcher")

    def hide(p):
        os.chown(p, 65534, 65534)
        os.chmod(p, 0o600)
    return ("setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"), hide


def test_unreadable_at_start_and_rotated_to_an_unreadable_file(tmp_path):
    """Unreadable at start: said once, read when it can be; rotated to a file created
    0600 for another user: said once more, resumed when readable; `--once` on an unreadable
    log is an error in one line."""
    prefix, hide = _unreadable_prefix()
    log = tmp_path / "train.log"
    write(log, steady(range(1, 41), 3.0, spikes={30: 2.0}))
    hide(log)
    w = Watch(log, prefix=prefix)
    try:
        w.wait_for(lambda w: w.said("Permission denied") == 1)
        time.sleep(0.3)                                # many looks: said once
        os.chmod(log, 0o644)
        w.wait_for(lambda w: w.has("loss_spike", 30))
        os.rename(log, tmp_path / "train.log.1")
        write(log, [], mode="w")
        hide(log)
        w.wait_for(lambda w: w.said("Permission denied") == 2)
        write(log, steady(range(41, 61), 3.0, seed=6, spikes={50: 2.0}))
        time.sleep(0.3)                                # still unreadable: said once
        os.chmod(log, 0o644)
        w.wait_for(lambda w: w.has("loss_spike", 50))
    finally:
        assert w.stop() == 0
    assert w.said("Permission denied") == 2 and w.said("can be read: following it") == 2
    assert not w.has("new_job")                        # 41 continues 40
    hide(log)
    r = subprocess.run([*prefix, sys.executable, "-m", "study", "watch", str(log), "--once"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Permission denied" in r.stderr


def test_binary_garbage_and_a_line_without_end(tmp_path):
    """Random bytes (NULs, no newline for 3 MiB: dropped with one warning, memory bounded),
    then iteration lines: the spike after them is found."""
    log = tmp_path / "train.log"
    write(log, steady(range(1, 31), 3.0))
    w = Watch(log)
    try:
        w.started()
        time.sleep(0.3)
        rng = np.random.default_rng(7)
        garbage = rng.integers(0, 256, 3 << 20, dtype=np.uint8).tobytes().replace(b"\n", b"\0")
        with open(log, "ab") as fh:
            fh.write(garbage + b"\n" + rng.integers(0, 256, 5000, dtype=np.uint8).tobytes()
                     + b"\n")
        write(log, steady(range(31, 51), 3.0, seed=8, spikes={45: 2.0}))
        w.wait_for(lambda w: w.has("loss_spike", 45))
    finally:
        assert w.stop() == 0
    assert w.said("without a newline: dropped") == 1


# ------------------------------------------------------------------ run directories

def _run_dir(path, n=60):
    from adamspike.rundir import RunWriter

    w = RunWriter(path, backend="jax", config={"optim": {"eps": 1e-8}})
    for s in range(1, n + 1):
        w.log_step(step=s, tokens=s * 1000, loss=3.0 + 0.001 * (s % 3), lr=1e-3, grad_norm=0.5,
                   clipped=False, update_norm=0.1, step_time_s=0.1, skipped=False)
    w.flush()
    w.close()
    return path


def test_a_nul_in_events_jsonl_does_not_end_the_hooks(tmp_path):
    run = _run_dir(tmp_path / "run")
    ev = run / "events.jsonl"
    with open(ev, "ab") as fh:
        fh.write(b'{"time": 1, "type": "alarm", "step": 10, "rule": "a\\u0000b"}\n')
        fh.write(b'{"time": 2, "type": "alarm", "step": 11, "rule": "raw\x00nul"}\n')
        fh.write(b"\x00\x01\xff garbage\n")
    out = tmp_path / "hooks.jsonl"
    w = Watch(run, "--on-event", hook_cmd(out))
    try:
        w.wait_for(lambda w: w.has("alarm", 10))
        with open(ev, "a") as fh:
            fh.write(json.dumps({"time": 3, "type": "alarm", "step": 40, "rule": "later"}) + "\n")
        w.wait_for(lambda w: w.has("alarm", 40))
        w.wait_for(lambda w: len(hooked(out)) == 2)
    finally:
        assert w.stop() == 0
    assert [e["step"] for e in w.events if e["kind"] == "alarm"] == [10, 40]
    assert w.said("not JSON") == 1
    assert [(e["kind"], e["step"], e["record"]["rule"]) for e in hooked(out)] == \
        [("alarm", 10, "a\x00b"), ("alarm", 40, "later")]


def test_events_jsonl_is_read_incrementally(tmp_path):
    """An idle look costs a stat, whatever the size of events.jsonl (the issue measured
    7.1 CPU-seconds per idle 20 s at 35 MB); appended records are read once, and a
    rewrite (a resume's atomic truncation) re-reads without reporting a record twice."""
    cost = {}
    for mb in (1, 30):
        run = _run_dir(tmp_path / f"run{mb}", n=5)
        pad = "x" * 900
        rec = [json.dumps({"time": i, "type": "note", "step": i, "pad": pad}) + "\n"
               for i in range(mb * 1100)]
        (run / "events.jsonl").write_text("".join(rec))
        fol = RunFollower(run)
        fol.poll()                                            # the first read: everything
        t0 = time.process_time()
        for _ in range(50):
            assert fol.poll() == ([], [])
        cost[mb] = (time.process_time() - t0) / 50
    print(f"idle poll CPU: 1 MB {cost[1] * 1e3:.3f} ms, 30 MB {cost[30] * 1e3:.3f} ms")
    assert cost[30] < 3 * cost[1] + 0.002
    with open(run / "events.jsonl", "a") as fh:
        fh.write(json.dumps({"type": "alarm", "step": 7}) + "\n")
    assert [e["step"] for e in fol.poll()[1]] == [7]
    text = (run / "events.jsonl").read_text().splitlines(keepends=True)
    tmp = run / "events.tmp"
    tmp.write_text("".join(text[:10] + text[-1:]))            # a resume's rewrite
    os.replace(tmp, run / "events.jsonl")
    assert fol.poll() == ([], [])
    with open(run / "events.jsonl", "a") as fh:
        fh.write(json.dumps({"type": "alarm", "step": 8}) + "\n")
    assert [e["step"] for e in fol.poll()[1]] == [8]


def test_a_line_without_end_is_bounded_and_read_once(tmp_path):
    """16 MiB without a newline: dropped with one note, the partial line never above
    MAX_LINE_BYTES, each byte scanned once (linear: well under a CPU second)."""
    log = tmp_path / "flat.log"
    with open(log, "wb") as fh:
        fh.write(b"a" * (16 << 20) + b"\n" + b"iteration 1/ 10 | lm loss: 3.0 |\n" + b"tail")
    said, partial = [], []
    fol = LogFollower(log, _Stop(), _Notes(said.append), once=True)
    split = fol._split

    def spy(chunk):                      # the partial line kept after each read
        yield from split(chunk)
        partial.append(sum(map(len, fol.pieces)))

    fol._split = spy
    t0 = time.process_time()
    lines = [ln for seg in fol.segments() for ln in seg]
    cpu = time.process_time() - t0
    peak = max(partial)
    assert lines == ["iteration 1/ 10 | lm loss: 3.0 |", "tail"]
    assert fol.dropped_lines == 1 and len(said) == 1 and "dropped" in said[0]
    assert len(partial) >= 16 and 0 < peak <= MAX_LINE_BYTES
    assert cpu < 1.0, cpu


def test_a_read_error_is_said_once_and_reading_goes_on_where_it_stopped(tmp_path):
    """An I/O error (injected: the file's read raises EIO twice) mid-file: said once, the
    same file opened again and read on from where it stopped (no line twice, none lost)."""
    fail = [0]

    class Flaky:
        def __init__(self, fh):
            self.fh = fh

        def read(self, n):
            if fail[0]:
                fail[0] -= 1
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return self.fh.read(n)

        def __getattr__(self, name):
            return getattr(self.fh, name)

    class FlakyFollower(LogFollower):
        def _open(self):
            ok = super()._open()
            if ok:
                self.fh = Flaky(self.fh)
            return ok

    log = tmp_path / "eio.log"
    write(log, [f"line {i}" for i in range(10)])
    said, lines, stop = [], [], _Stop()
    fol = FlakyFollower(log, stop, _Notes(said.append), poll=0.02)
    th = threading.Thread(target=lambda: lines.extend(ln for seg in fol.segments()
                                                      for ln in seg))
    th.start()
    try:
        t0 = time.monotonic()
        while len(lines) < 10 and time.monotonic() - t0 < 5:
            time.sleep(0.02)
        fail[0] = 2
        write(log, [f"line {i}" for i in range(10, 20)])
        while len(lines) < 20 and time.monotonic() - t0 < 10:
            time.sleep(0.02)
    finally:
        stop.flag = True
        th.join(5)
    assert lines == [f"line {i}" for i in range(20)]
    assert sum("Input/output error" in s for s in said) == 1
    assert sum("can be read: following it" in s for s in said) == 1
    assert fol.new_content is None


@pytest.mark.parametrize("flags", [["--eps", "-1"], ["--clip", "-1"], ["--poll", "inf"],
                                   ["--on-event-timeout", "0"], ["--num-params", "0.5"],
                                   ["--eps", "nan"]])
def test_impossible_flags_are_refused_in_one_line(tmp_path, capsys, flags):
    """The issue's `watch LOG --once --eps -1 --clip -1` printed a negative rho_bar."""
    from analysis.watch import main

    log = tmp_path / "a.log"
    write(log, steady(range(1, 5), 3.0))
    assert main([str(log), "--once", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flags[0] in err


def test_stdout_closed_by_its_reader_ends_watching_quietly(tmp_path):
    """`watch LOG | head -1`: once the reader has gone, the next event ends watching with
    exit 0 and one line, no traceback."""
    log = tmp_path / "a.log"
    write(log, steady(range(1, 60), 3.0, spikes={50: 2.0}))
    proc = subprocess.Popen([sys.executable, "-m", "study", "watch", str(log), "--json",
                             "--poll", "0.05"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert json.loads(proc.stdout.readline())["step"] == 50
        proc.stdout.close()                               # the reader goes
        write(log, steady(range(60, 90), 3.0, seed=9, spikes={80: 2.0}))
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert rc == 0, err
    assert "stdout was closed: stopped" in err and "Traceback" not in err
