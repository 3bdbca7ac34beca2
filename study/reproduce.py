"""`adamspike reproduce`: the whole study at CPU scale, into one output folder.

The loop of DESIGN.md, stage by stage, each stage one `adamspike <command>` in its own
process (the JAX and torch halves never share an interpreter):

    theory -> Monte-Carlo check -> toy spike runs (quadratic, MLP, tiny LLaMA) -> sweeps
    -> replication table -> spike-rate GLM (sweeps + toy runs, held-out validated) ->
    predictions.json / predictions_70b.json (pre-registered) -> plan -> tiny torch run
    driven by the predictions -> figures -> analysis (+ the 70B predictions scored on the
    rho-matched toy and on its Megatron-format log) -> STUDY.md

The stages are data, configs/study.toml: one table per stage (its arguments, sizes,
dependencies, outputs), in plan order, at three scales (SCALES): the tables themselves are
`--full` (every measurement recomputed: hours on 2 cores, cached by cell and resumable); the
default, `standard`, merges in each stage's `standard` values (the multi-hour measurements
read from the fit shipped with the package, adamspike/data/llama2_70b, placeholder
{shipped}: the ladder's, the claims replications' and the batch-sharpness stage's cells are
copied and refitted, the phase maps are left out or small); `--quick` (CI) merges in the
`quick` values instead (smaller sizes; a few stages left out). This module only fills in
the paths and runs the plan; STUDY.md is written by study/study_md.py from each stage's
`report` and `answer` entries in the same tables.

Independent stages overlap (`--jobs`, default 2): a stage can start once the stages it
needs have succeeded and those it reads after have finished, and a free slot takes the
first such stage in plan order. Compiled JAX programs and exact theory tables are cached
in OUT/.cache. A stage whose command is not built yet is reported as missing, a stage that fails is
reported as failed (with the tail of its log) and the stages that need its output are
skipped; nothing is faked. Each stage's stdout/stderr go to OUT/logs/<stage>.log and a
finished stage leaves OUT/.stages/<stage>.json, so `--resume` continues an interrupted
study without redoing finished stages. An existing non-empty OUT without --resume is an
error: nothing already written is overwritten.

One writer per study folder: `reproduce` holds OUT/writer.lock (adamspike.rundir.RunLock:
flock, host and pid); a second one on a live folder is refused in one line. Each stage runs
in its own process group and dies with `reproduce`, with all it started (kill -9: a guard
leading the group gets PR_SET_PDEATHSIG on Linux and kills the group; SIGTERM / SIGINT stop
every stage's group, then `reproduce` itself). A stage killed
mid-way left partial outputs: its `fresh` paths (run stages: their run folder) are set
aside to OUT/.stale/ before it reruns. A stage mark holds its result's sha256; a torn or
altered one reruns its stage, with one line.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from adamspike import package_data
from adamspike.config import ConfigError, read_toml
from adamspike.rundir import OutputPathError, RunFormatError, RunLock, check_out
from study.study_md import contributions, write_study_report

REPO = Path(__file__).resolve().parent.parent
NOT_BUILT = 3


@dataclass
class Stage:
    name: str
    title: str
    argv: list[str]                  # arguments of `adamspike`
    needs: list[str] = field(default_factory=list)   # must have succeeded
    after: list[str] = field(default_factory=list)   # must have finished (any status)
    outputs: list[str] = field(default_factory=list)   # paths relative to OUT it must leave
    stdout_to: str | None = None     # file (relative to OUT) that receives stdout
    # outputs that a rerun must find absent (their command refuses to overwrite): an
    # interrupted attempt's leftovers are moved to OUT/.stale/, never deleted
    fresh: list[str] = field(default_factory=list)


STUDY = REPO / "configs" / "study.toml"
SCALES = ("quick", "standard", "full")    # full: the tables as written; else their overlay
OVERLAYS = ("quick", "standard")
STAGE_KEYS = {"title", "args", "sizes", "run", "needs", "after", "outputs", "stdout_to", "fresh",
              "report", "answer", *OVERLAYS}    # report, answer: STUDY.md (study/study_md.py)
OVERLAY_KEYS = STAGE_KEYS - set(OVERLAYS) | {"skip"}
_PLACEHOLDER = re.compile(r"\{([^{}]+)\}")


def _size_flags(sizes: dict) -> list[str]:
    """`key = value` -> `--key value`; true: `--key` alone; false: left out; a list:
    `--key item` per item (`set = ["fixed.train.num_steps=3000", ...]`: each stage's
    explicit sizes, the modules' `--set`)."""
    out: list[str] = []
    for k, v in sizes.items():
        if v is True:
            out.append(f"--{k}")
        elif isinstance(v, list):
            out += [a for item in v for a in (f"--{k}", str(item))]
        elif v is not False:
            out += [f"--{k}", str(v)]
    return out


def _optim_of(path: str) -> list[str]:
    """--b2 / --eps of a config's [optim] (for a Megatron log, which does not state them)."""
    optim = read_toml(REPO / path).get("optim", {})
    return [a for k in ("b2", "eps") if k in optim for a in (f"--{k}", repr(float(optim[k])))]


def load_study(path: Path = STUDY, scale: str = "standard") -> dict[str, dict]:
    """The study's stage tables (configs/study.toml), in plan order, with the scale's overlay
    (`quick` or `standard`; none for `full`) merged in (`sizes` key by key, other keys
    replaced) and its skipped stages left out."""
    if scale not in SCALES:
        raise ConfigError(f"study scale {scale!r}: expected one of {', '.join(SCALES)}")
    tables = read_toml(path).get("stages")
    if not isinstance(tables, dict) or not tables:
        raise ConfigError(f"{path}: expected [stages.<name>] tables")
    plan: dict[str, dict] = {}
    for name, t in tables.items():
        unknown = sorted(set(t) - STAGE_KEYS)
        if unknown:
            raise ConfigError(f"stages.{name}: unknown key(s) {unknown} (known: {sorted(STAGE_KEYS)})")
        for o in OVERLAYS:
            unknown = sorted(set(t.get(o, {})) - OVERLAY_KEYS)
            if unknown:
                raise ConfigError(f"stages.{name}.{o}: unknown key(s) {unknown} "
                                  f"(known: {sorted(OVERLAY_KEYS)})")
        q = t.get(scale, {}) if scale in OVERLAYS else {}
        if q.get("skip"):
            continue
        st = {k: v for k, v in t.items() if k not in OVERLAYS}
        st.update({k: v for k, v in q.items() if k not in ("skip", "sizes")})
        st["sizes"] = {**t.get("sizes", {}), **q.get("sizes", {})}
        plan[name] = st
    known = set(tables)
    for name, st in plan.items():
        for key in ("needs", "after"):
            bad = sorted(set(st.get(key, [])) - known)
            if bad:
                raise ConfigError(f"stages.{name}.{key}: unknown stage(s) {bad}")
    return plan


def stages(out: Path, scale: str = "standard", jobs: int = 2, study: Path = STUDY) -> list[Stage]:
    """The study (configs/study.toml), in order, its placeholders filled in. Paths are inside
    `out`; jobs: processes of the figures and analysis stages (they run last, one after the
    other, beside nothing else)."""
    plan = load_study(study, scale)
    values = {"out": str(out), "repo": str(REPO), "jobs": str(jobs),
              "shipped": str(package_data.profile_dir("llama2-70b"))}

    def fill(text: str, sizes: dict) -> str:
        def one(m: re.Match) -> str:
            key = m.group(1)
            if key in values:
                return values[key]
            if key in sizes:
                return str(sizes[key])
            raise ConfigError(f"{study}: unknown placeholder {{{key}}} in {text!r}")
        return _PLACEHOLDER.sub(one, text)

    def expand(arg: str, sizes: dict) -> list[str]:
        if arg.startswith("{runs:") and arg.endswith("}"):
            names = arg[len("{runs:"):-1].split(",")
            unknown = [n for n in names if n in plan and "run" not in plan[n]]
            if unknown:
                raise ConfigError(f"{study}: {arg}: stage(s) {unknown} leave no run")
            return [str(out / plan[n]["run"]) for n in names if n in plan]
        if arg.startswith("{optim_of:") and arg.endswith("}"):
            return _optim_of(arg[len("{optim_of:"):-1])
        return [fill(arg, sizes)]

    result = []
    for name, st in plan.items():
        sizes = st["sizes"]
        outputs = list(st.get("outputs", []))
        fresh = list(st.get("fresh", []))
        if "run" in st:
            outputs.append(f"{st['run']}/run.json")
            # `simulate ... --out` and `train --out` refuse a non-empty folder: a run killed
            # mid-way is set aside before the stage reruns
            fresh += [] if st["run"] in fresh else [st["run"]]
        result.append(Stage(
            name, fill(st.get("title", name), sizes),
            [a for arg in st.get("args", []) for a in expand(arg, sizes)]
            + _size_flags({k: fill(v, sizes) if isinstance(v, str) else v
                           for k, v in sizes.items()}),
            # stages the scale leaves out are not waited for
            needs=[n for n in st.get("needs", []) if n in plan],
            after=[n for n in st.get("after", []) if n in plan],
            outputs=outputs, stdout_to=st.get("stdout_to"), fresh=fresh))
    return result


def _set_aside(st: Stage, out: Path) -> str | None:
    """Move what an unfinished earlier attempt of `st` left in its `fresh` paths to
    OUT/.stale/<stage>-<n>/ (kept for inspection), so the rerun starts from nothing.
    Returns the line that says so (None when nothing was left)."""
    left = [p for p in st.fresh if (out / p).exists()]
    if not left:
        return None
    n = 0
    while (out / ".stale" / f"{st.name}-{n}").exists():
        n += 1
    dest = out / ".stale" / f"{st.name}-{n}"
    for p in left:
        (dest / p).parent.mkdir(parents=True, exist_ok=True)
        (out / p).rename(dest / p)
    return (f"{st.name}: an interrupted attempt left {', '.join(left)}; moved to "
            f"{dest.relative_to(out)}/ and rerunning the stage")


# ----------------------------------------------------------------------------- stage processes
# Every stage is its own process group (a signal to reproduce stops the stage and whatever
# it started) and that whole group dies when reproduce dies (a kill -9 leaves no orphan
# running beside the next --resume). PR_SET_PDEATHSIG alone reaches only the process it is
# set in: the processes a stage starts (analyze's and figures' --jobs workers and their
# forkserver; pool workers wait forever on a dead parent's queue) would live on with ppid 1.
# So each stage runs under a small guard, the group's leader: the kernel tells it (SIGHUP,
# its PDEATHSIG) that reproduce died and it SIGKILLs its group, the stage and all it started.
_LIVE: dict[int, subprocess.Popen] = {}
_LIVE_LOCK = threading.Lock()
_PR_SET_PDEATHSIG = 1
try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _PRCTL = None
_STAGE_ARGV = "ADAMSPIKE_STAGE_ARGV"     # the guarded stage's command (JSON), not in argv:
                                         # the guard's command line does not pose as the stage
_STAGE_GUARD = """
import json, os, signal, subprocess, sys
def gone(signum, frame):               # reproduce died: the stage's whole group goes
    os.killpg(0, signal.SIGKILL)
signal.signal(signal.SIGHUP, gone)
signal.signal(signal.SIGTERM, lambda s, f: None)   # sent to the group: the stage's to handle
if os.getppid() != int(sys.argv[1]):
    gone(0, None)
env = dict(os.environ)
cmd = json.loads(env.pop("%s"))
rc = subprocess.Popen(cmd, env=env).wait()
if rc < 0:                             # end as the stage ended: by its signal
    signal.signal(-rc, signal.SIG_DFL)
    os.kill(os.getpid(), -rc)
sys.exit(rc)
""" % _STAGE_ARGV


def _die_with_parent(parent: int, sig: int = signal.SIGKILL):
    """preexec_fn: `sig` to this process when `parent` (reproduce) dies, also if it died
    between the fork and this call. Only async-signal-safe work: prctl resolved above."""
    def set_up() -> None:
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
            if os.getppid() != parent:
                os._exit(137)
    return set_up


def _spawn(cmd: list[str], env: dict, **kw) -> tuple[int, float | None]:
    """Run a stage's command under the guard, in its own process group; its exit status and
    core-seconds: the CPU time (user + system) of the guard and the descendants it waited
    for (the stage and its workers), from wait4's rusage (per child: exact while other
    stages run beside it); None when stop_stages reaped it first."""
    guard = [sys.executable, "-c", _STAGE_GUARD, str(os.getpid())]
    p = subprocess.Popen(guard, process_group=0, env={**env, _STAGE_ARGV: json.dumps(cmd)},
                         preexec_fn=_die_with_parent(os.getpid(), signal.SIGHUP), **kw)
    with _LIVE_LOCK:
        _LIVE[p.pid] = p
    try:
        try:
            _, status, usage = os.wait4(p.pid, 0)
        except ChildProcessError:         # stop_stages' wait reaped it
            return p.wait(), None
        p.returncode = os.waitstatus_to_exitcode(status)
        return p.returncode, usage.ru_utime + usage.ru_stime
    finally:
        with _LIVE_LOCK:
            _LIVE.pop(p.pid, None)


def stop_stages(grace_s: float = 10.0) -> list[int]:
    """SIGTERM every running stage's process group, SIGKILL what is left after grace_s;
    returns the stopped pids."""
    with _LIVE_LOCK:
        live = list(_LIVE.values())
    for p in live:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)     # also what the stage started
        except ProcessLookupError:
            pass
    return [p.pid for p in live]


def _run_stage(st: Stage, out: Path, env: dict) -> dict:
    note = _set_aside(st, out)
    if note:
        tqdm.write(f"adamspike reproduce: {note}", file=sys.stderr)
    log = out / "logs" / f"{st.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "study", *st.argv]
    t0 = time.monotonic()
    with open(log, "w") as err:
        err.write((f"# {note}\n" if note else "") + "$ adamspike " + " ".join(st.argv) + "\n")
        err.flush()
        if st.stdout_to:
            dest = out / st.stdout_to
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(dest, "w") as fh:
                rc, core = _spawn(cmd, stdout=fh, stderr=err, env=env, cwd=REPO)
        else:
            rc, core = _spawn(cmd, stdout=err, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    seconds = time.monotonic() - t0
    missing_outputs = [p for p in st.outputs if not (out / p).exists()]
    if rc == NOT_BUILT:
        status = "missing"
    elif rc != 0:
        status = "failed"
    elif missing_outputs:
        status, rc = "failed", -1
    else:
        status = "ok"
    return {"name": st.name, "title": st.title, "status": status, "returncode": rc,
            "seconds": round(seconds, 2),
            "core_seconds": None if core is None else round(core, 2),
            "log": str(log.relative_to(out)), "missing_outputs": missing_outputs, "argv": st.argv}


def scale_note(plan: list[Stage], scale: str, study: Path = STUDY) -> str:
    """What the scale changed, for STUDY.md: the stages it left out and those that read the
    fit shipped with the package instead of measuring (their argv names its folder)."""
    if scale == "full":
        return ""
    shipped = str(package_data.profile_dir("llama2-70b"))
    names = {st.name for st in plan}
    left = [n for n in load_study(study, "full") if n not in names]
    reads = [st.name for st in plan if any(shipped in a for a in st.argv)]
    m = package_data.manifest("llama2-70b")
    lines = [f"Scale `{scale}` (`adamspike reproduce --full` recomputes everything: hours on 2 "
             "cores, cached by cell and resumable)."]
    if reads:
        lines.append(f"Read from the fit shipped with the package (`adamspike/data/llama2_70b`, "
                     f"version {m.get('version')} of {m.get('created')}): stage(s) "
                     f"{', '.join(f'`{n}`' for n in reads)}.")
    if left:
        lines.append(f"Left out at this scale: {', '.join(f'`{n}`' for n in left)}.")
    return " ".join(lines)


def _skipped(st: Stage, out: Path, reason: str) -> dict:
    log = out / "logs" / f"{st.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(reason + "\n")
    return {"name": st.name, "title": st.title, "status": "skipped", "returncode": None,
            "seconds": 0.0, "core_seconds": 0.0, "log": str(log.relative_to(out)),
            "missing_outputs": [], "argv": st.argv, "reason": reason}


def _mark_hash(res: dict) -> str:
    return hashlib.sha256(json.dumps({k: v for k, v in res.items() if k != "sha256"},
                                     sort_keys=True).encode()).hexdigest()


def write_mark(marks: Path, res: dict) -> None:
    """OUT/.stages/<stage>.json of a stage that succeeded: its result and the result's
    sha256, written whole (a temporary file renamed onto it)."""
    path = marks / f"{res['name']}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(json.dumps({**res, "sha256": _mark_hash(res)}, indent=2))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_mark(marks: Path, name: str) -> dict | None:
    """The result a finished stage left, or None (absent; or torn, altered, not a success:
    then one line says the stage reruns)."""
    path = marks / f"{name}.json"
    if not path.exists():
        return None
    try:
        res = json.loads(path.read_text())
        ok = (isinstance(res, dict) and res.get("sha256") == _mark_hash(res)
              and res.get("status") == "ok" and res.get("name") == name)
        why = "its content does not match its sha256 (torn or altered)"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        ok, why = False, f"it is unreadable ({type(e).__name__})"
    if not ok:
        tqdm.write(f"adamspike reproduce: {path}: {why}; rerunning stage {name}", file=sys.stderr)
        return None
    return {k: v for k, v in res.items() if k != "sha256"}


def _schedule(plan: list[Stage], out: Path, env: dict, marks: Path, resume: bool,
              jobs: int) -> list[dict]:
    """Run the stages, up to `jobs` at once, each once its `needs` and `after` are done.
    Results come back in plan order."""
    names = {st.name for st in plan}
    pending = list(plan)
    status: dict[str, str] = {}
    results: dict[str, dict] = {}
    running: dict = {}
    bar = tqdm(total=len(plan), desc="reproduce", unit="stage", file=sys.stderr)

    def finish(st: Stage, res: dict) -> None:
        status[st.name] = res["status"]
        results[st.name] = res
        bar.update(1)
        tqdm.write(f"[{res['status']:>7}] {st.name} ({res['seconds']} s)", file=sys.stderr)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        while pending or running:
            # a free slot takes the first ready stage in plan order (submitting every ready
            # stage at once would queue a stage that just became ready behind all others);
            # passes repeat while stages finish in place (resumed or skipped)
            changed = True
            while changed:
                changed = False
                for st in list(pending):
                    waits = [n for n in st.needs + st.after if n in names and n not in status]
                    if waits:
                        continue
                    done = read_mark(marks, st.name) if resume else None
                    failed = [n for n in st.needs if status.get(n, "ok") != "ok"]
                    if done is not None:
                        pending.remove(st)
                        finish(st, done)
                        changed = True
                    elif failed:
                        pending.remove(st)
                        finish(st, _skipped(st, out, "needs " + ", ".join(failed)))
                        changed = True
                    elif len(running) < jobs:
                        pending.remove(st)
                        running[pool.submit(_run_stage, st, out, env)] = st
            if not running:
                if pending:  # a dependency outside the plan that never finishes
                    for st in pending:
                        finish(st, _skipped(st, out, "dependencies not in this run"))
                    pending.clear()
                continue
            finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for fut in finished:
                st = running.pop(fut)
                res = fut.result()
                if res["status"] == "ok":
                    write_mark(marks, res)
                finish(st, res)
    bar.close()
    return [results[st.name] for st in plan]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adamspike reproduce", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/study", help="output folder (must be new or empty)")
    scale = ap.add_mutually_exclusive_group()
    scale.add_argument("--quick", action="store_const", const="quick", dest="scale",
                       help="CI scale (a few minutes): configs/study.toml's quick values")
    scale.add_argument("--full", action="store_const", const="full", dest="scale",
                       help="every measurement recomputed, the phase maps and the batch-sharpness "
                            "ladder included (hours on 2 cores; cached by cell, --resume "
                            "continues); default: the standard scale, which reads those from "
                            "the fit shipped with the package")
    ap.add_argument("--resume", action="store_true", help="continue an interrupted study")
    ap.add_argument("--study", default=str(STUDY),
                    help="the stages, as TOML (default configs/study.toml)")
    ap.add_argument("--only", nargs="+", metavar="STAGE", help="run only these stages")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="stages run at once (independent stages overlap; default 2)")
    ap.add_argument("--executor", choices=("local", "ray"), default="local",
                    help="where the stages that write cells (adamspike.cells) compute them: "
                         "local worker processes, or Ray tasks (--address, else a local Ray)")
    ap.add_argument("--address", help="Ray cluster address for --executor ray (HOST:PORT)")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()) and not args.resume:
        print(f"adamspike reproduce: {out} exists and is not empty; use --resume or a new "
              "--out (nothing was overwritten)", file=sys.stderr)
        return 2
    try:      # a read-only or unwritable --out: one line before anything runs
        check_out(out, keep_existing=True)
    except OutputPathError as e:
        print(f"adamspike reproduce: {e}", file=sys.stderr)
        return 2
    try:
        args.scale = args.scale or "standard"
        plan = stages(out, args.scale, max(1, args.jobs), Path(args.study))
        note = scale_note(plan, args.scale, Path(args.study))
        contributions(Path(args.study), args.scale)      # STUDY.md's entries, checked now
    except ConfigError as e:
        print(f"adamspike reproduce: {e}", file=sys.stderr)
        return 2
    if args.only:
        unknown = sorted(set(args.only) - {s.name for s in plan})
        if unknown:
            print(f"adamspike reproduce: unknown stage(s) {unknown}; known: "
                  f"{[s.name for s in plan]}", file=sys.stderr)
            return 2
        plan = [s for s in plan if s.name in args.only]
    # a study folder keeps its scale: resuming it at another would take the other scale's
    # finished stages (a reduced map, a refitted ladder) as this one's
    scale_file = out / ".stages" / "scale"
    if scale_file.is_file() and scale_file.read_text().strip() != args.scale:
        print(f"adamspike reproduce: {out} holds a study at scale "
              f"{scale_file.read_text().strip()!r}; resume it at that scale or use a new --out "
              f"for {args.scale!r} (nothing was changed)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    try:     # one writer per study folder (released when this process ends, even by kill -9)
        lock = RunLock(out).acquire(new=None)
    except RunFormatError as e:
        print(f"adamspike reproduce: {e}", file=sys.stderr)
        return 2
    marks = out / ".stages"
    marks.mkdir(exist_ok=True)
    scale_file.write_text(args.scale + "\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ADAMSPIKE_STUDY": str(out)}
    # overlapping stages share the cores instead of oversubscribing them
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, args.jobs))))
    # JAX's persistent compilation cache is per user (simulate/__init__.py): a second study
    # into a new folder, and the next --resume, load every program the first compiled
    env["ADAMSPIKE_EXECUTOR"] = args.executor          # adamspike.cells.run_cells' default
    if args.address:
        env["ADAMSPIKE_RAY_ADDRESS"] = args.address
    # the analyses' tables of exact theory values (analysis.fits), computed once per study
    env.setdefault("ADAMSPIKE_CACHE_DIR", str(out / ".cache"))

    def interrupted(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stopped = stop_stages()
        print(f"adamspike reproduce: interrupted by {signal.Signals(signum).name}; stopped "
              f"{len(stopped)} running stage(s) (--resume continues)", file=sys.stderr)
        lock.release()
        os._exit(128 + signum)   # the pool's threads wait on stages already stopped

    handlers = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        results = _schedule(plan, out, env, marks, args.resume, max(1, args.jobs))
        (out / "stages.json").write_text(json.dumps(results, indent=2))
        report = write_study_report(out, results, args.scale, note, Path(args.study))
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
        lock.release()
    print(f"study written to {out} (report: {report})")
    bad = [r["name"] for r in results if r["status"] in ("failed", "skipped")]
    missing = [r["name"] for r in results if r["status"] == "missing"]
    if missing:
        print(f"missing (not built yet): {', '.join(missing)}", file=sys.stderr)
    if bad:
        print(f"failed or skipped: {', '.join(bad)} (see {out}/logs)", file=sys.stderr)
        return 1
    return 0
