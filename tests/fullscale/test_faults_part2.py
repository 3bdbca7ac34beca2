"""Issue 27, part 2: storage faults, interrupted saves and signals, each with real processes
(`python -m fullscale.train` subprocesses; `strace -e inject` for I/O errors). Each case
ends with one stderr line naming the fault and nothing lost: where training can continue,
the resumed run's steps and final parameters + Adam state are bitwise those of an
uninterrupted run.

The runs a case needs only as its setup or its continuation (the reference, a --resume to
the end, a refusal's exit status and line), not as a process that is killed, signalled,
traced or exits, call `fullscale.train.main(argv)` in this process (`train_here`: the CLI
contract, it returns the exit status and writes the same stderr); each of those saves a
process start (torch's imports, ~5 s of CPU on a loaded 2-core box). The runs that only
SIGKILL themselves (ADAMSPIKE_KILL_AT) to leave a crashed run behind are real processes
forked by one server process that imported the trainer once (`killed`, as
tests/fullscale/test_crash.py launches its trainers): a kill costs the model build, not
the imports."""

from __future__ import annotations

import itertools
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from adamspike.rundir import load_run
from adamspike.train_config import RunConfig
from fullscale import checkpoint as ck
from tests.fullscale.trainers import LAUNCHER, main_here

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
TINY = ["--model.preset", "tiny", "--train.global_batch_size", "8", "--train.seq_len", "32",
        "--optim.lr", "3e-3", "--optim.warmup_steps", "2", "--telemetry.enabled", "false",
        "--checkpoint.keep", "3"]
TIMING = {"step_time_s", "tokens_per_s", "mfu", "peak_mem_gb"}
STRACE = shutil.which("strace")


def train(out: Path, *args: str, prefix: tuple[str, ...] = (), env: dict | None = None,
          timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "fullscale.train", "--out", str(out),
                           *TINY, *args], capture_output=True, text=True, timeout=timeout,
                          env={**ENV, **(env or {})})




@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """`train(out, *args, env=env)` for a run that SIGKILLs itself (env: ADAMSPIKE_KILL_AT):
    a trainer process forked by a server that has the imports done; its exit status
    (-SIGKILL when killed) and stderr."""
    logs = tmp_path_factory.mktemp("killed")
    server = subprocess.Popen([sys.executable, "-c", LAUNCHER], env=ENV, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    count = itertools.count()

    def run(out: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
        argv = ["--out", str(out), *TINY, *args]
        log = logs / f"{next(count)}.stderr"
        server.stdin.write(json.dumps([{"argv": argv, "env": env, "log": str(log)}]) + "\n")
        server.stdin.flush()
        replies = []
        for _ in ("pids", "exit codes"):
            ready, _, _ = select.select([server.stdout], [], [], 180)
            assert ready, f"the forked trainer did not end in 180 s: {argv}"
            replies.append(server.stdout.readline())
            assert replies[-1], f"the fork server died (exit {server.wait()})"
        return subprocess.CompletedProcess(argv, json.loads(replies[1])[0], "", log.read_text())

    yield run
    server.stdin.close()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:   # a trainer that never ended: it and the server go
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def train_here(out: Path, *args: str, capsys=None) -> subprocess.CompletedProcess:
    """`train(out, *args)` in this process (tests.fullscale.trainers.main_here)."""
    return main_here(["--out", str(out), *TINY, *args], capsys)


def lines(stderr: str) -> list[str]:
    """What the trainer said: progress bars, strace's own lines and the resume's warning
    about changed config keys left out."""
    assert "Traceback" not in stderr, stderr[-3000:]
    out = [ln for ln in stderr.replace("\r", "\n").splitlines() if ln.strip() and "step/s" not in ln
           and not ln.startswith(("train:", "[pid", "+++", "---", "strace:"))
           and "= -1 E" not in ln and "resumed>" not in ln]
    return [ln for ln in out if "resuming with changed config keys" not in ln
            and not ln.strip().startswith("warnings.warn(")]


def events(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "events.jsonl").read_text().splitlines()]


def state(run: Path, step: int) -> dict[str, torch.Tensor]:
    """Parameters and Adam state of checkpoint `step` of a run, as plain tensors."""
    from fullscale.model import Transformer
    from fullscale.optim import build_optimizer

    cfg = RunConfig()
    model = Transformer(cfg.model.llama())
    opt = build_optimizer(model, cfg.optim)
    ck.load(ck.step_dir(run / "checkpoints", step), model, opt, None, restore_rng=False)
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        out.update({f"{k}:{names[id(p)]}": v.clone() for k, v in st.items() if torch.is_tensor(v)})
    return out


def assert_same_run(ref: Path, run: Path, last: int) -> None:
    """Every step 1..last once, rows and the final state bitwise those of `ref`."""
    a, b = (load_run(p, tables=("steps",)).steps for p in (ref, run))
    assert b["step"].tolist() == list(range(1, last + 1))
    cols = [c for c in a.columns if c not in TIMING]
    assert a[cols].equals(b[cols])
    sa, sb = state(ref, last), state(run, last)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def ref12(tmp_path_factory) -> Path:
    """An uninterrupted 12-step run, checkpoints every 4 steps."""
    out = tmp_path_factory.mktemp("ref") / "ref12"
    proc = train_here(out, "--train.num_steps", "12", "--checkpoint.every", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def flip(path: Path, nbytes: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    start = len(data) // 3
    for i in range(start, min(len(data), start + nbytes)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------- defect 1

@pytest.mark.slow
def test_async_save_finished_at_exit_is_hashed_and_a_corrupt_shard_falls_back(tmp_path, ref12,
                                                                            capsys):
    """An abort leaves the step-8 async save pending; the exit completes it with every
    file's sha256 (it used to write sizes only, and a shard damaged later loaded silently
    and went NaN). A flipped 4 KiB of its shard is caught on --resume: one line, the
    step-4 checkpoint is used, and the run ends bitwise equal to the uninterrupted one."""
    out = tmp_path / "run"
    proc = train(out, "--train.num_steps", "12", "--checkpoint.every", "4",
                 "--checkpoint.async_save", "true", "--faults.nan_grad_at_step", "9")
    assert proc.returncode == 3, proc.stderr[-3000:]
    newest = ck.step_dir(out / "checkpoints", 8)
    manifest = ck.read_manifest(newest)
    assert manifest["finalized"] == "at close"
    assert all(f["sha256"] for f in manifest["files"].values())
    # its "checkpoint" event was logged when it completed, once
    assert [e["step"] for e in events(out) if e["type"] == "checkpoint"] == [4, 8]

    flip(newest / "__0_0.distcp")
    proc = train_here(out, "--train.num_steps", "12", "--checkpoint.every", "4", "--resume",
                      capsys=capsys)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = lines(proc.stderr)
    assert "__0_0.distcp does not match its sha256" in line and line.endswith("step-00000004")
    assert [e["step"] for e in events(out) if e["type"] == "resume"] == [4]
    assert_same_run(ref12, out, 12)


def test_a_manifest_without_hashes_is_never_complete(tmp_path):
    """A checkpoint an older version finished at close (sizes only) is rejected."""
    from fullscale.model import Transformer

    model = Transformer(RunConfig().model.llama())
    mgr = ck.CheckpointManager(tmp_path / "ckpt")
    path = mgr.save(1, model, None)
    manifest = json.loads((path / "COMPLETE").read_text())
    for f in manifest["files"].values():
        f["sha256"] = None
    (path / "COMPLETE").write_text(json.dumps(manifest))
    with pytest.raises(ck.CheckpointError, match="no sha256 in the manifest"):
        ck.verify(path)


@pytest.mark.slow
def test_guard_steps_back_past_a_checkpoint_that_reproduces_the_fault(tmp_path, capsys):
    """The step-8 checkpoint holds damaged weights whose hashes match (hashed after the
    damage): it loads, and the loss blows up again after every rollback to it. The guard's
    second rollback steps back to the step-4 checkpoint (it used to retry the same one
    until it gave up and called it the last good checkpoint); the run finishes."""
    out = tmp_path / "run"
    guard = ["--guard.enabled", "true", "--guard.window", "4", "--guard.skip_batches", "2"]
    proc = train_here(out, "--train.num_steps", "8", "--checkpoint.every", "4", *guard,
                      capsys=capsys)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _damage_with_valid_hashes(out, 8)
    proc = train_here(out, "--train.num_steps", "12", "--checkpoint.every", "4", "--resume",
                      *guard, capsys=capsys)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [ln for ln in lines(proc.stderr) if ln.startswith("adamspike train")]
    assert len(said) == 1 and "recurred after rolling back to checkpoint 8" in said[0], said
    assert said[0].endswith("step-00000004")
    rb = [(e["from_step"], e["to_step"]) for e in events(out) if e["type"] == "rollback"]
    assert rb == [(9, 8), (9, 4)]
    run = load_run(out, tables=("steps",))
    assert run.steps["step"].tolist() == list(range(1, 13))
    assert run.steps["loss"].loc[run.steps["step"] > 8].lt(10).all()


def _damage_with_valid_hashes(run: Path, step: int) -> None:
    """Rewrite checkpoint `step` with every weight x 50 (finite), hashes of the damage."""
    from fullscale.model import Transformer
    from fullscale.optim import build_optimizer, build_scheduler

    cfg = RunConfig()
    model = Transformer(cfg.model.llama())
    opt = build_optimizer(model, cfg.optim)
    sched = build_scheduler(opt, cfg.optim, 12)
    root = run / "checkpoints"
    extra = ck.load(ck.step_dir(root, step), model, opt, sched, restore_rng=False)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(50.0)
    keep = {k: v for k, v in extra.items() if k not in ck.RESERVED_EXTRA}
    ck.CheckpointManager(root).save(step, model, opt, sched, keep, position=extra["position"],
                                    guard=extra["guard"])


# ----------------------------------------------------------------------------- defect 2

@pytest.mark.slow
def test_torn_last_event_line_is_repaired_on_resume(tmp_path, ref12, killed, capsys):
    """Killed at step 6, then the end of events.jsonl is cut off (a torn last line): the
    resume moves the fragment to events.discarded.jsonl (one line says so) instead of
    appending its "resume" event to it; every event reads back, the run is the reference."""
    out = tmp_path / "run"
    proc = killed(out, "--train.num_steps", "12", "--checkpoint.every", "4",
                  env={"ADAMSPIKE_KILL_AT": "step@6"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    ev = out / "events.jsonl"
    os.truncate(ev, ev.stat().st_size - 20)
    proc = train_here(out, "--train.num_steps", "12", "--checkpoint.every", "4", "--resume",
                      capsys=capsys)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = lines(proc.stderr)
    assert "events.jsonl: its last line was torn" in line
    run = load_run(out, tables=())
    assert run.torn_event_lines == 0
    assert run.events.query("type == 'resume'")["step"].tolist() == [4]
    discarded = [json.loads(ln) for ln in (out / "events.discarded.jsonl").read_text().splitlines()]
    assert any(d["type"] == "torn_line" and d["text"] for d in discarded)
    assert_same_run(ref12, out, 12)


# ----------------------------------------------------------------------------- defect 3

@pytest.mark.slow
@pytest.mark.skipif(STRACE is None, reason="needs strace")
def test_io_error_reading_the_newest_checkpoint_falls_back(tmp_path, ref12, killed):
    """Every read of the step-8 shard fails with EIO (strace -e inject): the resume used to
    end in a 33-line traceback (exit 1); now the checkpoint is rejected in one line naming
    EIO and the step-4 one is used, as docs/faults.md promises."""
    out = tmp_path / "run"
    proc = killed(out, "--train.num_steps", "12", "--checkpoint.every", "4",
                  env={"ADAMSPIKE_KILL_AT": "step@10"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    shard = ck.step_dir(out / "checkpoints", 8) / "__0_0.distcp"
    proc = train(out, "--train.num_steps", "12", "--checkpoint.every", "4", "--resume",
                 prefix=(STRACE, "-qq", "-f", "-P", str(shard), "-e", "trace=read,pread64",
                         "-e", "inject=read,pread64:error=EIO"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = lines(proc.stderr)
    assert "__0_0.distcp is unreadable (EIO: Input/output error)" in line, line
    assert line.endswith("step-00000004")
    assert_same_run(ref12, out, 12)


# ----------------------------------------------------------------------------- defect 5

@pytest.mark.slow
def test_dead_ends_have_a_way_out(tmp_path, ref12, killed, capsys):
    """Killed inside its first checkpoint save, a run had no way on ("no complete
    checkpoint" on --resume, "not empty" on a new start): --resume now starts again from
    step 0, saying so. When every checkpoint is damaged, --resume says --restart is the
    way out, and --restart moves the old contents aside (nothing deleted) and starts anew;
    both end bitwise equal to the uninterrupted run."""
    out = tmp_path / "run"
    proc = killed(out, "--train.num_steps", "12", "--checkpoint.every", "4",
                  env={"ADAMSPIKE_KILL_AT": "checkpoint.write@4"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert ck.complete(out / "checkpoints") == []
    proc = train_here(out, "--train.num_steps", "12", "--checkpoint.every", "4", "--resume",
                      capsys=capsys)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = lines(proc.stderr)
    assert "no complete checkpoint" in line and "starts again from step 0" in line
    assert [e["step"] for e in events(out) if e["type"] == "resume"] == [0]
    assert_same_run(ref12, out, 12)

    for shard in out.glob("checkpoints/step-*/__0_0.distcp"):
        flip(shard)
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    proc = train_here(out, "--train.num_steps", "12", "--checkpoint.every", "4", "--resume",
                      capsys=capsys)
    assert proc.returncode == 2
    (line,) = lines(proc.stderr)
    assert "no loadable checkpoint" in line and "--restart" in line
    proc = train_here(out, "--train.num_steps", "12", "--checkpoint.every", "4", "--restart",
                      capsys=capsys)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = lines(proc.stderr)
    (aside,) = tmp_path.glob("run.restart-*")
    assert line.endswith(f"--restart: moved the previous contents of {out} to {aside}")
    assert sorted(str(p.relative_to(aside)) for p in aside.rglob("*")) == before
    assert_same_run(ref12, out, 12)


# ----------------------------------------------------------------------------- defect 6

def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.mark.slow
@pytest.mark.skipif(STRACE is None, reason="needs strace")
def test_storage_errors_are_one_line_and_lose_nothing(tmp_path, ref12, capsys):
    """The disk fills while checkpoint 8 is written (strace: ENOSPC on its shard): one
    line naming ENOSPC, exit 1, a "fault" event (it used to be a DCP traceback). A read-only
    checkpoints/ on --resume is refused at the start in one line naming EROFS, nothing
    changed (it used to train a whole interval first). Then --resume ends bitwise equal to
    the uninterrupted run."""
    out = tmp_path / "run"
    shard = out / "checkpoints" / "step-00000008.partial" / "__0_0.distcp"
    proc = train(out, "--train.num_steps", "12", "--checkpoint.every", "4",
                 prefix=(STRACE, "-qq", "-f", "-P", str(shard), "-e", "trace=write",
                         "-e", "inject=write:error=ENOSPC"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    (line,) = lines(proc.stderr)
    assert line.startswith("adamspike train: error: storage: ENOSPC: No space left on device")
    fault = [e for e in events(out) if e["type"] == "fault"]
    assert len(fault) == 1 and fault[0]["error"].startswith("storage: ENOSPC")
    assert [s for s, _ in ck.complete(out / "checkpoints")] == [4]

    before = _snapshot(out)
    probe = out / "checkpoints" / ".adamspike-write-probe"
    proc = train(out, "--train.num_steps", "12", "--checkpoint.every", "4", "--resume",
                 prefix=(STRACE, "-qq", "-f", "-P", str(probe), "-e", "trace=openat",
                         "-e", "inject=openat:error=EROFS"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = lines(proc.stderr)
    assert "is not writable (EROFS: Read-only file system)" in line, line
    after = _snapshot(out)
    assert after.pop("writer.lock") == b"" and before.pop("writer.lock") == b""
    assert after == before

    proc = train_here(out, "--train.num_steps", "12", "--checkpoint.every", "4", "--resume",
                      capsys=capsys)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(ref12, out, 12)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (root)")
def test_too_little_free_space_is_refused_at_the_start(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
                      capture_output=True).returncode:
        pytest.skip("mount not permitted here")
    try:
        proc = train(small / "run", "--train.num_steps", "4")
        assert proc.returncode == 2, proc.stderr[-3000:]
        (line,) = lines(proc.stderr)
        assert "ENOSPC expected" in line and "MiB free" in line, line
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], check=True)


# ----------------------------------------------------------------------------- defect 8

def _signal_while_hung(out: Path, sig: int, hang_step: int, *args: str
                       ) -> subprocess.CompletedProcess:
    """Start a run that sleeps before step `hang_step` (faults.hang_rank_at_step), send it
    `sig` while it sleeps, and return the finished process."""
    argv = [sys.executable, "-m", "fullscale.train", "--out", str(out), *TINY,
            "--train.num_steps", "12", "--checkpoint.every", "4",
            "--faults.hang_rank_at_step", f"0,{hang_step}", "--faults.hang_s", "120", *args]
    proc = subprocess.Popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "events.jsonl").is_file() or not any(
                e["type"] == "fault_injected" and e["step"] == hang_step for e in events(out)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


@pytest.mark.slow
def test_sigint_and_sigterm_are_one_line_a_fault_event_and_130_143(tmp_path, ref12, capsys):
    """Ctrl-C (SIGINT) at step 6 and SIGTERM at step 10 of the resumed run: each exits
    128 + signal with one line naming it (Ctrl-C was a 20-line traceback; a SIGTERMed
    process left no fault event); the final --resume is bitwise the uninterrupted run."""
    out = tmp_path / "run"
    for sig, step, extra in ((signal.SIGINT, 6, ()), (signal.SIGTERM, 10, ("--resume",))):
        proc = _signal_while_hung(out, sig, step, *extra)
        assert proc.returncode == 128 + sig, proc.stderr[-3000:]
        (line,) = lines(proc.stderr)
        assert line.startswith(f"adamspike train: interrupted by {sig.name} at step {step};")
        fault = [e for e in events(out) if e["type"] == "fault"][-1]
        assert fault["signal"] == sig.name and fault["step"] == step
    proc = train_here(out, "--train.num_steps", "12", "--checkpoint.every", "4", "--resume",
                      capsys=capsys)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(ref12, out, 12)


def _torchrun(out: Path, logs: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """A 2-rank gloo job of 24 steps: torchrun (its own process group, as a shell job is)
    starting tests/fullscale/signal_worker.py, which runs fullscale.train and records each
    trainer process's stderr and exit status in `logs`."""
    logs.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(ROOT / "tests" / "fullscale" / "signal_worker.py"), str(logs),
           "--out", str(out), *TINY, "--train.num_steps", "24", "--checkpoint.every", "4", *args]
    return subprocess.Popen(cmd, env={**ENV, **(env or {})}, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _outcome(logs: Path) -> tuple[list[int], list[list[str]]]:
    """Each trainer process's exit status and stderr lines (without the hung rank's
    "injected fault") of a job run by _torchrun."""
    rcs = [int((logs / f"rank{r}.rc").read_text()) for r in range(2)]
    said = [[ln for ln in lines((logs / f"rank{r}.stderr").read_text())
             if "injected fault 'hang'" not in ln] for r in range(2)]
    return rcs, said


def _resume_to_the_end(out: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "fullscale.train", "--out", str(out), *TINY, "--train.num_steps", "24",
         "--checkpoint.every", "4", "--resume"],
        env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def ref24x2(tmp_path_factory) -> Path:
    """An uninterrupted 24-step 2-rank job, checkpoints every 4 steps."""
    out = tmp_path_factory.mktemp("ref") / "ref24x2"
    job = _torchrun(out, out.parent / "logs")
    assert job.wait(timeout=180) == 0, job.communicate()[1][-3000:]
    return out


def _signal_job(out: Path, logs: Path, ready, send, *args: str
                ) -> tuple[str, list[int], list[list[str]]]:
    """Start a 2-rank job, wait until `ready()`, then `send(job, logs)` its signal. Returns
    torchrun's stderr, then each trainer process's exit status and stderr lines (without
    the hung rank's "injected fault")."""
    job = _torchrun(out, logs, *args)
    try:
        deadline = time.monotonic() + 120
        while not ready():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.02)
        assert job.poll() is None, job.communicate()
        send(job, logs)
        _, launcher = job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    return (launcher, *_outcome(logs))


def _newest(out: Path) -> int:
    done = ck.complete(out / "checkpoints")
    return done[-1][0] if done else 0


@pytest.mark.slow
def test_a_signalled_torchrun_job_stops_in_one_line_per_process_and_resumes(tmp_path, ref24x2):
    """2 gloo ranks under torchrun, signalled three times, then resumed to the end:
    1. Ctrl-C (SIGINT to torchrun's process group; torchrun forwards it to each worker,
       they run in sessions of their own) while rank 1 sleeps before step 6
       (faults.hang), so rank 0 waits inside a gloo collective, where no Python signal
       handler runs;
    2. SIGTERM to rank 1's trainer process alone, at a random moment after the resumed
       job's first checkpoint (a multi-node job whose nodes are signalled apart): rank 0's
       collective fails ("Connection closed by peer") before torchrun stops it; that was a
       gloo traceback and exit 1, now rank 1's signal, which rank 1 announced in the job's
       store;
    3. SIGTERM to torchrun's process group at a random moment after the first checkpoint:
       a rank whose peer stopped first printed a gloo traceback, or aborted at exit
       ("terminate called without an active exception").
    Each time each trainer process prints one line naming the signal and exits 130 / 143,
    rank 0 logs one fault event, and the last --resume finishes every step once, bitwise
    the uninterrupted 2-rank job."""
    out, logs, rng = tmp_path / "run", tmp_path / "logs", random.Random(278)

    seen_hang = []

    def hung_rank1():
        # Rank 1 says it hangs as it enters step 6; rank 0 may still be finishing step 5
        # (rank 0 alone writes the run's rows: a loaded CI box once signalled it there, and
        # its fault said step 5). The hang lasts 120 s: 2 s more puts rank 0 in step 6's
        # first collective, where this case means to signal it.
        f = logs / "0" / "rank1.stderr"
        if not seen_hang and f.is_file() and "injected fault 'hang' at step 6" in f.read_text():
            seen_hang.append(time.monotonic())
        return bool(seen_hang) and time.monotonic() - seen_hang[0] > 2.0

    def checkpointed(resumed_from: int, delay: float):
        if _newest(out) <= resumed_from:
            return False
        time.sleep(delay)
        return True

    def to_group(sig):         # Ctrl-C in torchrun's terminal; `kill -TERM -PGID`
        return lambda job, logs: os.killpg(job.pid, sig)

    def to_rank1(sig):
        return lambda job, logs: os.kill(int((logs / "rank1.pid").read_text()), sig)

    # (signal, to whom, args, delay after the job's first checkpoint; None: rank 1 hung).
    # A hang bounds when the signal comes; only the signalled rank may hang (a rank waits
    # in a collective for a hung peer until dist.timeout_s, whatever signal it got).
    jobs = [(signal.SIGINT, to_group, ("--faults.hang_rank_at_step", "1,6"), None),
            (signal.SIGTERM, to_rank1, ("--resume", "--faults.hang_rank_at_step", "1,14"),
             rng.uniform(0, 0.5)),
            (signal.SIGTERM, to_group, ("--resume", "--faults.hang_rank_at_step", "0,22"),
             rng.uniform(0, 0.5))]
    for n, (sig, send, args, delay) in enumerate(jobs):
        start = _newest(out)
        launcher, rcs, said = _signal_job(
            out, logs / str(n), hung_rank1 if delay is None else
            (lambda: checkpointed(start, delay)), send(sig), *args, "--faults.hang_s", "120")
        # torchrun adds its own lines, not counted: "Received <n> death signal, shutting
        # down workers", "Sending process <pid> closing signal SIG...", and a traceback
        # ending in its SignalException (torchrun itself exits 1); or, when one worker was
        # signalled, its report of the failed worker (exit code 143)
        assert "closing signal" in launcher or "exitcode" in launcher, launcher[-3000:]
        assert rcs == [128 + sig] * 2, (rcs, said, launcher[-3000:])
        for rank_said in said:
            (line,) = rank_said
            assert line.startswith(f"adamspike train: interrupted by {sig.name}"), line
            assert line.endswith("(--resume continues)"), line
        faults = [e for e in events(out) if e["type"] == "fault"]
        assert len(faults) == n + 1 and faults[-1]["signal"] == sig.name, faults
        assert said[0][0].startswith(f"adamspike train: interrupted by {sig.name}"), said
        assert f"at step {faults[-1]['step']};" in said[0][0], (said, faults)
        if n == 0:
            assert faults[-1]["step"] == 6 and _newest(out) == 4
    _resume_to_the_end(out)
    assert_same_run(ref24x2, out, 24)


@pytest.mark.slow
def test_a_signal_inside_a_checkpoint_save_or_load_of_a_torchrun_job(tmp_path, ref24x2):
    """SIGTERM to rank 1 as DCP writes checkpoint 8, then SIGINT to rank 0 as DCP reads
    checkpoint 4 for --resume (tests/fullscale/signal_worker.py, SIGNAL_IN_DCP). DCP catches
    a rank's exception and hands it to every rank inside its CheckpointException: a rank
    then printed a traceback ending in "ValueError: 'SIGTERM' is not a valid Signals"
    (Interrupted did not unpickle; seen under load in the test above), and a signal during
    a load rejected a good checkpoint ("does not load into this model"), the signal lost.
    Now each process prints one line naming the signal and exits 143 / 130, the save's
    fault event names it, checkpoint 4 is never rejected, and the final --resume is
    bitwise the uninterrupted 2-rank job."""
    out, logs = tmp_path / "run", tmp_path / "logs"
    for what, sig, code in (("write@8:1:SIGTERM", signal.SIGTERM, 143),
                            ("read@4:0:SIGINT", signal.SIGINT, 130)):
        d = logs / what.split("@")[0]
        job = _torchrun(out, d, *(("--resume",) if what.startswith("read") else ()),
                        env={"SIGNAL_IN_DCP": what})
        launcher = job.communicate(timeout=180)[1]
        rcs, said = _outcome(d)
        assert rcs == [code] * 2, (rcs, said, launcher[-3000:])
        for rank_said in said:
            (line,) = rank_said
            assert line.startswith(f"adamspike train: interrupted by {sig.name}"), line
        assert _newest(out) == 4
    # the save's: rank 1 got it; rank 0 learned it from DCP (or from torchrun's SIGTERM
    # after rank 1 exited); the load's comes before the run writer is reopened: rank 0
    # appends its event straight to the run's events (no step: none was trained)
    faults = [e for e in events(out) if e["type"] == "fault"]
    assert len(faults) == 2, faults
    saved, loaded = faults
    assert saved["signal"] == "SIGTERM" and saved["step"] == 8
    assert loaded["signal"] == "SIGINT" and loaded.get("step") is None
    assert "resume's checkpoint load" in loaded["error"]
    assert not [e for e in events(out) if e["type"] == "checkpoint_rejected"]
    _resume_to_the_end(out)
    assert_same_run(ref24x2, out, 24)


# ----------------------------------------------------------------------------- defect 9

def test_bad_config_bytes_and_a_model_too_large_are_refused_in_one_line(tmp_path, capsys):
    """A config that is not UTF-8 was a traceback; a model that cannot fit was built until
    a 71-line MemoryError: both exit 2 in one line before anything is created (the model's
    least memory is estimated; under `ulimit -v` the address-space limit counts)."""
    import resource

    bad = tmp_path / "b.toml"
    bad.write_bytes(b"\xff\xfe[model]\n")
    proc = train_here(tmp_path / "x", "--config", str(bad), capsys=capsys)
    assert proc.returncode == 2
    (line,) = lines(proc.stderr)
    assert line == f"adamspike train: error: {bad}: not UTF-8 text (byte 0: 0xff); a TOML config must be UTF-8"

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    proc = subprocess.run([sys.executable, "-m", "fullscale.train", "--out", str(tmp_path / "y"),
                           "--model.preset", "llama2-7b"], capture_output=True, text=True,
                          env=ENV, timeout=120, preexec_fn=cap)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = lines(proc.stderr)
    assert "6.74B parameters need at least 100.4 GiB per process" in line, line
    assert "GiB available" in line
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.slow
def test_resume_below_the_checkpoint_says_so(tmp_path, ref12, capsys):
    """--resume --train.num_steps 6 of a run checkpointed at 12 exited 0 having trained
    nothing; now exit 2, one line naming both steps, the run unchanged."""
    out = tmp_path / "run"
    shutil.copytree(ref12, out)
    before = _snapshot(out)
    proc = train_here(out, "--train.num_steps", "6", "--checkpoint.every", "4", "--resume",
                      capsys=capsys)
    assert proc.returncode == 2
    (line,) = lines(proc.stderr)
    assert "train.num_steps: 6 is below step 12 of the checkpoint resumed from" in line
    after = _snapshot(out)
    assert after.pop("writer.lock") == b"" and before.pop("writer.lock") == b""
    assert after == before


@pytest.mark.slow
@pytest.mark.skipif(STRACE is None, reason="needs strace")
def test_failed_async_save_never_logs_a_checkpoint_event(tmp_path, ref12, capsys):
    """The background write of the async step-8 save fails (ENOSPC): no "checkpoint" event
    for step 8 (it used to be logged when the save was queued), one line naming ENOSPC;
    --resume from step 4 ends bitwise equal to the uninterrupted run."""
    out = tmp_path / "run"
    shard = out / "checkpoints" / "step-00000008.partial" / "__0_0.distcp"
    proc = train(out, "--train.num_steps", "12", "--checkpoint.every", "4",
                 "--checkpoint.async_save", "true",
                 prefix=(STRACE, "-qq", "-f", "-P", str(shard), "-e", "trace=write",
                         "-e", "inject=write:error=ENOSPC"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    (line,) = lines(proc.stderr)
    assert line.startswith("adamspike train: error: storage: ENOSPC"), line
    assert [e["step"] for e in events(out) if e["type"] == "checkpoint"] == [4]
    proc = train_here(out, "--train.num_steps", "12", "--checkpoint.every", "4", "--resume",
                      capsys=capsys)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(ref12, out, 12)


@pytest.mark.slow
def test_a_resume_that_dies_early_keeps_the_crash_record(tmp_path, ref12, killed, capsys):
    """A run is killed at step 6, then two resumes are killed while loading the checkpoint
    (before they open the run directory): the next resume logs three lock_taken_over
    events, one per dead writer (it logged one: each early death erased the record
    before it)."""
    out = tmp_path / "run"
    common = ("--train.num_steps", "12", "--checkpoint.every", "4")
    proc = killed(out, *common, env={"ADAMSPIKE_KILL_AT": "step@6"})
    assert proc.returncode == -signal.SIGKILL
    for _ in range(2):
        proc = killed(out, *common, "--resume", env={"ADAMSPIKE_KILL_AT": "checkpoint.load@4"})
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    proc = train_here(out, *common, "--resume", capsys=capsys)
    assert proc.returncode == 0, proc.stderr[-3000:]
    taken = [e["previous"] for e in events(out) if e["type"] == "lock_taken_over"]
    assert len(taken) == 3 and len({t["pid"] for t in taken}) == 3, taken
    assert (out / "writer.lock").read_text() == ""
    assert_same_run(ref12, out, 12)


# ----------------------------------------------------------------------------- defect 7

LIVE_WRITER = """
import sys, time
from adamspike.rundir import RunWriter
run, start, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
spike, back = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (None, None)
kw = dict(backend="torch", flush_every_rows=7, flush_every_s=1e9)
w = (RunWriter(run, config={}, **kw) if start == 1 else
     RunWriter(run, resume_from_step=start - 1, **kw))
s, gen = start, 0       # gen: the trajectory (1 after the rollback), in every row's values
while s <= stop:
    if s == spike and gen == 0:     # the guard's rollback, as fullscale.train logs it
        w.event("spike", step=s)
        w.event("rollback", step=s, from_step=s, to_step=back)
        w.rewind(back)
        s, gen = back + 1, 1
        continue
    v = float(s + 1000 * gen)
    w.log_step(step=s, tokens=s, loss=v, lr=1.0, grad_norm=1.0, clipped=False,
               update_norm=1.0, step_time_s=0.0, skipped=False)
    w.log_layers(s, [{"name": f"t{i}", "depth": i, "kind": "param", "numel": 1, "rho": v}
                     for i in range(3)])
    w.event("alarm", step=s)        # a step's events are on disk before its rows
    time.sleep(0.002 if gen == 0 else 0.03)   # reads surely fall in the re-run (3 s: a
                                              # loaded CI read the run only 3 times at 0.01)
    s += 1
w.close()
"""


def _consistent_reads_while(proc: subprocess.Popen, run: Path) -> int:
    """Read the run while `proc` writes it: every read is one moment (steps, layers and
    per-step events end at the same step, each step once with its 3 layer rows, all of
    one trajectory: no re-run row followed by an abandoned one); returns the reads."""
    reads = 0
    while proc.poll() is None:
        r = load_run(run, tables=("steps", "layers"))
        steps = r.steps["step"].tolist()
        assert steps == list(range(1, len(steps) + 1)), steps
        assert r.layers["step"].tolist() == [s for s in steps for _ in range(3)]
        gen = (r.steps["loss"].to_numpy() // 1000).tolist()
        assert gen == sorted(gen), gen                       # not spliced
        assert (r.layers["rho"].to_numpy() == r.steps["loss"].repeat(3).to_numpy()).all()
        ev = r.events
        assert sorted(set(ev.loc[ev["type"] == "alarm", "step"])) == steps
        assert all(ev.loc[ev["type"].isin(["spike", "rollback"]), "step"] <= len(steps))
        reads += 1
    assert proc.returncode == 0
    return reads


@pytest.mark.slow
def test_reads_of_a_live_and_a_resuming_run_are_one_moment(tmp_path):
    """A writer flushes inside steps (every 7 rows: a step row, then its layer rows), logs
    a step's events before its rows, rolls back from step 160 to 100 and re-runs, and a
    resume deletes and rewrites parts: reads meanwhile used to mix moments (steps to 126,
    layers to 135; events beyond the rows, also those a resume was about to move aside;
    the re-run's rows spliced with the abandoned ones) or fail ("unreadable parquet parts"
    on a part deleted under them)."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-c", LIVE_WRITER, str(run)]
    proc = subprocess.Popen([*cmd, "1", "200", "160", "100"], env=ENV)
    while not (run / "run.json").is_file():
        assert proc.poll() is None
        time.sleep(0.01)
    assert _consistent_reads_while(proc, run) > 3
    r = load_run(run, tables=("steps",))
    assert r.steps["loss"].tolist() == [float(s + 1000 * (s > 100)) for s in range(1, 201)]
    proc = subprocess.Popen([*cmd, "51", "150"], env=ENV)    # resume from step 50
    _consistent_reads_while(proc, run)
    r = load_run(run, tables=("steps", "layers"))
    assert r.steps["step"].tolist() == list(range(1, 151)) and len(r.layers) == 450
    assert r.steps["loss"].tolist() == [float(s) for s in range(1, 151)]
    assert r.snapshot_step is None                            # closed: read whole
