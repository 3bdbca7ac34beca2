"""The run-directory writers the probe uses: adamspike.rundir.RunWriter (parquet) where pandas +
pyarrow import, else PlainRunWriter (JSON lines, torch + numpy only); and where the run
directory lives (storage_info).

Storage. One rank writes the whole run directory (the writer rank, the last: every row it
writes is all-reduced to it, so it holds everything; nothing is written by other ranks).
With shared storage every node sees it. With MindSpeed-LLM's --no-shared-storage ("if no
shared storage, set it": mindspeed_llm/features_manager/megatron_basic/megatron_basic.py at
c77308a1; upstream then builds the dataset cache on TP rank 0 of every node instead of
global rank 0 only, mindspeed_llm/core/datasets/blended_megatron_dataset_builder.py;
Megatron-LM has no such flag) or ADAMSPIKE_PROBE_NO_SHARED_STORAGE=1 (the stacks without
the flag), the writer still writes the run directory, on its own node's disk, and says
where: run.json "storage" (shared, host, rank), the start event, and one printed line. The
one thing the probe reads that other ranks write is the checkpoint list of the restart
recipe: without shared storage the writer's --save holds only the shards written on its
node (and Megatron's tracker file is on rank 0's node), so the recipe takes the checkpoint
iterations from Megatron's save schedule instead (fullscale.probe.recipe)."""

from __future__ import annotations

import json
import math
import os
import socket
import time
from typing import Dict, List, Optional

import numpy as np

from adamspike.metrics import HIST_EDGES
from fullscale.probe.settings import ENV_PREFIX, ProbeError


def storage_info(margs, rank: int, environ=os.environ) -> dict:
    """Where the writer's run directory lives (module docstring): {"shared": bool, "host":
    this node's name, "rank": the writer's rank}."""
    no_shared = bool(getattr(margs, "no_shared_storage", False)) or \
        environ.get(f"{ENV_PREFIX}NO_SHARED_STORAGE", "0") == "1"
    return {"shared": not no_shared, "host": socket.gethostname(), "rank": int(rank)}


def _atomic_write(path: str, data: bytes) -> None:
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _clean(o):
    # A copy of adamspike.rundir.json_clean: this probe runs inside a Megatron job on
    # python 3.8 and must import with torch + numpy only (no adamspike, no pandas).
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, np.generic):
        return _clean(o.item())
    if isinstance(o, np.ndarray):
        return _clean(o.tolist())
    return o


class PlainRunWriter:
    """The run-directory writer without pandas / pyarrow: run.json, events.jsonl and
    TABLE/part-NNNNNN.jsonl parts (one JSON object per row; non-finite floats as null),
    each part written to a temporary name, fsynced and renamed (a crash loses at most the
    rows since the last flush). Read by adamspike.rundir.load_run. Same API subset as
    RunWriter: log_step, log_layers(columns=), log_hist, log_curvature, event, flush, close."""

    TABLES = ("steps", "layers", "hists", "curvature")

    def __init__(self, path: str, *, backend: str, config: dict, env: dict,
                 extra_meta: Optional[dict] = None, resume_from_step: Optional[int] = None,
                 flush_every_s: float = 60.0, hist_edges=HIST_EDGES):
        self.path = str(path)
        self.flush_every_s = float(flush_every_s)
        self._rows: Dict[str, List[dict]] = {t: [] for t in self.TABLES}
        self._last = time.monotonic()
        meta_path = os.path.join(self.path, "run.json")
        if resume_from_step is None:
            if os.path.exists(meta_path) or (os.path.isdir(self.path) and os.listdir(self.path)):
                raise ProbeError(f"{self.path}: run directory exists and is not empty")
            for t in self.TABLES:
                os.makedirs(os.path.join(self.path, t), exist_ok=True)
            meta = {"schema_version": 1, "backend": backend, "config": config, "environment": env,
                    "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "hist_edges": [float(x) for x in hist_edges], **(extra_meta or {})}
            _atomic_write(meta_path, json.dumps(_clean(meta), indent=2).encode())
            self._next = {t: 0 for t in self.TABLES}
        else:
            self._next = {t: self._truncate(t, int(resume_from_step)) for t in self.TABLES}
            self.event("resume", step=int(resume_from_step))

    def _parts(self, table: str) -> List[str]:
        d = os.path.join(self.path, table)
        return sorted(f for f in os.listdir(d) if f.startswith("part-") and f.endswith(".jsonl"))

    def _truncate(self, table: str, step: int) -> int:
        d = os.path.join(self.path, table)
        os.makedirs(d, exist_ok=True)
        for f in self._parts(table):
            full = os.path.join(d, f)
            with open(full, encoding="utf-8") as fh:
                rows = [json.loads(x) for x in fh if x.strip()]
            keep = [r for r in rows if r["step"] <= step]
            if not keep:
                os.unlink(full)
            elif len(keep) < len(rows):
                _atomic_write(full, "".join(json.dumps(r) + "\n" for r in keep).encode())
        parts = self._parts(table)
        return int(parts[-1][5:11]) + 1 if parts else 0

    def log_step(self, **row) -> None:
        self._rows["steps"].append(row)
        self._maybe_flush()

    def log_layers(self, step: int, columns: dict) -> None:
        n = len(columns["name"])
        cols = {k: (list(v) if not isinstance(v, np.ndarray) else v.tolist()) for k, v in columns.items()}
        self._rows["layers"].extend({"step": int(step), **{k: cols[k][i] for k in cols}}
                                    for i in range(n))
        self._maybe_flush()

    def log_hist(self, step: int, name: str, depth: int, kind: str, counts) -> None:
        self._rows["hists"].append({"step": int(step), "name": name, "depth": int(depth),
                                    "kind": kind, "counts": [int(c) for c in counts]})

    def log_curvature(self, step: int, group: str, precond_curvature: float,
                      raw_curvature: float, lr: float) -> None:
        self._rows["curvature"].append({"step": int(step), "group": str(group),
                                        "precond_curvature": float(precond_curvature),
                                        "raw_curvature": float(raw_curvature), "lr": float(lr)})
        self._maybe_flush()

    def event(self, type: str, **fields) -> None:
        line = json.dumps(_clean({"time": time.time(), "type": type, **fields}), allow_nan=False)
        with open(os.path.join(self.path, "events.jsonl"), "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def _maybe_flush(self) -> None:
        if time.monotonic() - self._last >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        for t, rows in self._rows.items():
            if rows:
                name = os.path.join(self.path, t, f"part-{self._next[t]:06d}.jsonl")
                _atomic_write(name, "".join(json.dumps(_clean(r), allow_nan=False) + "\n"
                                            for r in rows).encode())
                self._next[t] += 1
                self._rows[t] = []
        self._last = time.monotonic()

    def close(self) -> None:
        self.flush()


def open_writer(path: str, *, config: dict, env: dict, extra_meta: dict,
                resume_from_step: Optional[int], flush_every_s: float, plain: bool = False):
    """RunWriter (parquet) when adamspike.rundir imports (pandas + pyarrow), else the
    plain writer. A run directory keeps the format it was started with."""
    if resume_from_step is not None and os.path.isdir(os.path.join(path, "steps")):
        plain = plain or any(f.endswith(".jsonl") for f in os.listdir(os.path.join(path, "steps")))
    if not plain:
        try:
            # lazy: pandas + pyarrow, which a 910B node may lack (then the plain JSON-lines writer)
            from adamspike.rundir import RunWriter
        except ImportError:
            plain = True
    if plain:
        return PlainRunWriter(path, backend="megatron", config=config, env=env,
                              extra_meta=extra_meta, resume_from_step=resume_from_step,
                              flush_every_s=flush_every_s)
    return RunWriter(path, backend="megatron", config=config, env=env, extra_meta=extra_meta,
                     resume_from_step=resume_from_step, flush_every_s=flush_every_s)
