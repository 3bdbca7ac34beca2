"""The one cell store and its executor: every experiment's unit of work, cached by what
determines it, computed by local worker processes or Ray tasks.

A cell is `Cell(kind, code, config, fn)`:
- `kind` names the experiment ("sharpness_rung", ...); `code` is the version of the code
  that matters for its result (bumped by hand when the computation changes meaning);
  `config` is the cell's fully resolved input, JSON-able (no defaults left to the code);
- `fn` is "module:function", called as fn(config) in whatever process runs the cell; it
  returns the payload: a JSON-able dict whose values may also be pandas DataFrames or
  numpy arrays (stored bit for bit). A driver whose cells need what only it holds (a
  snapshot of another cell, cells computed together in one vmapped call) computes them
  itself through `CellStore.compute(cell, compute=...)`: the same keys, files and checks.

Key = sha256 of the canonical JSON of {kind, code, config}, first 20 hex digits. On disk:

    ROOT/<kind>/<key>.json                 {key, kind, code, config, payload, tables}
    ROOT/<kind>/<key>.<table>.parquet      one file per DataFrame of the payload
    ROOT/<kind>/<key>.<array>.npy          one file per numpy array of the payload
    ROOT/<kind>/<key>.prov.json            where and when it ran, how long (not hashed)

`tables` (`arrays`) maps each DataFrame's (array's) name to the sha256 of its file, and the JSON file
itself carries `sha256` of its own canonical body, so a torn, truncated or bit-flipped cell
is detected on read: it is moved aside (`*.corrupt`, nothing is deleted), one line says so
on stderr, and the cell is computed again. Writes are atomic (temp file, fsync, rename),
table files before the JSON that names them, so a cell either exists whole or not at all;
the same computation writes the same bytes, whichever executor ran it.

Executors (`run_cells`): "local" runs missing cells in `jobs` spawned worker processes (or
inline with jobs=1); "ray" submits them as Ray tasks (`ray.init(address=...)`; Ray is an
optional dependency, imported only here and only when asked) that retry when their worker
dies. Workers write into the store themselves, so the store must be visible to every
worker (a shared file system on a cluster); a driver killed and restarted resumes from the
store, recomputing only the cells that are missing.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import importlib
import importlib.metadata
import io
import json
import math
import multiprocessing as mp
import os
import platform
import socket
import sys
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from adamspike.config import ConfigError
from adamspike.rundir import atomic_write_bytes

__all__ = ["Cell", "CellStore", "CorruptCell", "cache_home", "canonical", "jax_cache_dir",
           "run_cells", "EXECUTORS"]

EXECUTORS = ("local", "ray")


def cache_home() -> Path:
    """The user's adamspike cache ($ADAMSPIKE_CACHE_HOME, else $XDG_CACHE_HOME/adamspike,
    else ~/.cache/adamspike): compiled programs that outlive one study folder."""
    env = os.environ.get("ADAMSPIKE_CACHE_HOME")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "adamspike"


def jax_cache_dir() -> Path:
    """JAX's persistent compilation cache: cache_home()/jax/<jaxlib version>-<CPU kind>.

    Per user, not per study folder, so a second study, the test suite and a later command
    load the programs an earlier one compiled. The CPU kind is in the path because JAX keys
    a CPU program by the device kind "cpu" alone (jax/_src/cache_key.py, jax 0.10.2), not
    by the instruction set XLA compiled it for: a home folder shared by an AVX-512 machine
    and an AVX2 one would otherwise load code built for the other."""
    try:
        version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        version = "nojaxlib"
    kind = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        kind = "\n".join(sorted(set(lines)))
    except OSError:                  # not Linux
        kind = f"{platform.machine()} {platform.processor()}"
    return cache_home() / "jax" / f"{version}-{hashlib.sha256(kind.encode()).hexdigest()[:12]}"


def _plain(x: Any) -> Any:
    """numpy scalars and tuples as the JSON types they stand for."""
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "item") and callable(x.item) and getattr(x, "shape", None) == ():
        return x.item()
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):
        return x.tolist()
    return x


def canonical(obj: Any) -> bytes:
    """The one byte form of a JSON-able object: sorted keys, no spaces, floats by repr
    (NaN and inf allowed, as Python's json writes them)."""
    return json.dumps(_plain(obj), sort_keys=True, separators=(",", ":"),
                      allow_nan=True, ensure_ascii=True).encode()


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@dataclass(frozen=True)
class Cell:
    kind: str
    code: str
    config: Mapping[str, Any] = field(hash=False)
    fn: str = ""

    @property
    def key(self) -> str:
        return _sha(canonical({"kind": self.kind, "code": self.code,
                               "config": self.config}))[:20]

    def compute(self) -> dict:
        mod, _, name = self.fn.partition(":")
        if not mod or not name:
            raise ValueError(f"cell {self.kind}: fn must be 'module:function', got {self.fn!r}")
        return getattr(importlib.import_module(mod), name)(dict(self.config))


class CorruptCell(ValueError):
    """A stored cell failed verification, or is missing where a reader needs it (the
    message says why)."""


class CellStore:
    """Cells under one root directory (module doc)."""

    def __init__(self, root: str | Path, log: Callable[[str], None] | None = None,
                 sources: Sequence[str | Path] = ()):
        """`sources`: read-only stores (the cells shipped with the package, another study's
        store) from which a cell missing here is copied, verified, before anything would
        compute it; a source is never written, and a cell that fails verification there
        is passed over (computed here). `copied` counts the cells taken from them."""
        self.root = Path(root)
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.sources = [Path(s) for s in sources]
        for s in self.sources:     # a mistyped source would silently compute everything
            if not s.is_dir():
                raise ConfigError(f"--cells-from {s}: no such cell store (a folder)")
        self.copied = 0

    def path(self, cell: Cell) -> Path:
        return self.root / cell.kind / f"{cell.key}.json"

    def __contains__(self, cell: Cell) -> bool:
        return self.get(cell) is not None

    # -------------------------------------------------------------------- read
    def _read(self, cell: Cell) -> dict:
        return self._read_key(cell.kind, cell.key)

    def _read_key(self, kind: str, key: str) -> dict:
        p = self.root / kind / f"{key}.json"
        raw = p.read_bytes()
        try:
            doc = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CorruptCell(f"not JSON ({e.__class__.__name__})") from None
        if not isinstance(doc, dict) or "sha256" not in doc:
            raise CorruptCell("no content hash")
        body = {k: v for k, v in doc.items() if k != "sha256"}
        if _sha(canonical(body)) != doc["sha256"]:
            raise CorruptCell("content hash mismatch")
        if body.get("key") != key or body.get("kind") != kind:
            raise CorruptCell("key or kind differs from its file name")
        payload = dict(body["payload"])
        for what, ext, load in (("tables", "parquet", pd.read_parquet),
                                ("arrays", "npy", lambda b: np.load(b, allow_pickle=False))):
            for name, digest in body.get(what, {}).items():
                tp = p.with_name(f"{key}.{name}.{ext}")
                if not tp.is_file():
                    raise CorruptCell(f"{what[:-1]} {name!r} missing")
                data = tp.read_bytes()
                if _sha(data) != digest:
                    raise CorruptCell(f"{what[:-1]} {name!r}: content hash mismatch")
                payload[name] = load(io.BytesIO(data))
        return payload

    def read(self, kind: str, key: str) -> dict:
        """A stored cell's payload by kind and key, verified, for readers that must not
        compute (analysis/): CorruptCell naming the file when it is missing or fails."""
        p = self.root / kind / f"{key}.json"
        if not p.is_file():
            raise CorruptCell(f"{p}: missing cell ({kind})")
        try:
            return self._read_key(kind, key)
        except (CorruptCell, OSError, ValueError, KeyError, TypeError) as e:
            raise CorruptCell(f"{p}: corrupt cell ({e}); rerun the stage that writes it") from None

    def has(self, kind: str, key: str) -> bool:
        """Whether a cell of `kind` and `key` is stored (not verified: `read` does that)."""
        return (self.root / kind / f"{key}.json").is_file()

    def keys(self, kind: str) -> list[str]:
        """The keys of the cells of `kind` stored under this root (sorted; not verified)."""
        d = self.root / kind
        return sorted(p.name[:-5] for p in d.glob("*.json")
                      if not p.name.endswith(".prov.json")) if d.is_dir() else []

    def verified(self, kind: str) -> list[tuple[dict, dict]]:
        """(config, payload) of every stored cell of `kind` that verifies; a corrupt one is
        set aside with one line (as `get`) and left out; an unreadable JSON is skipped."""
        out = []
        for key in self.keys(kind):
            try:
                doc = json.loads((self.root / kind / f"{key}.json").read_bytes())
            except (OSError, json.JSONDecodeError):
                continue
            got = self.get(Cell(doc.get("kind", ""), doc.get("code", ""), doc.get("config", {})))
            if got is not None:
                out.append((doc["config"], got))
        return out

    def config(self, kind: str, key: str) -> dict:
        """The resolved config a stored cell was computed from (verified)."""
        self.read(kind, key)
        return json.loads((self.root / kind / f"{key}.json").read_bytes())["config"]

    def get(self, cell: Cell) -> dict | None:
        """The stored payload, or None when the cell is missing (here and in every
        source). A cell that fails verification is moved aside (one line on stderr) and
        reads as missing."""
        if not self.path(cell).is_file():
            return self._from_sources(cell)
        try:
            return self._read(cell)
        except (CorruptCell, OSError, ValueError, KeyError, TypeError) as e:
            self._set_aside(cell, str(e))
            return None

    def _from_sources(self, cell: Cell) -> dict | None:
        """Copy `cell` from the first source holding a verified copy (every file but the
        provenance, byte for byte, tables before the JSON that names them); its payload,
        or None. Sources are only read: a damaged cell there is skipped, not set aside."""
        for root in self.sources:
            src = CellStore(root)
            if not src.path(cell).is_file():
                continue
            try:
                src._read(cell)
            except (CorruptCell, OSError, ValueError, KeyError, TypeError):
                continue
            dest = self.path(cell)
            dest.parent.mkdir(parents=True, exist_ok=True)
            for f in sorted(src.path(cell).parent.glob(f"{cell.key}.*")):
                if not f.name.endswith(".json") and ".corrupt" not in f.name:
                    atomic_write_bytes(dest.parent / f.name, f.read_bytes())
            atomic_write_bytes(dest, src.path(cell).read_bytes())
            self.copied += 1
            return self._read(cell)
        return None

    def _set_aside(self, cell: Cell, why: str) -> None:
        """Move the cell's JSON and its table / array files aside (`*.corrupt[-n]`, the
        same n for all), nothing deleted; one line says so."""
        p = self.path(cell)
        n = 0
        while True:
            suffix = ".corrupt" + (f"-{n}" if n else "")
            dest = p.with_name(p.name + suffix)
            if not dest.exists():
                break
            n += 1
        for f in sorted(p.parent.glob(f"{cell.key}.*")):
            if f.name.endswith(".prov.json") or ".corrupt" in f.name:
                continue
            try:
                os.replace(f, f.with_name(f.name + suffix))
            except OSError:
                pass
        self._log(f"adamspike cells: {p}: {why}; set aside as {dest.name}, computing it again")

    # -------------------------------------------------------------------- write
    def put(self, cell: Cell, payload: Mapping[str, Any], seconds: float = math.nan) -> dict:
        """Store a payload (atomic; tables and arrays first); returns it as `get` would."""
        d = self.root / cell.kind
        d.mkdir(parents=True, exist_ok=True)
        plain, tables, arrays = {}, {}, {}
        for name, v in payload.items():
            buf = io.BytesIO()
            if isinstance(v, pd.DataFrame):
                v.to_parquet(buf, index=False)
                path, into = d / f"{cell.key}.{name}.parquet", tables
            elif isinstance(v, np.ndarray):
                np.save(buf, v, allow_pickle=False)
                path, into = d / f"{cell.key}.{name}.npy", arrays
            else:
                plain[name] = v
                continue
            data = buf.getvalue()
            atomic_write_bytes(path, data)
            into[name] = _sha(data)
        body = {"key": cell.key, "kind": cell.kind, "code": cell.code,
                "config": _plain(cell.config), "payload": _plain(plain), "tables": tables}
        if arrays:         # absent otherwise: the bytes of cells without arrays as before
            body["arrays"] = arrays
        body = json.loads(canonical(body))     # what will be read back
        doc = dict(body, sha256=_sha(canonical(body)))
        atomic_write_bytes(d / f"{cell.key}.prov.json", json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "seconds": seconds,
             "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode())
        atomic_write_bytes(self.path(cell), canonical(doc))
        return self._read(cell)

    def compute(self, cell: Cell, compute: Callable[[], Mapping[str, Any]] | None = None) -> dict:
        """The stored payload, computing and storing it first when missing: by the cell's
        `fn`, or by `compute()` when the driver holds what the cell needs (module doc)."""
        got = self.get(cell)
        if got is not None:
            return got
        t0 = time.perf_counter()
        payload = cell.compute() if compute is None else compute()
        return self.put(cell, payload, seconds=time.perf_counter() - t0)


def _work(root: str, cell: Cell) -> str:
    """One cell in a worker (a process of the pool, or a Ray task): compute when missing."""
    CellStore(root).compute(cell)
    return cell.key


def _unique(cells: Iterable[Cell]) -> list[Cell]:
    seen, out = set(), []
    for c in cells:
        if c.key not in seen:
            seen.add(c.key)
            out.append(c)
    return out


def run_cells(store: CellStore, cells: Sequence[Cell], *, executor: str | None = None,
              jobs: int = 1, address: str | None = None, progress: bool = True,
              desc: str = "cells") -> list[dict]:
    """Every cell's payload, in the order given, computing the missing ones with the
    executor ("local": `jobs` spawned processes, inline when 1; "ray": Ray tasks on the
    cluster at `address`, or a local Ray instance of `jobs` CPUs when None). Left None,
    executor and address come from ADAMSPIKE_EXECUTOR / ADAMSPIKE_RAY_ADDRESS (`adamspike
    reproduce --executor ray --address ...` sets them for its stages), else "local"."""
    executor = executor or os.environ.get("ADAMSPIKE_EXECUTOR") or "local"
    address = address or os.environ.get("ADAMSPIKE_RAY_ADDRESS") or None
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    have = {c.key: store.get(c) for c in _unique(cells)}      # each stored cell read once
    todo = [c for c in _unique(cells) if have[c.key] is None]
    if todo:
        bar = tqdm(total=len(todo), desc=desc, unit="cell", file=sys.stderr,
                   disable=not progress or not sys.stderr.isatty())
        root = str(store.root.resolve())
        if executor == "ray":
            _run_ray(root, todo, jobs, address, bar)
        elif jobs <= 1:
            for c in todo:
                _work(root, c)
                bar.update()
        else:
            _run_local(root, todo, jobs, bar)
        bar.close()
        have.update({c.key: store.get(c) for c in todo})     # what the workers stored
    out = []
    for c in cells:
        got = have[c.key]
        if got is None:
            raise RuntimeError(f"cell {c.kind}/{c.key} was not stored by its worker")
        out.append(got)
    return out


def _run_local(root: str, todo: list[Cell], jobs: int, bar, attempts: int = 3) -> None:
    """Missing cells in a pool of `jobs` spawned processes; a worker that dies (killed, out
    of memory) breaks the pool: a new pool takes the cells still missing, up to `attempts`
    times. An exception raised by a cell's own code is not retried."""
    store = CellStore(root)
    for attempt in range(attempts):
        left = [c for c in todo if not store.path(c).is_file()]
        if not left:
            return
        try:
            with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
                for f in cf.as_completed([pool.submit(_work, root, c) for c in left]):
                    f.result()
                    bar.update()
            return
        except BrokenProcessPool:
            print(f"adamspike cells: a worker died; {attempts - attempt - 1} more attempt(s) "
                  "for the cells still missing", file=sys.stderr, flush=True)
    raise RuntimeError(f"cells: workers kept dying after {attempts} attempts")


def _run_ray(root: str, todo: list[Cell], jobs: int, address: str | None, bar) -> None:
    try:
        import ray
    except Exception as e:     # an optional extra: one line, not a traceback
        raise RuntimeError(f"--executor ray needs Ray (pip install 'adamspike[ray]'): {e}") from None
    started = not ray.is_initialized()
    if started:
        kw = {"address": address} if address else {"num_cpus": max(1, int(jobs))}
        ray.init(include_dashboard=False, log_to_driver=False, **kw)
    try:
        # a task whose worker process dies is retried (Ray's max_retries counts system
        # failures); an exception raised by the cell's own code is not retried
        task = ray.remote(max_retries=3, num_cpus=1)(_work)
        pending = [task.remote(root, c) for c in todo]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)
            bar.update(len(done))
    finally:
        if started:
            ray.shutdown()


def selfcheck(config: Mapping[str, Any]) -> dict:
    """The executors' self-check cell (kind "selfcheck"; tests and `--executor` checks):
    a seeded numpy computation whose bytes do not depend on where it runs. Config: seed,
    n; optional `log` (a file that gets one line per computation), `sleep` (seconds, so
    a test can kill it mid-cell) and `die_once` (a marker path: the first attempt creates
    it and kills its own process, as a node failure would)."""
    if config.get("log"):
        with open(config["log"], "a") as fh:
            fh.write(f"{config['seed']}\n")
    if config.get("die_once") and not os.path.exists(config["die_once"]):
        Path(config["die_once"]).write_text(str(os.getpid()))
        os.kill(os.getpid(), 9)
    if config.get("sleep"):
        time.sleep(float(config["sleep"]))
    rng = np.random.default_rng(int(config["seed"]))
    a = rng.standard_normal((int(config.get("n", 32)),) * 2)
    w = np.linalg.eigvalsh(a + a.T)
    return {"top": float(w[-1]), "trace": float(np.trace(a)),
            "table": pd.DataFrame({"i": np.arange(len(w)), "eig": w})}
