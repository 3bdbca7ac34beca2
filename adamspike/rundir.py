"""The run directory: the one interface between the backends and analysis. Its layout,
tables and columns are the contract of docs/design.md ("Run directory").

Crash safety: rows are buffered and flushed as a new parquet part, written to a temporary
name, fsynced and renamed, so a reader never sees half a part and a killed writer loses at
most the rows since its last flush. `flush()` returns once every buffered row is durable:
a trainer calls it before it writes a checkpoint, so a complete checkpoint at step s implies
that every row <= s (steps, layers, hists; events are fsynced line by line) is on disk.
A torn last event line is skipped (and counted) on read; a writer reopening the run first
moves it to events.discarded.jsonl (event "events_repaired"), so the next event is not
appended to it.

Resume: `RunWriter(path, ..., resume_from_step=S)` drops every row with step > S (parts are
rewritten atomically under their own names) and every per-step event with step > S (moved
to events.discarded.jsonl; lifecycle events such as start / resume / fault / abort stay)
before new rows arrive, so a run killed anywhere and resumed from its checkpoint S holds
every step exactly once. As a second line of defence the reader keeps the last-written row
for a duplicated key.

Readers see a consistent snapshot of a live or resuming run: while a writer is open,
RUN/flushed.json records its host and pid and the last step whose rows are all on disk,
after every flush (a flush the writer triggers itself, by time or rows, may fall inside a
step: it records the step before); a resume records its checkpoint step there before it
truncates, and a guard's rollback (`RunWriter.rewind`) records its checkpoint step until
the re-run's rows are on disk. The record also names the writer's session and, per table,
how many part files hold those rows (parts a session wrote never change while it lives).
While that writer lives, `load_run` reads only those parts, and in them only rows and
per-step events up to that step (lifecycle events whole), skips a part deleted under it,
and reads again if a new session (a resume) began meanwhile, so its tables describe one
moment however far the writer moved during the read (a step bound alone did not: a read
that outlived a rollback and its re-run to the same step mixed both trajectories). A
closed or killed writer's run is read whole (a kill loses at most the last flush
interval).

One writer per run: `RunLock` takes an exclusive, non-blocking `fcntl.flock` on
RUN/writer.lock and records host, pid and start time in it; a second writer (trainer,
resume, sweep) is refused with `RunLockedError` naming the holder. The kernel drops the lock
when its process dies, so a lock file left by a killed writer (a non-empty record whose
flock is free) is stale and is taken over (`RunLock.stale` holds the old record). Records
of dead writers not yet logged as "lock_taken_over" events (`RunLock.unlogged`) are carried
in the new record until a RunWriter logs them, so a resume that dies before it opens the
run directory does not erase the record of the crash before it. On a file
system without flock the record is the lock: it is honoured while its pid is alive on this
host. RunWriter takes the lock itself unless it is handed one already held.

Framework-free (numpy, pandas, pyarrow): the JAX and torch backends both write through it;
only rank 0 should hold a writer.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from adamspike.config import ConfigError
from adamspike.faults import kill_point
from adamspike.metrics import HIST_EDGES, METRIC_NAMES, NUM_VHIST_BINS, VHIST_EDGES

SCHEMA_VERSION = 1
BACKENDS = ("jax", "torch", "megatron")

STEP_COLUMNS: dict[str, pa.DataType] = {
    "step": pa.int64(), "tokens": pa.int64(), "loss": pa.float64(), "lr": pa.float64(),
    "grad_norm": pa.float64(), "clipped": pa.bool_(), "update_norm": pa.float64(),
    "step_time_s": pa.float64(), "skipped": pa.bool_(),
}
LAYER_KEY_COLUMNS: dict[str, pa.DataType] = {
    "step": pa.int64(), "name": pa.string(), "depth": pa.int32(), "kind": pa.string(),
    "numel": pa.int64(),
}
# Metrics are stored as float32: a 70B-shaped trace (723 tensors x 20k steps) stays small.
LAYER_COLUMNS: dict[str, pa.DataType] = {
    **LAYER_KEY_COLUMNS, **{m: pa.float32() for m in METRIC_NAMES}}
HIST_COLUMNS: dict[str, pa.DataType] = {
    "step": pa.int64(), "name": pa.string(), "depth": pa.int32(), "kind": pa.string(),
    "counts": pa.list_(pa.int64()),
}
# + g_below_eps: coordinates with |g| < eps of the gradient Adam consumed on that step
VHIST_COLUMNS: dict[str, pa.DataType] = {**HIST_COLUMNS, "g_below_eps": pa.int64()}
# Top preconditioned / raw curvature per depth group every K steps (toys; simulate.curvature).
CURVATURE_COLUMNS: dict[str, pa.DataType] = {
    "step": pa.int64(), "group": pa.string(), "precond_curvature": pa.float64(),
    "raw_curvature": pa.float64(), "lr": pa.float64(),
}
# columns added after a table's first release: absent in older parts, read back as nulls
OPTIONAL_COLUMNS = {"vhists": {"g_below_eps"}}
TABLES = {"steps": STEP_COLUMNS, "layers": LAYER_COLUMNS, "hists": HIST_COLUMNS,
          "vhists": VHIST_COLUMNS, "curvature": CURVATURE_COLUMNS}
TABLE_KEYS = {"steps": ["step"], "layers": ["step", "name"], "hists": ["step", "name"],
              "vhists": ["step", "name"], "curvature": ["step", "group"]}
KINDS = ("embed", "wq", "wk", "wv", "wo", "w1", "w2", "w3", "norm", "output", "param")


LOCK_FILE = "writer.lock"
FLUSHED_FILE = "flushed.json"     # {"step": last step whose rows are all on disk}
DISCARDED_EVENTS = "events.discarded.jsonl"
# Events that describe the run's life rather than a step's trace: kept on resume truncation.
LIFECYCLE_EVENTS = frozenset({"start", "resume", "end", "fault", "abort", "config_changed",
                              "checkpoint_rejected", "lock_taken_over", "guard_gave_up",
                              "events_repaired"})


class RunFormatError(ValueError):
    """A run directory is missing, malformed, or of another schema version."""


class RunLockedError(RunFormatError):
    """Another live process writes this run directory."""


# ----------------------------------------------------------------------------- helpers

def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to `path` via a temp file + fsync + rename (readers see old or new, never half)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _atomic_write_table(path: Path, table: pa.Table) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp, compression="zstd")
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def read_json(path: Path, error: type[Exception], missing: str) -> Any:
    """Parse a JSON file; a missing file or bad JSON raises `error` naming the path."""
    path = Path(path)
    if not path.is_file():
        raise error(missing)
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: invalid JSON ({e})") from None


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def json_clean(o: Any) -> Any:
    """The project's one JSON non-finite cleaner: non-finite floats become None (strict
    JSON, `allow_nan=False` holds), numpy scalars / arrays / bools become Python values,
    tuples lists, dict keys strings. Every JSON file the project writes goes through it
    (fullscale/megatron_probe.py keeps its own copy: it must import on python 3.8 with torch
    and numpy only)."""
    if isinstance(o, dict):
        return {str(k): json_clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_clean(v) for v in o]
    if isinstance(o, np.ndarray):
        return json_clean(o.tolist())
    if isinstance(o, (bool, np.bool_)):
        return bool(o)
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, (float, np.floating)):
        o = float(o)
        return o if math.isfinite(o) else None
    return o


def git_info(cwd: Path | None = None) -> dict[str, Any]:
    """Git sha and dirty flag of the source tree (None outside a checkout)."""
    cwd = cwd or Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    cwd=cwd, capture_output=True, text=True,
                                    timeout=10).stdout.strip()) if sha else None
    except (OSError, subprocess.SubprocessError):
        sha, dirty = None, None
    return {"git_sha": sha, "git_dirty": dirty}


def environment(**extra: Any) -> dict[str, Any]:
    """Versions, host and git state; backends add device / world_size / framework versions."""
    env = {"python": sys.version.split()[0], "platform": platform.platform(),
           "hostname": platform.node(), "numpy": np.__version__, "pandas": pd.__version__,
           "pyarrow": pa.__version__, **git_info()}
    env.update(extra)
    return env


# ----------------------------------------------------------------------------- ownership

class OutputPathError(ConfigError):
    """An output path a command must not write to (check_out); a ConfigError, so every
    CLI's one-line error path (adamspike.config.cli_main) reports it."""


OWNER_FILE = ".adamspike-out"    # in an output folder: the command that writes it


def _in_study(path: Path) -> bool:
    """Inside the study folder of the `adamspike reproduce` running this stage (its stages
    own their folders there: reproduce holds the folder's lock and sets aside what an
    interrupted stage left)."""
    study = os.environ.get("ADAMSPIKE_STUDY")
    try:
        return bool(study) and path.resolve().is_relative_to(Path(study).resolve())
    except (OSError, AttributeError):     # AttributeError: python < 3.9
        return bool(study) and str(path.resolve()).startswith(str(Path(study).resolve()) + os.sep)


def check_out(path: str | Path, *, flag: str = "--out", kind: str = "dir",
              keep_existing: bool = False, owner: str | None = None) -> Path:
    """Where a command may write its output, checked before it computes anything (one rule
    for every command that writes): the nearest existing folder on the way is a directory,
    on a file system mounted read-write and writable by this user (a check, not a probe
    write: nothing is created here); the path itself is absent or, for kind="dir", an empty
    folder, so nothing the command did not write is overwritten. keep_existing: an existing
    folder is the command's own to continue (a resumable sweep, `reproduce --resume`).
    owner: a command that fills a folder with fixed names (figures, science4) may write
    into a non-empty one that it claimed before (`claim_out`), or one inside the study
    folder of the reproduce running it. OutputPathError, one line naming the flag and the
    path, otherwise."""
    path = Path(path)
    where = f"{flag} {path}" if flag else str(path)
    if path.exists() or path.is_symlink():
        if kind == "file" or not path.is_dir():
            raise OutputPathError(f"{where}: exists{' and is not a directory' if kind == 'dir' else ''}"
                                  " (nothing was overwritten; choose a new path)")
        own = keep_existing or (owner is not None and (
            _owner_of(path) == owner or _in_study(path)))
        if not own and any(p.name != LOCK_FILE for p in path.iterdir()):
            raise OutputPathError(
                f"{where}: exists and is not an empty directory"
                + (f" that `adamspike {owner}` wrote" if owner else "")
                + "; choose a new one (nothing was overwritten)")
        target = path
    else:
        target = next((p for p in path.absolute().parents if p.exists()), Path("/"))
        if not target.is_dir():
            raise OutputPathError(f"{where}: {target} is a file, not a directory")
    try:
        read_only = bool(os.statvfs(target).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        raise OutputPathError(f"{where}: {target} is on a read-only file system (nothing was "
                              "written)")
    if not os.access(target, os.W_OK | os.X_OK):
        raise OutputPathError(f"{where}: {target} is not writable by this user (nothing was "
                              "written)")
    return path


def _owner_of(path: Path) -> str | None:
    try:
        return (path / OWNER_FILE).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def claim_out(path: str | Path, owner: str) -> Path:
    """Create the output folder checked by check_out(owner=...) and mark it as `owner`'s,
    so that its next run may write there again (and no other command's)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if _owner_of(path) != owner:
        atomic_write_bytes(path / OWNER_FILE, (owner + "\n").encode())
    return path


def check_new_run_dir(path: str | Path, *, hint: str = "resume it or choose a new directory"
                      ) -> Path:
    """A path a new run may be written to: absent, or an empty directory (a lock file alone
    counts as empty); RunFormatError naming the problem (and `hint`, what to do about a
    non-empty one) otherwise."""
    path = Path(path)
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise RunFormatError(f"{path}: {parent} is a file, not a directory")
            break
    if path.exists():
        if not path.is_dir():
            raise RunFormatError(f"{path}: exists and is a file, not a run directory "
                                 "(nothing was overwritten)")
        if any(p.name != LOCK_FILE for p in path.iterdir()):
            raise RunFormatError(
                f"{path}: run directory exists and is not empty; {hint} (nothing was "
                "overwritten)")
    try:
        check_out(path, flag="", keep_existing=True)      # a read-only or unwritable place
    except OutputPathError as e:
        raise RunFormatError(str(e)) from None
    return path


def move_aside(path: str | Path) -> Path | None:
    """Rename a non-empty run directory to PATH.restart-<UTC time> so a new run can start
    at PATH (a trainer's --restart), refused while a live writer holds it. Returns the new
    name, or None when PATH is absent or empty (nothing to move). Nothing is deleted."""
    path = Path(path)
    try:
        check_new_run_dir(path)
        return None
    except RunLockedError:
        raise
    except RunFormatError:
        if not path.is_dir():
            raise
    lock = RunLock(path).acquire(new=False) if (path / "run.json").is_file() else None
    try:
        aside = path.with_name(f"{path.name}.restart-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
        n = 1
        while aside.exists():
            aside, n = aside.with_name(f"{aside.name.split('~')[0]}~{n}"), n + 1
        os.replace(path, aside)
        _fsync_dir(aside.parent)
    finally:
        if lock is not None:
            lock.release()
    return aside


def _pid_alive(pid: int) -> bool:
    if pid <= 0:        # os.kill(0 or -1, 0) would ask about a whole process group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """Exclusive ownership of a run directory for one writing process (see module doc).

    >>> lock = RunLock(run_dir).acquire(new=True)   # RunLockedError if someone writes it
    >>> ...; lock.release()
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.file = self.path / LOCK_FILE
        self.stale: dict | None = None      # record of a dead writer taken over
        self.unlogged: list[dict] = []      # dead writers' records not yet logged as events
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, *, new: bool | None) -> "RunLock":
        """Take the lock. new=True: the directory must be new or empty (it is created);
        new=False: it must be a run directory (run.json); None: any existing directory
        (a study folder: `adamspike reproduce`'s one writer)."""
        if self._fd is not None:
            return self
        if new is None:
            pass
        elif new:
            check_new_run_dir(self.path)
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise RunFormatError(f"{self.path}: cannot create the run directory "
                                     f"({e.strerror})") from None
        else:
            read_meta(self.path)
        try:
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise RunFormatError(f"{self.file}: cannot open the lock file ({e.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            flock_ok = True
        except BlockingIOError:
            holder = _read_record(fd)
            os.close(fd)
            raise RunLockedError(f"{self.path}: in use by another writer ({_describe(holder)}); "
                                 "refusing to write it too (nothing was changed)") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                os.close(fd)
                raise RunFormatError(f"{self.file}: cannot lock ({e.strerror})") from None
            flock_ok = False
        previous = _read_record(fd)
        if previous and not flock_ok and previous.get("host") == socket.gethostname() \
                and _pid_alive(int(previous.get("pid", -1))) and previous.get("pid") != os.getpid():
            os.close(fd)
            raise RunLockedError(f"{self.path}: in use by another writer ({_describe(previous)}); "
                                 "refusing to write it too (nothing was changed)")
        holder = {k: v for k, v in (previous or {}).items() if k != "unlogged"}
        self.stale = holder or None
        self.unlogged = [r for r in (previous or {}).get("unlogged", []) if isinstance(r, dict)]
        if holder:      # its writer died holding the lock
            self.unlogged.append(holder)
        self._fd = fd
        self._write_record({"host": socket.gethostname(), "pid": os.getpid(),
                            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "flock": flock_ok})
        return self

    def _write_record(self, record: dict) -> None:
        if self.unlogged:
            record = {**record, "unlogged": self.unlogged}
        os.ftruncate(self._fd, 0)
        if record:
            os.pwrite(self._fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(self._fd)

    def logged(self) -> None:
        """The unlogged records are now events: drop them from the record."""
        if self._fd is not None and self.unlogged:
            rec = {k: v for k, v in _read_record(self._fd).items() if k != "unlogged"}
            self.unlogged = []
            self._write_record(rec)

    def release(self) -> None:
        """Clear the record and drop the lock (the file stays: unlinking a locked file
        would let two later writers lock two different files)."""
        if self._fd is None:
            return
        try:
            self._write_record({})      # keeps the unlogged records of dead writers, if any
        except OSError:
            pass
        finally:
            fd, self._fd = self._fd, None
            os.close(fd)    # closing the descriptor releases the flock


def _read_record(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        rec = json.loads(data.decode()) if data.strip() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {"host": "?", "pid": -1, "since": "?"}
    return rec if isinstance(rec, dict) else {}


def _describe(rec: dict) -> str:
    if not rec:
        return "holder unknown"
    return f"pid {rec.get('pid', '?')} on host {rec.get('host', '?')} since {rec.get('since', '?')}"


# ----------------------------------------------------------------------------- writer

@dataclass
class _Buffer:
    name: str
    schema: Mapping[str, pa.DataType]
    rows: list[dict] = field(default_factory=list)
    columns: dict[str, list] = field(default_factory=dict)   # columnar batches
    num_rows: int = 0


class RunWriter:
    """Writes one run directory. Use as a context manager (close() flushes).

    >>> with RunWriter(path, backend="jax", config=cfg_dict) as w:
    ...     w.log_step(step=1, tokens=..., loss=..., ...)
    ...     w.log_layers(step=1, rows=[{"name": ..., "depth": ..., ...}, ...])
    ...     w.log_hist(step=1, name=..., depth=..., kind=..., counts=...)
    ...     w.event("checkpoint", step=1, path="...")

    flush_every_s / flush_every_rows bound what a crash can lose; `flush()` makes every
    buffered row durable (call it before a checkpoint). `resume_from_step` reopens an
    existing run and truncates rows (and per-step events) after that step. `lock`: a
    RunLock already held for this directory (the writer takes its own otherwise, and
    releases it on close()).
    """

    def __init__(self, path: str | Path, *, backend: str, config: Mapping[str, Any] | None = None,
                 env: Mapping[str, Any] | None = None, resume_from_step: int | None = None,
                 flush_every_s: float = 30.0, flush_every_rows: int = 50_000,
                 hist_edges: np.ndarray = HIST_EDGES, extra_meta: Mapping[str, Any] | None = None,
                 lock: RunLock | None = None):
        if backend not in BACKENDS:
            raise RunFormatError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.path = Path(path)
        self.lock = lock if lock is not None else RunLock(self.path)
        self.flush_every_s = float(flush_every_s)
        self.flush_every_rows = int(flush_every_rows)
        self._last_flush = time.monotonic()
        self._buffers = {t: _Buffer(t, s) for t, s in TABLES.items()}
        self._closed = False
        self._session = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
        self.repaired_events_tail = 0   # bytes of a torn last event line moved aside on open
        new_run = resume_from_step is None
        if new_run:
            check_new_run_dir(self.path)   # before anything is created in it
        self.lock.acquire(new=new_run)
        try:
            self._open(backend, config, env, resume_from_step, hist_edges, extra_meta)
        except BaseException:
            if lock is None:
                self.lock.release()
            raise

    def _open(self, backend, config, env, resume_from_step, hist_edges, extra_meta) -> None:
        meta_path = self.path / "run.json"
        if resume_from_step is None:
            check_new_run_dir(self.path)   # again, under the lock
            for t in TABLES:
                (self.path / t).mkdir(exist_ok=True)
            self.meta = {
                "schema_version": SCHEMA_VERSION, "backend": backend,
                "config": dict(config or {}), "environment": dict(env or environment()),
                "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "hist_edges": [float(x) for x in hist_edges],
                "vhist_edges": [float(x) for x in VHIST_EDGES], **dict(extra_meta or {}),
            }
            atomic_write_bytes(meta_path, json.dumps(json_clean(self.meta), indent=2,
                                                     default=_json_default).encode())
            self._next_part = {t: 0 for t in TABLES}
            self._flushed_step = self._written_step = 0
            self._record_flushed()
        else:
            self.meta = read_meta(self.path)
            if self.meta["backend"] != backend:
                raise RunFormatError(f"{self.path}: run was written by backend "
                                     f"{self.meta['backend']!r}, cannot resume with {backend!r}")
            self._remove_temporaries()
            self.repaired_events_tail = self._repair_events_tail()
            self._flushed_step = self._written_step = int(resume_from_step)
            self._record_flushed()      # before truncating: readers stop at the checkpoint
            self._next_part = {t: self._truncate(t, int(resume_from_step)) for t in TABLES}
            self._record_flushed()      # truncated: the cut's part files are known again
            dropped = self._truncate_events(int(resume_from_step))
            self.event("resume", step=int(resume_from_step), discarded_events=dropped)
        for record in self.lock.unlogged:
            self.event("lock_taken_over", previous=record)
        self.lock.logged()

    # -- public API ------------------------------------------------------------------
    def log_step(self, **row: Any) -> None:
        """One optimizer step; all STEP_COLUMNS are required, extra numeric keys are kept."""
        missing = [c for c in STEP_COLUMNS if c not in row]
        if missing:
            raise RunFormatError(f"steps row is missing column(s): {', '.join(missing)}")
        self._append("steps", row)

    def log_layers(self, step: int, rows: Iterable[Mapping[str, Any]] | None = None,
                   columns: Mapping[str, Any] | None = None) -> None:
        """Per-tensor metrics of one step, as a list of row dicts or as columns (arrays of
        equal length: name, depth, kind, numel and every metric)."""
        buf = self._buffers["layers"]
        if columns is not None:
            n = len(columns["name"])
            missing = [c for c in LAYER_COLUMNS if c != "step" and c not in columns]
            if missing:
                raise RunFormatError(f"layers columns missing: {', '.join(missing)}")
            for c in LAYER_COLUMNS:
                vals = [int(step)] * n if c == "step" else list(np.asarray(columns[c]).tolist())
                if len(vals) != n:
                    raise RunFormatError(f"layers column {c!r} has {len(vals)} values, expected {n}")
                buf.columns.setdefault(c, []).extend(vals)
            buf.num_rows += n
        for r in rows or ():
            self._append("layers", {"step": int(step), **r})
        self._maybe_flush()

    def log_hist(self, step: int, name: str, depth: int, kind: str, counts: Any) -> None:
        counts = np.asarray(counts, dtype=np.int64)
        expected = len(self.meta["hist_edges"]) - 1
        if counts.shape != (expected,):
            raise RunFormatError(f"hist {name!r}: {counts.shape} counts, expected ({expected},)")
        self._append("hists", {"step": int(step), "name": name, "depth": int(depth),
                               "kind": kind, "counts": counts.tolist()})

    def log_vhist(self, step: int, name: str, depth: int, kind: str, counts: Any,
                  g_below_eps: int | None = None) -> None:
        """sqrt(v_hat)/eps counts of one tensor on adamspike.metrics.VHIST_EDGES, and the
        number of its coordinates with |g| < eps (None: not recorded)."""
        counts = np.asarray(counts, dtype=np.int64)
        if counts.shape != (NUM_VHIST_BINS,):
            raise RunFormatError(f"vhist {name!r}: {counts.shape} counts, expected "
                                 f"({NUM_VHIST_BINS},)")
        self._append("vhists", {"step": int(step), "name": name, "depth": int(depth),
                                "kind": kind, "counts": counts.tolist(),
                                "g_below_eps": None if g_below_eps is None
                                else int(g_below_eps)})

    def log_curvature(self, step: int, group: str, precond_curvature: float,
                      raw_curvature: float, lr: float) -> None:
        """One depth group's top curvatures at a step (the `curvature` table)."""
        self._append("curvature", {"step": int(step), "group": str(group),
                                   "precond_curvature": float(precond_curvature),
                                   "raw_curvature": float(raw_curvature), "lr": float(lr)})

    def event(self, type: str, **fields: Any) -> None:
        """Append one event line (fsynced at once: events are rare and precious)."""
        append_event(self.path, type, **fields)

    def flush(self, *, step_complete: bool = True) -> None:
        """Write every buffered row as new parts; durable (fsynced, renamed) on return.
        step_complete=False: the newest step may still be logging (a flush triggered by
        time or rows), so flushed.json records the step before it."""
        last_step = max((int(r["step"]) for r in self._buffers["steps"].rows), default=-1)
        for t, buf in self._buffers.items():
            if buf.num_rows:
                self._write_part(t, buf)
            if t == "steps" and last_step >= 0:
                kill_point("rundir.flush", last_step)
        complete = self._written_step - (0 if step_complete else 1)
        if complete > self._flushed_step:
            self._flushed_step = complete
            self._record_flushed()
        self._last_flush = time.monotonic()

    def rewind(self, step: int) -> None:
        """The run went back to `step` (the guard rolled back to its checkpoint): the rows
        logged beyond it stay on disk (readers keep the last row per step, so the re-run's
        rows replace them), but flushed.json says `step` until the re-run's rows are on
        disk, so that a reader of the live run never splices the re-run's rows with the
        abandoned ones."""
        self.flush()                    # the abandoned rows' parts precede the re-run's
        self._flushed_step = self._written_step = int(step)
        self._record_flushed()

    def _record_flushed(self, closed: bool = False) -> None:
        # `writer` names this writer's session and `parts` the part files (per table) that
        # hold every row up to `step`: parts below those indices never change while the
        # session lives (new rows go to new parts; only a new session's resume rewrites),
        # so a reader that finds the same session before and after its read has one cut.
        # `parts` is left out while a resume is still truncating (the step bounds it then).
        rec = {"step": self._flushed_step, "host": socket.gethostname(), "pid": os.getpid(),
               "writer": self._session}
        if getattr(self, "_next_part", None) is not None:
            rec["parts"] = dict(self._next_part)
        atomic_write_bytes(self.path / FLUSHED_FILE,
                           json.dumps({**rec, "closed": True} if closed else rec).encode())

    def close(self) -> None:
        """Flush and release the run directory's lock."""
        if not self._closed:
            try:
                self.flush()
                self._record_flushed(closed=True)
            finally:
                self._closed = True
                self.lock.release()

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------
    def _append(self, table: str, row: Mapping[str, Any]) -> None:
        buf = self._buffers[table]
        if buf.columns:  # mixing row and column appends: fold columns into rows first
            self._write_part(table, buf)
        buf.rows.append(dict(row))
        buf.num_rows += 1
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        total = sum(b.num_rows for b in self._buffers.values())
        if total >= self.flush_every_rows or time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush(step_complete=False)

    def _to_table(self, table: str, buf: _Buffer) -> pa.Table:
        schema = TABLES[table]
        if buf.columns:
            data = dict(buf.columns)
        else:
            extras = sorted({k for r in buf.rows for k in r} - set(schema))
            data = {c: [r.get(c) for r in buf.rows] for c in list(schema) + extras}
        arrays, names = [], []
        for c, values in data.items():
            tp = schema.get(c)
            try:
                if tp is None:
                    arr = pa.array(values)
                elif tp in (pa.float32(), pa.float64()):
                    arr = pa.array(np.asarray([np.nan if v is None else v for v in values],
                                              dtype=np.float64), type=pa.float64()).cast(tp)
                else:
                    arr = pa.array(values, type=tp)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as e:
                raise RunFormatError(f"{table}.{c}: bad values ({e})") from None
            if tp is not None and c in ("step", "name") and arr.null_count:
                raise RunFormatError(f"{table}.{c}: missing values")
            arrays.append(arr)
            names.append(c)
        return pa.Table.from_arrays(arrays, names=names)

    def _write_part(self, table: str, buf: _Buffer) -> None:
        tbl = self._to_table(table, buf)
        idx = self._next_part[table]
        _atomic_write_table(self.path / table / f"part-{idx:06d}.parquet", tbl)
        self._written_step = max(self._written_step, _max_step(buf))
        self._next_part[table] = idx + 1
        buf.rows, buf.columns, buf.num_rows = [], {}, 0

    def _remove_temporaries(self) -> None:
        """Temporary files of writes killed halfway (never read: not part-*.parquet)."""
        for d in [self.path, *(self.path / t for t in TABLES)]:
            if d.is_dir():
                for p in d.glob(".*.tmp-*"):
                    p.unlink(missing_ok=True)

    def _repair_events_tail(self) -> int:
        """A writer killed inside an event's write (or a damaged file) leaves a last line
        without its newline; the next event would be appended to it and both be unreadable.
        Move the fragment to events.discarded.jsonl (as a "torn_line" record keeping its
        text), cut it off, and log "events_repaired". Returns the bytes moved (0: intact)."""
        p = self.path / "events.jsonl"
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            return 0
        if size == 0:
            return 0
        with open(p, "rb+") as fh:
            fh.seek(size - 1)
            if fh.read(1) == b"\n":
                return 0
            fh.seek(max(0, size - (1 << 20)))
            tail = fh.read()
            cut = size - len(tail) + tail.rfind(b"\n") + 1
            fh.seek(cut)
            fragment = fh.read()
            rec = {"time": time.time(), "type": "torn_line",
                   "text": fragment.decode("utf-8", errors="replace")}
            with open(self.path / DISCARDED_EVENTS, "a", encoding="utf-8") as out:
                out.write(json.dumps(rec) + "\n")
                out.flush()
                os.fsync(out.fileno())
            fh.truncate(cut)
            fh.flush()
            os.fsync(fh.fileno())
        self.event("events_repaired", torn_bytes=len(fragment), moved_to=DISCARDED_EVENTS)
        return len(fragment)

    def _truncate_events(self, step: int) -> int:
        """Move per-step events with step > `step` to events.discarded.jsonl (the rewrite
        of events.jsonl is atomic); returns how many were moved."""
        p = self.path / "events.jsonl"
        if not p.is_file():
            return 0
        keep, drop = [], []
        for line in p.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
            try:
                rec = json.loads(line)
                late = (isinstance(rec, dict) and rec.get("type") not in LIFECYCLE_EVENTS
                        and isinstance(rec.get("step"), int) and rec["step"] > step)
            except json.JSONDecodeError:
                late = False   # a torn line stays (the reader skips and counts it)
            (drop if late else keep).append(line if line.endswith("\n") else line + "\n")
        if drop:
            with open(self.path / DISCARDED_EVENTS, "a", encoding="utf-8") as fh:
                fh.writelines(drop)
                fh.flush()
                os.fsync(fh.fileno())
            atomic_write_bytes(p, "".join(keep).encode())
        return len(drop)

    def _truncate(self, table: str, step: int) -> int:
        """Drop rows with step > `step`; return the next free part index."""
        d = self.path / table
        d.mkdir(exist_ok=True)
        parts = sorted(d.glob("part-*.parquet"))
        for p in parts:
            try:
                tbl = pq.read_table(p)
            except Exception as e:  # noqa: BLE001 - any unreadable part is a format error
                raise RunFormatError(f"{p}: unreadable parquet part ({e})") from None
            steps = tbl.column("step").to_numpy()
            if (steps > step).all():
                p.unlink()
            elif (steps > step).any():
                _atomic_write_table(p, tbl.filter(pa.array(steps <= step)))
        parts = sorted(d.glob("part-*.parquet"))
        return (int(parts[-1].stem.split("-")[1]) + 1) if parts else 0


def _max_step(buf: _Buffer) -> int:
    steps = [int(r["step"]) for r in buf.rows] + [int(x) for x in buf.columns.get("step", ())]
    return max(steps, default=-1)


# ----------------------------------------------------------------------------- reader

@dataclass
class Run:
    path: Path
    meta: dict
    steps: pd.DataFrame
    layers: pd.DataFrame
    hists: pd.DataFrame
    events: pd.DataFrame
    torn_event_lines: int = 0
    vhists: pd.DataFrame = field(default_factory=pd.DataFrame)
    curvature: pd.DataFrame = field(default_factory=pd.DataFrame)
    snapshot_step: int | None = None    # rows read up to this step (flushed.json)

    @property
    def hist_edges(self) -> np.ndarray:
        return np.asarray(self.meta.get("hist_edges", HIST_EDGES), dtype=np.float64)

    @property
    def config(self) -> dict:
        return normalize_config(self.meta.get("config", {}))

    @property
    def backend(self) -> str:
        return self.meta["backend"]


OPTIM_KEYS = ("lr", "eps", "b1", "b2")


def normalize_config(cfg: Mapping[str, Any] | None) -> dict:
    """A run.json config in the one shape the readers use, whichever writer made it: the
    sections nested ({"optim": {"eps": ...}}; older sweep run directories wrote dotted keys
    "optim.eps" at the top), `problem` a table with its `kind` (older sweep runs wrote the
    name alone), and the toy's optimizer settings in `optim` (the quadratic CLI wrote them
    inside `problem` only). The stored file is left as it is."""
    if not isinstance(cfg, Mapping):
        return {}
    out: dict = {}
    for k, v in cfg.items():
        if isinstance(k, str) and "." in k:
            *path, leaf = k.split(".")
            d = out
            for p in path:
                nxt = d.get(p)
                if not isinstance(nxt, dict):
                    nxt = d[p] = {}
                d = nxt
            d.setdefault(leaf, v)
        elif isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = {**dict(v), **out[k]}
        else:
            out[k] = dict(v) if isinstance(v, Mapping) else v
    prob = out.get("problem")
    if isinstance(prob, str):
        out["problem"] = {"kind": prob}
    prob = out.get("problem")
    if isinstance(prob, dict):
        opt = out.setdefault("optim", {}) if isinstance(out.get("optim", {}), dict) else None
        if opt is not None:
            for k in OPTIM_KEYS:
                if k not in opt and isinstance(prob.get(k), (int, float)):
                    opt[k] = prob[k]
    return out


def append_event(run_dir: str | Path, type: str, /, **fields: Any) -> None:
    """Append one event line to RUN/events.jsonl, fsynced at once. The RunWriter's events
    and those of a process that stops before its writer is open (a signal during a
    resume's checkpoint load) go through here; after a torn last line (a writer killed
    mid-line, not yet repaired by a reopening writer) the new event starts on a line of
    its own, so it is never swallowed."""
    rec = {"time": time.time(), "type": type, **fields}
    line = json.dumps(json_clean(rec), default=_json_default, allow_nan=False)
    with open(Path(run_dir) / "events.jsonl", "a+b") as fh:
        torn = False
        if fh.seek(0, os.SEEK_END) > 0:
            fh.seek(-1, os.SEEK_END)
            torn = fh.read(1) != b"\n"
        fh.write((b"\n" if torn else b"") + line.encode() + b"\n")
        fh.flush()
        os.fsync(fh.fileno())


def read_meta(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise RunFormatError(f"{path}: run directory does not exist")
    if not path.is_dir():
        raise RunFormatError(f"{path}: not a directory")
    meta_path = path / "run.json"
    meta = read_json(meta_path, RunFormatError, f"{path}: not a run directory (no run.json)")
    if not isinstance(meta, dict) or "schema_version" not in meta:
        raise RunFormatError(f"{meta_path}: missing schema_version")
    if meta["schema_version"] != SCHEMA_VERSION:
        raise RunFormatError(f"{meta_path}: schema_version {meta['schema_version']!r} is not "
                             f"supported (this adamspike reads version {SCHEMA_VERSION})")
    if meta.get("backend") not in BACKENDS:
        raise RunFormatError(f"{meta_path}: unknown backend {meta.get('backend')!r}")
    return meta


def _flushed_record(path: str | Path) -> dict | None:
    try:
        rec = json.loads((Path(path) / FLUSHED_FILE).read_text())
        int(rec["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return rec if isinstance(rec, dict) else None


def _live(rec: dict | None) -> bool:
    """The record's writer is open and alive (not closed, not a killed process here)."""
    if rec is None or rec.get("closed"):
        return False
    try:
        return not (rec.get("host") == socket.gethostname()
                    and not _pid_alive(int(rec.get("pid", -1))))
    except (TypeError, ValueError):
        return False


def flushed_step(path: str | Path) -> int | None:
    """The last step whose rows are all on disk (RUN/flushed.json) while its writer is
    open and alive; None otherwise (closed, killed, an older writer, plain parts)."""
    rec = _flushed_record(path)
    return int(rec["step"]) if _live(rec) else None


def _snapshot(path: str | Path) -> tuple[Any, int | None, dict[str, int] | None]:
    """What one consistent read of the run is bounded by: (the writer session it belongs
    to, the last step to read, per table the part files to read; None: unbounded)."""
    rec = _flushed_record(path)
    if rec is None:
        return None, None, None
    # a writer of an older format records no session: its record itself stands for it
    session = rec.get("writer") or json.dumps(rec, sort_keys=True)
    if not _live(rec):
        return session, None, None
    parts = rec.get("parts")
    ok = isinstance(parts, dict) and all(isinstance(v, int) for v in parts.values())
    return session, int(rec["step"]), parts if ok else None


def _part_index(p: Path) -> int:
    try:
        return int(p.name.split(".")[0].split("-")[1])
    except (IndexError, ValueError):
        return -1


def _read_table(path: Path, table: str, columns: list[str] | None = None,
                upto: int | None = None, num_parts: int | None = None) -> pd.DataFrame:
    """One table's rows (step <= upto; only parts with an index below num_parts: those a
    live writer's flushed.json names, never one written after it)."""
    schema = TABLES[table]
    d = path / table
    parts = sorted(d.glob("part-*.parquet")) if d.is_dir() else []
    plain = sorted(d.glob("part-*.jsonl")) if d.is_dir() else []   # read_plain_part
    if num_parts is not None:
        parts = [p for p in parts if _part_index(p) < num_parts]
        plain = [p for p in plain if _part_index(p) < num_parts]
    if not parts and not plain:
        return pd.DataFrame({c: pd.Series(dtype=schema[c].to_pandas_dtype()) for c in schema
                             if columns is None or c in columns})
    # name / kind are read dictionary-encoded: they become categoricals without one Python
    # string per row (a 70B trace has ~15M layer rows)
    dict_cols = [c for c in ("name", "kind", "group") if c in schema and (columns is None or c in columns)]
    try:
        tbls = []
        for i, p in enumerate(parts):
            try:
                t = pq.read_table(p, columns=columns, read_dictionary=dict_cols)
            except FileNotFoundError:   # deleted by a resume's truncation meanwhile
                continue
            if upto is not None and "step" in t.column_names:
                t = t.filter(pc.less_equal(t.column("step"), upto))
            tbls.append(t)
            if i % 32 == 31:
                _release_arrow_memory()  # decode buffers
        tbls += [read_plain_part(p, table, columns, dict_cols) for p in plain]
        tbl = pa.concat_tables(tbls, promote_options="permissive")
    except Exception as e:  # noqa: BLE001
        raise RunFormatError(f"{d}: unreadable parquet parts ({e})") from None
    for c in OPTIONAL_COLUMNS.get(table, ()):
        if c not in tbl.column_names and (columns is None or c in columns):
            tbl = tbl.append_column(c, pa.nulls(tbl.num_rows, type=schema[c]))
    missing = [c for c in schema if c not in tbl.column_names and (columns is None or c in columns)]
    if missing:
        raise RunFormatError(f"{d}: missing column(s) {', '.join(missing)}")
    del tbls
    df = tbl.to_pandas(self_destruct=True, split_blocks=True)  # frees arrow memory as it goes
    del tbl
    _release_arrow_memory()
    for c in ("name", "kind", "group"):
        if c in df.columns:
            cat = df[c].astype("category")
            # lexical category order, so sorting by the categorical sorts by the string
            df[c] = cat.cat.reorder_categories(sorted(cat.cat.categories))
    keys = [k for k in TABLE_KEYS[table] if k in df.columns]
    if len(keys) == len(TABLE_KEYS[table]):
        df = _sorted_unique(df, keys)
    return df


def read_plain_part(path: Path, table: str, columns: list[str] | None = None,
                    dict_cols: Iterable[str] = ()) -> pa.Table:
    """One plain part (`TABLE/part-NNNNNN.jsonl`, one JSON object per row, null for a
    non-finite float) as an arrow table of the table's schema: the format of
    fullscale.megatron_probe's writer where pandas / pyarrow are missing on the cluster.
    Parts are written atomically (temp + fsync + rename), so every line is whole; a line
    that does not parse is a format error naming the part."""
    schema = TABLES[table]
    rows = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise RunFormatError(f"{path}:{lineno}: invalid JSON ({e})") from None
    names = [c for c in schema if columns is None or c in columns]
    extras = [] if columns is not None else sorted({k for r in rows for k in r} - set(schema))
    arrays = []
    for c in names:
        vals = [r.get(c) for r in rows]
        tp = schema[c]
        if tp in (pa.float32(), pa.float64()):
            arr = pa.array(np.array([np.nan if v is None else v for v in vals], dtype=np.float64)).cast(tp)
        else:
            arr = pa.array(vals, type=tp)
        arrays.append(arr.dictionary_encode() if c in dict_cols else arr)
    arrays += [pa.array([r.get(c) for r in rows]) for c in extras]
    return pa.Table.from_arrays(arrays, names=names + extras)


def _sorted_unique(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Rows in key order, keeping the last-written row of a duplicated key (numpy on an
    int64 key: step, then the lexically ordered name code)."""
    step = df["step"].to_numpy().astype(np.int64)
    key = step - (step.min() if len(step) else 0)
    if len(keys) == 2:
        codes = df[keys[1]].cat.codes.to_numpy().astype(np.int64)
        key = key * (int(codes.max()) + 2 if len(codes) else 1) + codes + 1
    if len(key) < 2 or bool(np.all(np.diff(key) > 0)):
        return df.reset_index(drop=True)
    order = np.argsort(key, kind="stable")
    skey = key[order]
    last = np.append(skey[1:] != skey[:-1], True)  # stable sort: the last of equal keys
    sel = order[last]
    # one column at a time, so a 70B-sized table is never held twice
    cols = {}
    for c in list(df.columns):
        cols[c] = df[c].to_numpy()[sel] if not isinstance(df[c].dtype, pd.CategoricalDtype) \
            else df[c].take(sel).reset_index(drop=True)
        del df[c]
        _release_arrow_memory()  # the freed column may sit in arrow's allocator cache
    return pd.DataFrame(cols, copy=False)


def _release_arrow_memory() -> None:
    """Hand arrow's cached free memory back to the OS (large reads otherwise keep it)."""
    try:
        pa.default_memory_pool().release_unused()
    except Exception:  # noqa: BLE001 - an allocator without this knob
        pass


def read_events(path: str | Path) -> tuple[pd.DataFrame, int]:
    """events.jsonl as a DataFrame (columns: time, type, step, ...) and the torn-line count."""
    p = Path(path) / "events.jsonl"
    recs, torn = [], 0
    if p.is_file():
        for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                torn += 1
                continue
            if isinstance(rec, dict) and "type" in rec:
                recs.append(rec)
            else:
                torn += 1
    df = pd.DataFrame.from_records(recs) if recs else pd.DataFrame(columns=["time", "type", "step"])
    return df, torn


def load_run(path: str | Path, *, tables: Iterable[str] = ("steps", "layers", "hists"),
             layer_columns: list[str] | None = None) -> Run:
    """Read a run directory into DataFrames (steps, layers, hists, events).

    `tables` limits what is read (unread tables come back empty); `layer_columns` reads
    a subset of the layers columns (the key columns are always included). A live or
    resuming run is read as of its flushed.json step (`Run.snapshot_step`; see the
    module doc), read again when a new writer session (a resume) began meanwhile.
    """
    for _ in range(20):
        session, upto, parts = _snapshot(path)
        run = _load_run(path, tables=tables, layer_columns=layer_columns, upto=upto,
                        parts=parts)
        if _snapshot(path)[0] == session:
            return run
    raise RunFormatError(f"{path}: its writer restarted during each of 20 reads; read it "
                         "again once it runs")


def _load_run(path: str | Path, *, tables: Iterable[str], layer_columns: list[str] | None,
              upto: int | None, parts: Mapping[str, int] | None = None) -> Run:
    path = Path(path)
    meta = read_meta(path)
    tables = set(tables)
    unknown = tables - set(TABLES)
    if unknown:
        raise ValueError(f"unknown table(s): {sorted(unknown)}")
    cols = None
    if layer_columns is not None:
        cols = list(dict.fromkeys(["step", "name", "depth", "kind", "numel", *layer_columns]))
        bad = [c for c in cols if c not in LAYER_COLUMNS]
        if bad:
            raise ValueError(f"unknown layer column(s): {bad}")
    frames = {}
    for t in TABLES:
        if t in tables:
            frames[t] = _read_table(path, t, cols if t == "layers" else None, upto,
                                    None if parts is None else parts.get(t, 0))
        else:
            frames[t] = pd.DataFrame({c: pd.Series(dtype=TABLES[t][c].to_pandas_dtype())
                                      for c in TABLES[t]})
    events, torn = read_events(path)
    if upto is not None and len(events) and "step" in events.columns:
        # per-step events as of the same moment (a resume moves those beyond its checkpoint
        # aside only after flushed.json says it; a live writer logs a step's events before
        # its rows are flushed); lifecycle events are read whole
        late = (~events["type"].isin(LIFECYCLE_EVENTS)
                & (pd.to_numeric(events["step"], errors="coerce") > upto))
        events = events[~late.to_numpy()].reset_index(drop=True)
    return Run(path=path, meta=meta, events=events, torn_event_lines=torn,
               snapshot_step=upto, **frames)


# ----------------------------------------------------------------------------- finding runs

def find_runs(root: str | Path) -> list[Path]:
    """Run directories (with a run.json) under root, not descending into a run; each
    directory once, however many symlinks lead to it (a symlink cycle ends there)."""
    found: list[Path] = []
    seen: set[tuple[int, int]] = set()

    def walk(d: Path) -> None:
        try:
            st = d.stat()
        except OSError:          # a dangling link, a loop the kernel refuses (ELOOP)
            return
        if (st.st_dev, st.st_ino) in seen:
            return
        seen.add((st.st_dev, st.st_ino))
        if (d / "run.json").is_file():
            found.append(d)
            return
        try:
            children = sorted(p for p in d.iterdir() if p.is_dir())
        except OSError:
            return
        for child in children:
            walk(child)

    walk(Path(root))
    return found


def run_names(runs: Iterable[Path]) -> list[str]:
    """Distinct output names for run directories (parent prefixes where names clash)."""
    runs = [Path(r) for r in runs]
    base = [r.name for r in runs]
    names = [f"{r.parent.name}_{r.name}" if base.count(r.name) > 1 else r.name for r in runs]
    seen: dict[str, int] = {}
    for i, n in enumerate(names):
        if n in seen:
            seen[n] += 1
            names[i] = f"{n}_{seen[n]}"
        else:
            seen[n] = 0
    return names
