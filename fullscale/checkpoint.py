"""Resumable checkpoints: model + optimizer through torch.distributed.checkpoint (DCP), a
small trainer-state file, per-rank RNG states, and a manifest written last.

    ckpt_root/step-00000120/
        .metadata, __<rank>_<i>.distcp   model + optimizer (DCP; sharded FSDP2 DTensors or a
                                         plain module in one process)
        trainer.pt                       rank 0: step, scheduler, data position, guard, extra
        rng-00000.pt ... rng-<W-1>.pt    each rank's RNG states (torch CPU, device, numpy, random)
        COMPLETE                         manifest (JSON): format, step, world size, and every
                                         file above with its size and sha256

Write protocol (a checkpoint killed at any point is never picked up):
 1. all ranks check every parameter and optimizer-state tensor for non-finite values (local
    check + all_reduce); any -> `NonFiniteError`, nothing is written;
 2. everything is written into `step-XXXXXXXX.partial/`;
 3. each rank hashes a share of the files (file i by rank i mod W), rank 0 gathers the hashes,
    writes COMPLETE atomically and renames the directory to `step-XXXXXXXX`;
 4. rank 0 then deletes the oldest complete checkpoints beyond `keep`.
With async_save, step 2 runs in DCP's background thread and steps 3-4 in
`CheckpointManager.finalize_pending()` (or, on the way out, `close()`: rank 0 hashes every
file). Every manifest holds every file's sha256: a file listed without one is rejected, so a
checkpoint is never complete without being verifiable. `complete()` only lists renamed
directories holding COMPLETE. `load()` first verifies the manifest (files present and
readable, sizes, hashes: each rank hashes its share, results are gathered so every rank
raises the same `CheckpointError`; an I/O error reading a file rejects the checkpoint) and
reads trainer.pt and this rank's RNG file, so a corrupt checkpoint is rejected before any
state is touched; `CheckpointManager.load_latest_valid()` falls back to older ones.

`CheckpointManager` owns a run's checkpoint state (root, keep, the async save in flight);
the module holds no state. Every function and method is collective when torch.distributed
is initialised (call it on all ranks).
ckpt_root must be one shared filesystem for all ranks (as DCP's FileSystemWriter assumes).
Re-saving an existing step (after a rollback) moves the old directory aside before the
rename; a crash in that instant loses that one step's checkpoint, never an older one.
Pruning renames a directory to `.deleting-*` before removing it; the next prune removes any
`.deleting-*` a killed prune left.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import default_planner as _dcp_planner
from torch.distributed.checkpoint import metadata as _dcp_metadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from adamspike.faults import kill_point
from fullscale.dcp_metadata import MetadataUnpickler
from fullscale.device import local_shard as _local

FORMAT = "adamspike-torch-ckpt/1"
MARKER = "COMPLETE"
TRAINER_FILE = "trainer.pt"
RESERVED_EXTRA = frozenset({"step", "rng_restored", "position", "guard"})
# DCP warns on every single-process save/load (also from its async thread); that is intended.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_PARTIAL_DIR = re.compile(r"^step-(\d{8})\.partial$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the path and problem."""

    def __init__(self, path: str | Path, problem: str, detail: str = ""):
        self.path, self.problem = str(path), problem
        self.detail = detail        # e.g. DCP's full error text, for the run's log
        super().__init__(f"checkpoint {path}: {problem}")


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint file asks to run code or build objects a checkpoint never holds (a
    crafted `.metadata`): refused, and never skipped over for an older checkpoint."""


class NonFiniteError(CheckpointError):
    """Refused to save: some parameter / optimizer state holds nan or inf.

    `payload` is the event the trainer logs (type "checkpoint_refused")."""

    def __init__(self, path: str | Path, step: int, num_nonfinite: int, names: list[str]):
        self.step, self.num_nonfinite, self.names = step, num_nonfinite, names
        self.payload = {"step": step, "reason": "non-finite state", "path": str(path),
                        "num_nonfinite": num_nonfinite, "tensors": names[:20]}
        shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
        super().__init__(path, f"refused to save step {step}: {num_nonfinite} non-finite "
                               f"values in {len(names)} tensor(s) ({shown})")


# ----------------------------------------------------------------------------- storage

# A checkpoint's bytes per parameter: fp32 weights + AdamW's two fp32 moments (measured:
# 13.4 B/param for the tiny model, .metadata and the RNG files included).
BYTES_PER_PARAM = 12
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EACCES})
_ERRNO_TEXT = re.compile(r"\[errno (\d+)\]", re.IGNORECASE)


def estimated_size(num_params: int) -> int:
    """Bytes of one checkpoint of a model (10 % + 1 MiB margin for metadata and RNG files)."""
    return int(num_params * BYTES_PER_PARAM * 1.1) + (1 << 20)


def check_storage(ckpt_root: str | Path, need_bytes: int) -> None:
    """Before a run builds anything (rank 0): the checkpoint directory (or, not there yet,
    its nearest existing parent) takes a write and has room for one checkpoint of
    `need_bytes`. CheckpointError naming ENOSPC / EROFS / EIO otherwise, so a read-only or
    full file system is refused at the start, not one checkpoint interval later."""
    d = Path(ckpt_root)
    while not d.is_dir() and d != d.parent:
        d = d.parent
    probe = d / ".adamspike-write-probe"
    try:
        with open(probe, "wb") as fh:
            fh.write(b"\0")
            fh.flush()
            os.fsync(fh.fileno())
        probe.unlink()
    except OSError as e:
        raise CheckpointError(ckpt_root, f"{d} is not writable ({_errno_text(e)}); nothing "
                                         "was written") from None
    free = shutil.disk_usage(d).free
    if free < need_bytes:
        raise CheckpointError(ckpt_root, f"ENOSPC expected: {free / 2**20:.1f} MiB free on "
                                         f"the file system of {d}, a checkpoint of this model "
                                         f"needs about {need_bytes / 2**20:.1f} MiB; nothing "
                                         "was written")


def interruption(e: BaseException) -> tuple[int | None, KeyboardInterrupt] | None:
    """The KeyboardInterrupt (SIGINT / SIGTERM: fullscale.train.Interrupted) behind a
    failure, wherever it is: the exception, its causes, or DCP's per-rank failures (DCP
    catches a rank's exception and hands it to every rank in a CheckpointException).
    Returns (the rank whose failure it was, None: this process's; the exception)."""
    stack, seen = [(None, e)], set()
    while stack:
        rank, x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, KeyboardInterrupt):
            return rank, x
        stack += [(rank, x.__cause__), (rank, x.__context__)]
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            stack += [(r, f[0] if isinstance(f, tuple) else f) for r, f in failures.items()
                      if isinstance(r, int)]
    return None


def storage_error(e: BaseException) -> OSError | None:
    """The OSError with a storage errno (ENOSPC, EDQUOT, EROFS, EIO, EACCES) behind a
    failure, wherever it is: the exception, its causes, DCP's per-rank failures, or only
    the text (pyarrow's "[errno 28] ..."). None if there is none."""
    stack, seen = [e], set()
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in STORAGE_ERRNOS:
            return x
        m = _ERRNO_TEXT.search(str(x)) if isinstance(x, (OSError, RuntimeError)) else None
        if m and int(m.group(1)) in STORAGE_ERRNOS:
            return OSError(int(m.group(1)), os.strerror(int(m.group(1))))
        stack += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


def describe_storage_error(e: OSError) -> str:
    """'ENOSPC: No space left on device (PATH)'."""
    where = f" ({e.filename})" if getattr(e, "filename", None) else ""
    return f"{_errno_text(e)}{where}"


# ----------------------------------------------------------------------------- dist helpers

def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _initialized() else (0, 1)


def _barrier() -> None:
    if _initialized():
        dist.barrier()


def _gather(obj: Any) -> list[Any]:
    """all_gather_object (every rank gets every rank's object)."""
    if not _initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------- paths

def step_dir(ckpt_root: str | Path, step: int) -> Path:
    return Path(ckpt_root) / f"step-{int(step):08d}"


def complete(ckpt_root: str | Path) -> list[tuple[int, Path]]:
    """All complete checkpoints (step, path), oldest first (a COMPLETE marker is present)."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / MARKER).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


# ----------------------------------------------------------------------------- state pieces

def _nonfinite(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
               ) -> tuple[int, list[str]]:
    """(global count, local tensor names) of non-finite values in the local shards of the
    parameters and of the floating-point optimizer state; one all_reduce, one host sync."""
    names_by_param = {id(p): n for n, p in model.named_parameters()}
    tensors: list[tuple[str, torch.Tensor]] = list(model.named_parameters())
    if optimizer is not None:
        for p, st in optimizer.state.items():
            for k, v in st.items():
                if torch.is_tensor(v) and v.is_floating_point():
                    tensors.append((f"{names_by_param.get(id(p), '?')}:{k}", v))
    p0 = next(model.parameters(), None)
    device = _local(p0).device if p0 is not None else torch.device("cpu")
    counts = torch.stack([(~torch.isfinite(_local(t.detach()))).sum().to(device)
                          for _, t in tensors]) if tensors else torch.zeros(1, dtype=torch.long,
                                                                           device=device)
    # float32 all-reduce: every backend (gloo, nccl, hccl) has it; exact below 2^24 values,
    # and only "> 0" decides.
    total = counts.sum().to(torch.float32)
    if _initialized():
        dist.all_reduce(total)
    count = int(round(float(total.item())))
    bad = [n for (n, _), c in zip(tensors, counts.tolist()) if c] if count else []
    return count, bad


def _device_rng() -> tuple[str, torch.Tensor] | None:
    for kind in ("cuda", "npu"):
        mod = getattr(torch, kind, None)
        try:
            if mod is not None and mod.is_available():
                return kind, mod.get_rng_state()
        except Exception:  # noqa: BLE001 - a broken device runtime just means no device RNG
            return None
    return None


def rng_state() -> dict[str, Any]:
    """This process's RNG states in a weights_only-loadable form."""
    np_state = np.random.get_state()
    state = {"torch_cpu": torch.get_rng_state(),
             "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                       "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                       "cached_gaussian": float(np_state[4])},
             "python": _py_state_to_lists(random.getstate())}
    dev = _device_rng()
    if dev is not None:
        state["device"] = {"kind": dev[0], "state": dev[1]}
    return state


def _py_state_to_lists(s: tuple) -> list:
    return [s[0], list(s[1]), s[2]]


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    dev = state.get("device")
    if dev is not None:
        mod = getattr(torch, dev["kind"], None)
        if mod is not None and mod.is_available():
            mod.set_rng_state(dev["state"])


def _to_bytes(obj: Any, path: Path, what: str) -> bytes:
    """torch.save to bytes, checked to load back with weights_only=True (plain types only)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(path, f"{what} holds a type that cannot be stored safely "
                                    f"(use plain dict/list/number/str/tensor values): {e}") from None
    return data


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception)\b.*:")


def _errno_text(e: OSError) -> str:
    """'EIO: Input/output error' (the symbolic name first: what a storage admin greps)."""
    name = errno.errorcode.get(e.errno or 0, type(e).__name__)
    return f"{name}: {e.strerror or e}"


def _load_small(path: Path) -> Any:
    """torch.load(weights_only=True) of trainer.pt / rng-*.pt; torch's warnings about a
    damaged file are dropped (the failure itself is raised and reported in one line)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.load(path, weights_only=True)


def _one_line(e: BaseException) -> str:
    """One line for an error whose text may hold tracebacks (DCP's CheckpointException
    wraps each rank's): the last "SomeError: ..." line, else the last non-empty line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    errors = [ln for ln in lines if _ERROR_LINE.match(ln)]
    line = errors[-1] if errors else (lines[-1] if lines else type(e).__name__)
    return line[:300]


# ----------------------------------------------------------------------------- trust
# A checkpoint directory is input, not code. DCP reads `.metadata` with pickle.load and the
# non-tensor entries of a state dict with torch.load(weights_only=False): whoever can write
# the directory (shared scratch space) could run code in every rank that loads it, and the
# manifest's sha256 does not help (they rewrite it too). So `.metadata` goes through an
# unpickler that builds only DCP's metadata classes (fullscale/dcp_metadata.py: the
# installed torch's), and byte entries load weights_only.


def read_metadata(path: str | Path) -> Any:
    """A checkpoint's DCP `.metadata`, unpickled with only DCP's metadata classes admitted
    (UntrustedCheckpointError naming the file otherwise)."""
    f = Path(path) / ".metadata"
    try:
        with open(f, "rb") as fh:
            md = MetadataUnpickler(fh).load()
    except OSError as e:
        raise CheckpointError(path, f".metadata is unreadable ({_errno_text(e)})") from None
    except Exception as e:  # noqa: BLE001 - a refused global or a damaged pickle
        raise UntrustedCheckpointError(
            path, f"{f}: refusing to load it: {_one_line(e)} (a checkpoint may hold only "
                  "tensors and DCP metadata; see docs/faults.md, trust boundary)") from None
    if not isinstance(md, _dcp_metadata.Metadata):
        raise UntrustedCheckpointError(path, f"{f}: refusing to load it: it holds a "
                                             f"{type(md).__name__}, not DCP Metadata")
    return md


class _VettedReader(dcp.FileSystemReader):
    """DCP's file reader handed the metadata `read_metadata` already vetted (DCP would
    pickle.load the file again)."""

    def __init__(self, path: str | Path, metadata: Any):
        super().__init__(str(path))
        self._vetted = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        md = self._vetted
        if hasattr(md, "storage_meta"):      # torch >= 2.4 records the load id there
            if md.storage_meta is None:
                md.storage_meta = _dcp_metadata.StorageMeta()
            md.storage_meta.load_id = getattr(self, "load_id", None)
        return md


class _WeightsOnlyPlanner(_dcp_planner.DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor entries (optimizer hyperparameters, steps) load
    with torch.load(weights_only=True) instead of a full unpickle."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            _dcp_planner.set_element(self.original_state_dict,
                                     self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


DCP_LOGGER = "c10d-NullHandler-dcp_logger"   # DCP's own logger (torch.distributed.checkpoint.logger)


class _quiet_dcp:
    """Silence DCP's own logging of a failed load (it logs each rank's traceback at ERROR
    level); the failure is raised as one CheckpointError whose `detail` keeps the text."""

    def __enter__(self):
        self._loggers = [logging.getLogger(n) for n in ("torch.distributed.checkpoint",
                                                        "torch.distributed", DCP_LOGGER)]
        self._levels = [lg.level for lg in self._loggers]
        for lg in self._loggers:
            lg.setLevel(logging.CRITICAL)
        return self

    def __exit__(self, *exc):
        for lg, lvl in zip(self._loggers, self._levels):
            lg.setLevel(lvl)
        return False


def _state_of(obj: Any) -> Any:
    if obj is None:
        return None
    return obj.state_dict() if hasattr(obj, "state_dict") else obj


# ----------------------------------------------------------------------------- manager

class CheckpointManager:
    """The checkpoints of one run: where they live, how many are kept, and the async save
    in flight (every method is collective when torch.distributed is initialised).

        ckpt = CheckpointManager(run / "checkpoints", keep=2, async_save=False)
        found = ckpt.load_latest_valid(model, optimizer, scheduler, position=pos, guard=g)
        ckpt.save(step, model, optimizer, scheduler, extra, position=pos, guard=g)
        ckpt.close()        # completes a pending async save (also on an abort)

    `keep`: keep only the newest `keep` complete checkpoints (older ones are deleted after a
    new one is complete; None keeps all). `async_save` (checkpoint.async_save): the state is
    staged (copied to CPU memory) before save() returns and written by DCP in a background
    thread over a separate gloo group; the checkpoint becomes complete (marker, rename,
    pruning) only in `finalize_pending()`, which the next save() / load_latest_valid() call
    first. Until then `complete()` does not list it.
    """

    def __init__(self, root: str | Path, *, keep: int | None = None, async_save: bool = False,
                 on_complete: Any = None):
        """on_complete(step, path): called when a checkpoint has become complete (a sync
        save on return, an async one when finalized; on every rank, at close() on rank 0
        only), e.g. to log its "checkpoint" event only once it is on disk."""
        self.root = Path(root)
        self.keep = keep
        self.async_save = bool(async_save)
        self.on_complete = on_complete
        self._pending: dict[str, Any] | None = None   # an async save not yet complete
        self._async_group = None                      # (default group, gloo group)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- save ---------------------------------------------------------------------
    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
             scheduler: Any = None, extra: dict | None = None, *, position: Any = None,
             guard: Any = None) -> Path:
        """Write checkpoint `step` (collective) and return its directory.

        model / optimizer go through DCP (`get_state_dict`: FSDP2 DTensors stay sharded);
        scheduler, `position` (fullscale.sampler.DataPosition or its state dict), `guard`
        (fullscale.guard.SpikeGuard or its state dict) and `extra` (plain values: dict, list,
        numbers, str, tensors) go to trainer.pt; each rank's RNG states to rng-<rank>.pt.

        Raises NonFiniteError (nothing written) when any parameter or optimizer state is
        nan/inf: log `err.payload` as a "checkpoint_refused" event. Raises CheckpointError
        for bad extra.
        """
        self.finalize_pending()
        rank, world = _rank_world()
        final = step_dir(self.root, step)
        partial = final.with_name(final.name + ".partial")

        reserved = sorted(set(extra or {}) & RESERVED_EXTRA)
        if reserved:
            raise CheckpointError(final, f"extra uses reserved key(s) {reserved} (load() "
                                         "returns them itself)")
        count, names = _nonfinite(model, optimizer)
        if count:
            raise NonFiniteError(final, int(step), count, names)

        trainer_bytes = None
        if rank == 0:
            trainer_bytes = _to_bytes({"format": FORMAT, "step": int(step), "world_size": world,
                                       "time": time.time(), "scheduler": _state_of(scheduler),
                                       "position": _state_of(position), "guard": _state_of(guard),
                                       "extra": dict(extra or {})}, final, "trainer state")
            self.root.mkdir(parents=True, exist_ok=True)
            if partial.exists():  # left by a save killed earlier
                shutil.rmtree(partial)
            partial.mkdir()
        _barrier()

        _write(partial / f"rng-{rank:05d}.pt", _to_bytes(rng_state(), final, "rng state"))
        if rank == 0:
            _write(partial / TRAINER_FILE, trainer_bytes)
        kill_point("checkpoint.write", int(step))
        model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
        state = {"model": model_sd} if optimizer is None else {"model": model_sd, "optim": optim_sd}
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            if self.async_save:
                future = dcp.async_save(state, checkpoint_id=str(partial),
                                        no_dist=not _initialized(),
                                        process_group=self._background_group())
                self._pending = {"future": future, "partial": partial, "final": final,
                                 "step": int(step), "rank": rank, "world": world}
                return final
            dcp.save(state, checkpoint_id=str(partial), no_dist=not _initialized())
        self._finish(partial, final, int(step))
        return final

    def _completed(self, step: int, path: Path) -> None:
        if self.on_complete is not None:
            self.on_complete(step, path)

    def _finish(self, partial: Path, final: Path, step: int) -> None:
        """_finish, then on_complete: on rank 0 as soon as the checkpoint is renamed complete,
        before the closing barrier (a peer that dies or hangs there fails the barrier: the
        checkpoint on disk still gets its "checkpoint" event, before the fault), on the
        other ranks after it."""
        _finish(partial, final, step, self.keep, self.root,
                on_marked=lambda: self._completed(step, final))
        if _rank_world()[0] != 0:
            self._completed(step, final)

    def _background_group(self):
        """A gloo group for async saves: their collectives must not interleave with
        training's."""
        if not _initialized():
            return None
        default = dist.distributed_c10d._get_default_group()
        if self._async_group is None or self._async_group[0] is not default:
            # new_group's default timeout is 30 min, not the one the run chose
            # (dist.timeout_s): a dead peer would then hang the background thread, and the
            # exit, for 30 min.
            self._async_group = (default, dist.new_group(backend="gloo",
                                                         timeout=_default_timeout()))
        return self._async_group[1]

    def finalize_pending(self) -> Path | None:
        """Complete an async save (collective): wait for its writes, then write the marker
        and rename. Returns the completed checkpoint's path, or None if nothing was pending.
        A failed background write raises CheckpointError (the checkpoint stays incomplete);
        a failed collective of it (RuntimeError, TimeoutError: a peer died or hung) its own
        error, which the trainer logs as a fault."""
        if self._pending is None:
            return None
        job, self._pending = self._pending, None
        try:
            _wait(job["future"])
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001
            err = storage_error(e)
            if err is not None:   # the trainer reports it as the storage error it is
                err.filename = err.filename or str(job["partial"])
                raise err from None
            if isinstance(e, (RuntimeError, TimeoutError)):
                # a collective of the save failed (a peer rank died or hung: gloo's timeout):
                # the job's fault, logged as one by the trainer, not a checkpoint problem
                raise
            raise CheckpointError(job["final"], f"async save failed ({_one_line(e)})",
                                  detail=str(e)) from None
        self._finish(job["partial"], job["final"], job["step"])
        return job["final"]

    def close(self) -> None:
        """Complete an async save still pending on a path that skipped finalize_pending()
        (guard abort, user error). Not collective (a peer may be gone): each rank waits for
        its own writes; rank 0, whose DCP future resolves only after every rank's data and
        .metadata are written, hashes every file (on one rank: slow for a large model, but a
        manifest without hashes could not reject a shard damaged later) and renames; older
        checkpoints are not pruned. Never raises; a failed or interrupted save stays
        .partial."""
        if self._pending is None:
            return
        job, self._pending = self._pending, None
        try:
            _wait(job["future"])
            if job["rank"] != 0 or job["final"].exists():
                return
            partial = job["partial"]
            files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
                     for p in sorted(partial.iterdir()) if p.is_file() and p.name != MARKER}
            if len([f for f in files if f.startswith("rng-")]) != job["world"]:
                return
            _write_marker(partial, {"format": FORMAT, "step": job["step"],
                                    "world_size": job["world"], "time": time.time(),
                                    "files": files, "finalized": "at close"})
            os.replace(partial, job["final"])
            _fsync_dir(job["final"].parent)
            self._completed(job["step"], job["final"])
        except BaseException:  # noqa: BLE001 - best effort on the way out
            return

    # -- load ---------------------------------------------------------------------
    def load_latest_valid(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                          scheduler: Any = None, *, before_step: int | None = None,
                          position: Any = None, guard: Any = None, restore_rng: bool = True
                          ) -> tuple[int, Path, dict, list[CheckpointError]] | None:
        """Load the newest checkpoint that verifies (optionally with step < before_step,
        e.g. the spike step of a rollback). Returns (step, path, extra, rejected) where
        `rejected` lists the CheckpointErrors of newer, corrupt ones (log each as an
        event), or None when no complete checkpoint exists. Raises a CheckpointError
        listing every problem if all are corrupt."""
        self.finalize_pending()
        candidates = [c for c in complete(self.root) if before_step is None or c[0] < before_step]
        rejected: list[CheckpointError] = []
        for step, path in reversed(candidates):
            kill_point("checkpoint.load", step)
            try:
                extra = load(path, model, optimizer, scheduler, position=position, guard=guard,
                             restore_rng=restore_rng)
            except (NonFiniteError, UntrustedCheckpointError):
                raise
            except CheckpointError as e:
                rejected.append(e)
                continue
            return step, path, extra, rejected
        if rejected:
            raise CheckpointError(self.root, "no loadable checkpoint: " +
                                  " | ".join(str(e) for e in rejected))
        return None


def _default_timeout() -> timedelta:
    """The default process group's timeout (private torch API; 300 s if unreadable)."""
    try:
        pg = dist.distributed_c10d._get_default_group()
        dev = dist.distributed_c10d._get_pg_default_device(pg)
        return pg._get_backend(dev).options._timeout
    except Exception:  # noqa: BLE001 - torch versions differ
        return timedelta(seconds=300)


def _wait(future: Any) -> None:
    (future.upload_completion if hasattr(future, "upload_completion") else future).result()


def _finish(partial: Path, final: Path, step: int, keep: int | None, root: Path,
            on_marked: Any = None) -> None:
    """All files are written: hash them (each rank a share), then rank 0 writes COMPLETE,
    renames partial -> final, prunes and calls on_marked()."""
    rank, world = _rank_world()
    _barrier()
    files = sorted(p.name for p in partial.iterdir() if p.is_file() and p.name != MARKER)
    mine = {f: {"size": (partial / f).stat().st_size, "sha256": _sha256(partial / f)}
            for f in files[rank::world]}
    gathered = _gather(mine)
    if rank == 0:
        manifest = {"format": FORMAT, "step": step, "world_size": world,
                    "time": time.time(), "files": {k: v for d in gathered for k, v in d.items()}}
        _write_marker(partial, manifest)
        trash = None
        if final.exists():  # same step saved again (after a rollback): replace it
            trash = final.with_name(final.name + f".old-{os.getpid()}")
            os.replace(final, trash)
        os.replace(partial, final)
        _fsync_dir(final.parent)
        kill_point("checkpoint.marked", step)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        if keep is not None:
            prune(root, keep)
        if on_marked is not None:   # before the barrier a dead or hung peer fails
            on_marked()
    _barrier()


def _write_marker(directory: Path, manifest: dict) -> None:
    tmp = directory / f".{MARKER}.tmp"
    _write(tmp, json.dumps(manifest, indent=1, sort_keys=True).encode())
    os.replace(tmp, directory / MARKER)
    _fsync_dir(directory)


def prune(ckpt_root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints and stale .partial dirs older
    than the newest complete one (rank 0 only; not collective). Returns what was removed."""
    if keep < 1:
        raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
    done = complete(ckpt_root)
    removed = [p for _, p in done[:-keep]]
    newest = done[-1][0] if done else None
    for p in Path(ckpt_root).iterdir():
        m = _PARTIAL_DIR.match(p.name)
        if m and newest is not None and int(m.group(1)) < newest:
            removed.append(p)
        elif p.name.startswith(".deleting-"):   # a prune killed mid-rmtree: finish it
            shutil.rmtree(p, ignore_errors=True)
    for p in removed:  # rename first: a prune killed halfway never leaves a torn "complete" dir
        doomed = p.with_name(f".deleting-{p.name}-{os.getpid()}")
        try:
            os.replace(p, doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)
    return removed


# ----------------------------------------------------------------------------- load

def read_manifest(path: str | Path) -> dict:
    """The COMPLETE manifest of a checkpoint directory (CheckpointError if absent or bad)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(path, "not a directory")
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(path, f"no {MARKER} marker: incomplete (killed while saving?)")
    try:
        manifest = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(path, f"{MARKER} manifest is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(path, f"{MARKER} manifest has format "
                                    f"{manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                                    f"expected {FORMAT!r}")
    files = manifest.get("files")
    if not isinstance(files, dict) or TRAINER_FILE not in files or ".metadata" not in files:
        raise CheckpointError(path, f"{MARKER} manifest does not list {TRAINER_FILE} and .metadata")
    return manifest


def verify(path: str | Path, *, hashes: bool = True) -> dict:
    """Check the manifest against the files (collective: each rank hashes its share and
    every rank raises the same CheckpointError). Returns the manifest."""
    path = Path(path)
    rank, world = _rank_world()
    try:
        manifest = read_manifest(path)
        problems = []
        names = sorted(manifest["files"])
        for i, name in enumerate(names):
            want = manifest["files"][name]
            f = path / name
            try:
                if not f.is_file():
                    problems.append(f"{name} is missing")
                elif f.stat().st_size != want.get("size"):
                    problems.append(f"{name} has {f.stat().st_size} bytes, manifest says "
                                    f"{want.get('size')} (truncated?)")
                elif not want.get("sha256"):    # written unverified (an older async close)
                    problems.append(f"{name} has no sha256 in the manifest (unverifiable)")
                elif hashes and i % world == rank and _sha256(f) != want["sha256"]:
                    problems.append(f"{name} does not match its sha256 (corrupt)")
            except OSError as e:   # EIO on a failing disk: this checkpoint is unusable
                problems.append(f"{name} is unreadable ({_errno_text(e)})")
    except CheckpointError as e:
        manifest, problems = None, [e.problem]
    all_problems = sorted({p for ps in _gather(problems) for p in ps})
    if all_problems:
        raise CheckpointError(path, "; ".join(all_problems))
    return manifest


def load(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
         scheduler: Any = None, *, position: Any = None, guard: Any = None,
         restore_rng: bool = True, verify_hashes: bool = True) -> dict:
    """Restore a checkpoint in place (collective) and return its `extra` dict plus the
    reserved keys "step", "rng_restored", "position" and "guard" (the saved state dicts, for
    SpikeGuard.rollback).

    The manifest is verified first (CheckpointError, state untouched, if anything is missing,
    truncated or corrupt). Then model + optimizer (DCP; resharded if the world size changed),
    scheduler / position / guard via their load_state_dict, and this rank's RNG states (only
    when the world size is unchanged; extra["rng_restored"] says whether).
    """
    path = Path(path)
    rank, world = _rank_world()
    manifest = verify(path, hashes=verify_hashes)
    trainer, rng, problem = None, None, None
    try:
        trainer = _load_small(path / TRAINER_FILE)
        if not isinstance(trainer, dict) or trainer.get("format") != FORMAT:
            problem = f"{TRAINER_FILE} is not an adamspike trainer state"
    except Exception as e:  # noqa: BLE001 - any unpickling failure
        problem = f"{TRAINER_FILE} is unreadable ({_one_line(e)})"
    rng_file = path / f"rng-{rank:05d}.pt"
    want_rng = restore_rng and manifest["world_size"] == world and rng_file.is_file()
    if want_rng and problem is None:
        try:
            rng = _load_small(rng_file)
            if not isinstance(rng, dict) or "torch_cpu" not in rng:
                problem = f"{rng_file.name} is not an RNG state"
        except Exception as e:  # noqa: BLE001
            problem = f"{rng_file.name} is unreadable ({_one_line(e)})"
    metadata, untrusted = None, None
    if problem is None:
        try:
            metadata = read_metadata(path)
        except UntrustedCheckpointError as e:
            untrusted = e.problem
        except CheckpointError as e:
            problem = e.problem
    untrusted_all = sorted({p for p in _gather(untrusted) if p})
    if untrusted_all:
        raise UntrustedCheckpointError(path, "; ".join(untrusted_all))
    problems = sorted({p for p in _gather(problem) if p})   # every rank decides the same
    if problems:
        raise CheckpointError(path, "; ".join(problems))
    has_optim = optimizer is not None
    model_sd, optim_sd = get_state_dict(model, optimizer if has_optim else [])
    state = {"model": model_sd, "optim": optim_sd} if has_optim else {"model": model_sd}
    try:
        with warnings.catch_warnings(), _quiet_dcp():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(path), storage_reader=_VettedReader(path, metadata),
                     planner=_WeightsOnlyPlanner(), no_dist=not _initialized())
        set_state_dict(model, optimizer if has_optim else [], model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if interruption(e) is not None:     # a signal on some rank, not a damaged checkpoint
            raise
        raise CheckpointError(path, "model/optimizer state does not load into this model "
                                    f"({_one_line(e)})", detail=str(e)) from None
    if scheduler is not None and trainer.get("scheduler") is not None:
        scheduler.load_state_dict(trainer["scheduler"])
    if position is not None and trainer.get("position") is not None:
        position.load_state_dict(trainer["position"])
    if guard is not None and trainer.get("guard") is not None:
        guard.load_state_dict(trainer["guard"])
    rng_restored = rng is not None
    if rng_restored:
        set_rng_state(rng)
    extra = dict(trainer.get("extra") or {})
    extra.update(step=int(trainer["step"]), rng_restored=rng_restored,
                 position=trainer.get("position"), guard=trainer.get("guard"))
    return extra


__all__: Iterable[str] = ("CheckpointError", "CheckpointManager", "NonFiniteError",
                          "UntrustedCheckpointError", "load", "read_metadata",
                          "check_storage", "estimated_size", "storage_error",
                          "complete", "verify", "read_manifest", "prune", "step_dir",
                          "rng_state", "set_rng_state")
