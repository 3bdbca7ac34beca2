"""`adamspike train`: the torch trainer (FSDP2, per-tensor Adam telemetry, spike guard).

    adamspike train --config configs/tiny.toml --out RUN [--resume] [--section.key value ...]
    python -m fullscale.train ...            torchrun --nproc-per-node 8 -m fullscale.train ...

The run, top to bottom (`Trainer`; one optimizer step s = 1..train.num_steps):
    config -> device + process group -> rank 0 locks the run directory (RunLock: a second
    writer is refused) -> model on meta -> parallelize -> to_empty -> init_weights ->
    AdamW + LambdaLR -> data source -> CheckpointManager -> [resume: newest valid
    checkpoint, older ones if it does not load] -> run directory (rank 0; on resume rows
    after the checkpoint are truncated)
    for each step s (`Trainer.run`):
        [faults: hang]
        data.skip_batches hit?      forward/backward for loss and grad_norm, logged with
                                    skipped=True; no update, lr schedule advances ("skip")
        forward / backward          loss_scale * (ce + z_loss * mean(logsumexp^2)) / accum
                                    over this rank's micro-batches (sampler.local_batch:
                                    batch s + offset, poisoned batches); [faults: NaN grads]
        loss = mean over the global batch (all-reduced); clip (threshold grad_clip * s)
        guard.observe(s, loss)      spike / non-finite -> roll back to the newest checkpoint
                                    before s, skip a window of batches (PaLM); or abort
        [mitigations] -> telemetry.before_step -> optimizer.step -> telemetry.after_step
        steps row, layers + hists (telemetry.every / hist_every), alarms (rank 0)
        checkpoint due?             rank 0 flushes the run directory (every row <= s
                                    durable), then the collective save (COMPLETE last)

Interfaces used (all collective where marked in their modules):
- fullscale.device: detect, init_distributed, torch_device, synchronize, mfu, memory_stats
- fullscale.checkpoint.CheckpointManager(root, keep=, async_save=): save(step, model,
  optimizer, scheduler, extra, position=, guard=), load_latest_valid(model, optimizer,
  scheduler, before_step=, position=, guard=) -> (step, path, extra, rejected) | None,
  finalize_pending(), close(); NonFiniteError -> "checkpoint_refused" event
- fullscale.guard: SpikeGuard(cfg.guard).observe(step, loss) -> Decision(action, reason,
  events); rollback(spike_step, extra, offset_now) -> RollbackPlan(resume_step, position)
- fullscale.sampler: batch_plan, local_batch, is_skipped, DataPosition(step, offset)
- adamspike.rundir: RunLock, RunWriter (flush() before every checkpoint)
- the `faults` section (docs/faults.md): injected NaN gradients, poisoned batches, a hung or
  killed rank; ADAMSPIKE_KILL_AT (adamspike.faults) kills at a precise point for the tests

Definitions of the steps columns:
- loss: unscaled ce (+ z-loss term), mean over the global batch (all ranks, all micro-batches)
- grad_norm: global L2 norm, before clipping, of the gradient AdamW receives, i.e. of
  loss_scale * loss (as simulate/optim.py's clip state); clipped: the clip factor was < 1
- update_norm: global L2 norm of the applied parameter change p_after - p_before. Cost: one
  copy of this rank's parameter shard (4 bytes / parameter / world size) during the step,
  a foreach subtract + norm, and one scalar all-reduce.
- tokens: step * global_batch_size * seq_len (as Megatron's consumed samples x seq length)
- extra columns: tokens_per_s (global), mfu (per device, None when the peak is unknown),
  peak_mem_gb (accelerators only)

Determinism across world sizes: the initial weights are drawn as full tensors from one
seeded generator on every rank (each keeps its shard), and the data order depends only on
(step, offset, global batch, seed), so 1 and N processes train the same model on the same
batches; they differ by floating-point summation order (tests/fullscale/test_dist.py).
Without torchrun a one-process group is created, so FSDP2 (and its bf16 policy) is applied
the same way for 1 and N processes.

Rollback rows: the steps s' > checkpoint step that are re-run after a rollback are logged
again; readers keep the last row per step, so the trace is the trajectory of the final
weights, and the discarded losses survive in the "spike"/"rollback" events.

Exit status: 0 done; 2 bad input (config, data, predictions, run directory, another live
writer on it, checkpoint to resume); 3 training aborted (guard gave up, non-finite loss with
the guard disabled, non-finite state at the last checkpoint or at a checkpoint with the
guard disabled, no checkpoint to roll back to); 1 a storage error (ENOSPC, EROFS, EIO: one
line naming it) or an unexpected failure (both logged as a "fault" event first); 130 / 143
SIGINT / SIGTERM (a "fault" event, one line). Every non-zero exit says why in one stderr
line.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import shutil
import signal
import sys
import time
import warnings
from dataclasses import asdict, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from adamspike import mitigations
from adamspike.config import ConfigError, flatten, load_config, to_dict
from adamspike.llama import flops_per_token, num_params, spec_by_name
from adamspike.predictions import PredictionsError
from adamspike.faults import kill_point
from adamspike.rundir import (RunFormatError, RunLock, RunLockedError, RunWriter,
                              append_event, check_new_run_dir, environment, move_aside,
                              read_events, read_meta)
from adamspike.train_config import RunConfig
from fullscale import device as devices
from fullscale.device import local_shard as _local
from fullscale.checkpoint import (CheckpointError, CheckpointManager, NonFiniteError,
                                  check_storage, complete, describe_storage_error,
                                  estimated_size, interruption, load, storage_error)
from fullscale.alarms import build_alarms
from fullscale.data import DataFormatError, build_source
from fullscale.guard import SpikeGuard
from fullscale.hf import resolve_model
from fullscale.model import Transformer
from fullscale.optim import apply_mitigations, build_optimizer, build_scheduler, clip_gradients
from fullscale.parallelize import parallelize
from fullscale.sampler import DataPosition, batch_plan, is_skipped, local_batch
from fullscale.probe.tensorboard import WandbScalars, WandbUnavailable, import_wandb
from fullscale.telemetry import (Telemetry, TensorBoardScalars, shard_group, telemetry_vhists,
                                 write_vhists)

USER_ERRORS = (ConfigError, DataFormatError, PredictionsError, RunFormatError,
               CheckpointError, devices.DeviceError)


class TrainingAborted(RuntimeError):
    """The run cannot continue (guard gave up, non-finite loss or state, nothing to roll
    back to). `logged`: the "abort" event is already in the run directory."""

    def __init__(self, message: str, *, logged: bool = False):
        super().__init__(message)
        self.logged = logged


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM (Ctrl-C, a scheduler's preemption, torchrun stopping its
    workers): raised in the main thread, logged as a "fault" event, one stderr line,
    exit 128 + the signal number (130, 143). `step`: where the loop was, when known;
    `rank`: the peer rank that received it, when this process learned of it from that
    rank (see _stop_reason), else None."""

    def __init__(self, signum: int, rank: int | None = None):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.rank, self.step = signum, rank, None

    def __reduce__(self):   # DCP pickles a rank's exception to hand it to the others
        return type(self), (self.signum, self.rank)


# Signals. The first SIGINT / SIGTERM raises Interrupted in the main thread; once the process
# is stopping (that signal, or any failure being handled: _stop_reason) a signal is only
# recorded, so a late one (torchrun forwards its own to every worker, one rank may be
# stopping already) cannot interrupt the fault event, the flush or the teardown.
_received: list[int] = []       # SIGINT / SIGTERM received by this process, in order
_stopping = False
# The torchrun job's store key where the first rank to be interrupted says so (rank:SIGNAL)
# before it leaves its collectives: a peer whose collective then fails ("Connection closed
# by peer") reads it and stops as interrupted, not as an unexplained failure, even when its
# own copy of the signal comes a moment later (or never: one rank signalled).
_INTERRUPT_KEY = "adamspike/interrupted"


def _on_signal(signum, frame):
    global _stopping
    _received.append(signum)
    if not _stopping:
        _stopping = True
        raise Interrupted(signum)


def _stop_reason(e: BaseException) -> BaseException:
    """Why this process stops, given the exception that stops it: an Interrupted (this
    process's signal, announced to the job's other ranks) or, when this process was
    signalled meanwhile or a peer rank announced a signal, an Interrupted for it; else `e`.

    Call it first thing in an except clause, inside a `try` that retries it with the
    Interrupted a pending signal handler may raise on entry:

        except BaseException as e:
            try:
                reason = _stop_reason(e)
            except Interrupted as i:
                reason = _stop_reason(i)
    """
    global _stopping
    _stopping = True        # from here on a signal is recorded, never raised
    if isinstance(e, Interrupted):
        if e.rank is None:
            _announce_interrupt(e.signum)
        return e
    found = interruption(e)     # inside DCP's CheckpointException: this rank's or a peer's
    if found is not None:
        rank, i = found
        signum = getattr(i, "signum", signal.SIGINT)
        if rank is None or rank == (dist.get_rank() if dist.is_initialized() else 0):
            _announce_interrupt(signum)
            return _caused(Interrupted(signum), e)
        return _caused(Interrupted(signum, rank=rank), e)
    if _received:           # the handler ran and a library turned its Interrupted into
        _announce_interrupt(_received[0])       # something else
        return _caused(Interrupted(_received[0]), e)
    peer = _peer_interrupt()
    if peer is not None:
        return _caused(Interrupted(peer[1], rank=peer[0]), e)
    return e


def _caused(i: Interrupted, e: BaseException) -> Interrupted:
    i.__cause__ = e
    return i


def _default_store():
    """The default process group's store (torchrun's agent store), None without one; its
    requests time out after 5 s (a stopped store host must not hold a stopping rank)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=5))
        return store
    except Exception:  # noqa: BLE001 - a torch without it: no announcement
        return None


def _announce_interrupt(signum: int) -> None:
    store = _default_store()
    if store is None:
        return
    try:
        store.set(_INTERRUPT_KEY, f"{dist.get_rank()}:{signal.Signals(signum).name}")
    except Exception:  # noqa: BLE001 - the store's host is gone: the peers see a failure
        pass


def _peer_interrupt() -> tuple[int, int] | None:
    """(rank, signal number) a peer announced, or None."""
    store = _default_store()
    if store is None:
        return None
    try:
        if not store.check([_INTERRUPT_KEY]):
            return None
        rank, name = store.get(_INTERRUPT_KEY).decode().split(":")
        return int(rank), int(signal.Signals[name])
    except Exception:  # noqa: BLE001 - no store to ask: the failure stands as it is
        return None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="adamspike train", description=__doc__.split("\n")[0],
                                allow_abbrev=False,
                                epilog="Any --section.key value pair overrides the config.")
    p.add_argument("--config", help="run config TOML (defaults: adamspike.train_config)")
    p.add_argument("--out", required=True, help="run directory (new, or the one to --resume)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest valid checkpoint in OUT/checkpoints (from "
                        "step 0 when none was ever completed)")
    p.add_argument("--restart", action="store_true",
                   help="a new run in OUT: its old contents are first moved to "
                        "OUT.restart-<time> (nothing is deleted)")
    p.add_argument("--replay-from", metavar="CKPT",
                   help="a new run OUT that starts from checkpoint CKPT of another run "
                        "(RUN/checkpoints/step-N) under this config (replay_from_checkpoint)")
    return p


# ----------------------------------------------------------------------------- helpers

def _check_wandb() -> None:
    """telemetry.wandb = true needs the wandb package (rank 0 writes the W&B run)."""
    try:
        import_wandb("telemetry.wandb = true")
    except WandbUnavailable as e:
        raise ConfigError(str(e)) from None


def _rank0_call(rank: int, fn):
    """Run fn on rank 0 and give every rank the same outcome (a user error raised on rank 0
    is raised on all ranks, so none is left waiting in a collective)."""
    result, err = None, None
    if rank == 0:
        try:
            result = fn()
        except USER_ERRORS as e:
            err = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [None if err is None else (type(err).__name__, str(err))]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None and err is None:
            kinds = {c.__name__: c for c in (RunFormatError, RunLockedError, PredictionsError,
                                             DataFormatError)}
            err = kinds.get(box[0][0], ConfigError)(box[0][1])
    if err is not None:
        raise err
    return result


def _mean_over_ranks(x: torch.Tensor) -> float:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x)
        x = x / dist.get_world_size()
    return float(x)


def loss_terms(logits: torch.Tensor, targets: torch.Tensor, z_loss: float) -> torch.Tensor:
    """Mean cross-entropy + z_loss * mean(logsumexp^2) (PaLM), float32 (simulate/llama.py)."""
    logits, targets = logits.flatten(0, 1), targets.flatten()
    if not z_loss:
        return F.cross_entropy(logits, targets)
    z = torch.logsumexp(logits, dim=-1)
    ce = (z - logits.gather(1, targets[:, None]).squeeze(1)).mean()
    return ce + z_loss * (z * z).mean()


def _init_generator(seed: int, device: torch.device) -> torch.Generator:
    """Seeded generator for the initial weights, on the device where it can be (fast for
    70B), else on the CPU. Same device type => same weights for any world size."""
    try:
        return torch.Generator(device=device).manual_seed(seed)
    except Exception:  # noqa: BLE001 - backends without device generators
        return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, overrides = parser().parse_known_args(argv)
    global _stopping
    own_group = finished = interrupted = False
    previous, rc = {}, None
    _received.clear()
    _stopping = False
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, _on_signal)
    except ValueError:   # not the main thread (an embedding caller): leave signals alone
        pass
    try:
        cfg = load_config(RunConfig, args.config, overrides)
        cfg.check()
        own_group = _setup_distributed(cfg)
        if args.replay_from and args.resume:
            raise ConfigError("--replay-from: a replay is a new run; it cannot --resume")
        if args.restart and args.resume:
            raise ConfigError("--restart starts a new run; it cannot --resume")
        rc = train(cfg, Path(args.out), resume=args.resume, restart=args.restart,
                   replay_from=Path(args.replay_from) if args.replay_from else None)
        finished = True
        return rc
    except USER_ERRORS as e:
        print(f"adamspike train: error: {e}", file=sys.stderr)
        rc = 2
        return rc
    except TrainingAborted as e:
        print(f"adamspike train: aborted: {e}", file=sys.stderr)
        rc = 3
        return rc
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        try:
            reason = _stop_reason(e)
        except Interrupted as i:        # a signal handled on the way in
            reason = _stop_reason(i)
        if isinstance(reason, Interrupted):
            where = f" at step {reason.step}" if reason.step is not None else ""
            by = (f" (on rank {reason.rank})"
                  if reason.rank is not None and reason.signum not in _received else "")
            print(f"adamspike train: interrupted by {reason}{by}{where}; the run is intact up "
                  "to its newest complete checkpoint (--resume continues)", file=sys.stderr)
            interrupted, rc = True, 128 + reason.signum
            return rc
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        err = storage_error(e) or _disk_full(Path(args.out))
        if err is None:
            raise
        if not err.filename:
            err.filename = args.out
        print(f"adamspike train: error: storage: {describe_storage_error(err)}; the run is "
              "intact up to its newest complete checkpoint (fix the file system, then "
              "--resume)", file=sys.stderr)
        rc = 1
        return rc
    finally:
        _stopping = True        # a signal now (a peer stopping late) must not break teardown
        worker = (not own_group and dist.is_available() and dist.is_initialized()
                  and dist.get_world_size() > 1)
        # an interrupted worker leaves its group as it is: a peer may still be inside a
        # collective (it sees this rank's sockets close)
        if (own_group or dist.is_initialized()) and not (worker and interrupted):
            devices.destroy_distributed(synchronize=finished)
        if not _received:       # else keep recording: a late copy must not kill the exit
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if worker and rc is not None:
            # A torchrun worker that said why it stops ends here, its run directory closed
            # and its lock released: after a gloo job the interpreter's exit sometimes
            # aborts ("terminate called without an active exception" with no Python frame
            # left: SIGABRT instead of the status; 2 of 32 interrupted 2-rank jobs, and a
            # finished one in about 30, despite the barrier before destroy_process_group)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)


# Bytes per parameter a process holds at least: fp32 weights, gradients and AdamW's two
# moments (FSDP2 shards all four over the world); activations come on top.
MIN_BYTES_PER_PARAM = 16


def _check_memory(cfg: RunConfig, params: int, info, world: int) -> None:
    """Refuse, before building it, a model that cannot fit: its least memory per process
    against what this process may allocate (the processes of a node share a cpu host)."""
    avail = devices.available_memory(info)
    if avail is None:
        return
    per_process = MIN_BYTES_PER_PARAM * params / world
    sharing = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if info.type == "cpu" else 1
    if per_process * sharing > avail[0]:
        raise ConfigError(f"model: {params / 1e9:.3g}B parameters need at least "
                          f"{per_process / 2**30:.1f} GiB per process ({MIN_BYTES_PER_PARAM} "
                          f"B/param: weights, gradients, Adam state; world size {world}"
                          + (f", {sharing} processes on this host" if sharing > 1 else "")
                          + f"), only {avail[0] / 2**30:.1f} GiB available ({avail[1]}); use "
                          "more processes or a smaller model")


def _disk_full(out: Path) -> OSError | None:
    """ENOSPC when the run's file system is (nearly) full: some writers report a full disk
    only as their own inconsistency (torch's zip writer: "unexpected pos 704 vs 598")."""
    d = out
    while not d.is_dir() and d != d.parent:
        d = d.parent
    try:
        free = shutil.disk_usage(d).free
    except OSError:
        return None
    if free >= 64 * 2**20:
        return None
    return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}, {free / 2**20:.1f} MiB free",
                   str(d))


def _setup_distributed(cfg: RunConfig) -> bool:
    """Process group from torchrun, or a one-rank group of our own (returns True then)."""
    info = devices.detect(cfg.dist.device, int(os.environ.get("LOCAL_RANK", 0)))
    devices.init_distributed(info, cfg.dist.timeout_s)
    if dist.is_initialized():
        return False
    dist.init_process_group(info.backend, store=dist.HashStore(), rank=0, world_size=1,
                            **devices.group_device(info))
    return True


def train(cfg: RunConfig, out: Path, *, resume: bool = False, restart: bool = False,
          replay_from: Path | None = None) -> int:
    """Train cfg into run directory `out` (collective); returns the exit status (0).
    restart, replay_from: see `Trainer`."""
    return Trainer(cfg, Path(out), resume=resume, restart=restart, replay_from=replay_from).run()


class Trainer:
    """One training run: the model, its optimizer, data position, guard, checkpoints and the
    run directory (rank 0), built in __init__; `run()` is the loop."""

    def __init__(self, cfg: RunConfig, out: Path, *, resume: bool, restart: bool = False,
                 replay_from: Path | None = None):
        """replay_from (replay from checkpoint): a *new* run directory `out` whose state at
        the start is checkpoint `replay_from` (RUN/checkpoints/step-N) of another run, under
        this cfg, which may differ from that run's (`--resume` continues one run under its
        own config; a replay is an explicit fork): the checkpoint loads into an optimizer
        and scheduler built from the source run's config (run.json), then every tensor's
        Adam state moves into this cfg's optimizer (its own param groups, eps and frozen
        groups), the scheduler is rebuilt from this cfg at the checkpoint's step (so
        optim.lr / schedule changes apply), and the data position and RNG are restored.
        The run starts at step N + 1; its run.json records `replay_of` and an event
        "replay_from" names the checkpoint.
        restart: a new run in `out` after moving its old contents to OUT.restart-<time>
        (the way out when every checkpoint of a run is damaged)."""
        self.cfg, self.out, self.resume = cfg, out, resume
        self.replay_from = None if replay_from is None else Path(replay_from)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # --- ownership of the run directory first (rank 0 decides, the others follow): a
        # resumed run is locked before its checkpoints are read; a new one is only checked
        # here (nothing is created before the config, model and data are known to be good)
        # and locked when its run directory is created.
        def own() -> RunLock | None:
            if resume:
                return RunLock(out).acquire(new=False)
            if restart:
                aside = move_aside(out)
                if aside is not None:
                    _warn(f"--restart: moved the previous contents of {out} to {aside}")
            check_new_run_dir(out, hint="resume it (--resume), move it aside (--restart) "
                                        "or choose a new directory")
            return None

        self.lock = _rank0_call(self.rank, own)
        self.writer = self.tb = self.wb = None
        self._fired: set[tuple[str, int]] = set()     # injected faults already fired
        # the checkpoint the last rollback of this incident restored (None once a newer one
        # is saved) and the checkpoints the fault recurred from (see _rollback)
        self._rollback_target: int | None = None
        self._reproduced: set[int] = set()
        try:
            self._build()
        except BaseException:
            if self.writer is not None:
                self.writer.close()         # releases the lock too
            elif self.lock is not None:
                self.lock.release()
            raise

    def _build(self) -> None:
        cfg, out, rank, world = self.cfg, self.out, self.rank, self.world
        # --- device, model, optimizer, data
        self.info = info = devices.detect(cfg.dist.device, int(os.environ.get("LOCAL_RANK", 0)))
        self.device = devices.torch_device(info)
        if cfg.train.dtype == "bf16" and not info.supports_bf16:
            raise ConfigError(f"train.dtype: bf16 is not supported by {info.name}")
        arch = resolve_model(cfg.model)
        _check_memory(cfg, num_params(arch), info, world)
        # a read-only or full file system is refused now, not a checkpoint interval later
        _rank0_call(rank, lambda: check_storage(out / "checkpoints",
                                                estimated_size(num_params(arch))))
        if cfg.train.seq_len > arch.max_seq_len:
            raise ConfigError(f"train.seq_len: {cfg.train.seq_len} exceeds model "
                              f"max_seq_len={arch.max_seq_len}")
        self.plan = batch_plan(cfg, world)
        if cfg.telemetry.wandb:       # asked for: refused now, before any file, on every rank
            _rank0_call(rank, _check_wandb)
        if cfg.alarms.predictions and not cfg.telemetry.enabled:
            raise ConfigError("alarms.predictions: the alarm rules read per-tensor telemetry; "
                              "set telemetry.enabled = true")
        torch.manual_seed(cfg.train.seed)
        specs = spec_by_name(arch)
        self.mit = mitigations.plan(cfg, {n: s.depth for n, s in specs.items()}, arch.num_layers)
        with torch.device("meta"):
            model = Transformer(arch, **self.mit.model_options)
        parallelize(model, world, activation_checkpointing=cfg.train.activation_checkpointing,
                    mixed_precision=cfg.train.dtype, device=self.device)
        model.to_empty(device=self.device)
        model.init_weights(_init_generator(cfg.train.seed, self.device))
        self.model = model
        self.optimizer = build_optimizer(model, cfg.optim, self.mit)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.num_steps)
        self.source = build_source(cfg.data, cfg.train.seq_len, arch.vocab_size, cfg.train.seed)
        self.position, self.guard = DataPosition(), SpikeGuard(cfg.guard)
        self.telemetry = (Telemetry(self.optimizer, specs, every=cfg.telemetry.every,
                                    hist_every=cfg.telemetry.hist_every,
                                    precision=cfg.telemetry.precision,
                                    compile=cfg.telemetry.compile,
                                    explicit_m_prev=mitigations.needs_explicit_m_prev(cfg))
                          if cfg.telemetry.enabled else None)
        self.alarms = _rank0_call(rank, lambda: build_alarms(cfg.alarms))  # evaluated on rank 0
        self.ckpt = CheckpointManager(out / "checkpoints", keep=cfg.checkpoint.keep,
                                      async_save=cfg.checkpoint.async_save,
                                      on_complete=self._checkpoint_complete)
        self.fpt = flops_per_token(arch, cfg.train.seq_len)
        self.tokens_per_step = self.plan.global_batch_size * cfg.train.seq_len
        self.group = shard_group(p for g in self.optimizer.param_groups for p in g["params"])

        # --- resume: the newest checkpoint that loads (older ones if newer are corrupt)
        self.start_step, restored = 1, None
        if self.resume:
            try:
                restored = self.ckpt.load_latest_valid(model, self.optimizer, self.scheduler,
                                                       position=self.position, guard=self.guard)
            except CheckpointError as e:
                raise CheckpointError(e.path, f"{e.problem}; --restart moves the run aside "
                                              "and starts again", e.detail) from None
            except BaseException as e:     # noqa: BLE001 - a signal inside the load
                self._log_early_fault(e)
                raise
            if restored is None:   # killed before its first checkpoint completed?
                _rank0_call(rank, lambda: _never_checkpointed(out, self.ckpt.root))
                if rank == 0:
                    _warn(f"{self.ckpt.root}: no complete checkpoint (killed before the first "
                          "one completed?); --resume starts again from step 0")
            else:
                self.start_step = restored[0] + 1
                if cfg.train.num_steps < restored[0]:
                    raise ConfigError(f"train.num_steps: {cfg.train.num_steps} is below step "
                                      f"{restored[0]} of the checkpoint resumed from "
                                      f"({restored[1]}): nothing to train; raise "
                                      "train.num_steps (nothing was changed)")
        elif self.replay_from is not None:
            restored = self._load_replay_source(cfg, model, specs, arch.num_layers)
            self.start_step = restored[0] + 1

        # --- run directory (rank 0): rows after the resumed checkpoint are truncated
        meta = {"architecture": asdict(arch), "num_params": num_params(arch),
                "flops_per_token": self.fpt, "world_size": world,
                "batch_plan": asdict(self.plan)}
        if self.replay_from is not None:
            meta["replay_of"] = {"checkpoint": str(self.replay_from), "step": restored[0]}

        def open_writer():
            if self.resume:
                return RunWriter(out, backend="torch",
                                 resume_from_step=0 if restored is None else restored[0],
                                 flush_every_s=cfg.telemetry.flush_every_s, lock=self.lock)
            return RunWriter(out, backend="torch", config=to_dict(cfg), extra_meta=meta,
                             env=environment(**devices.environment_info(info, world)),
                             flush_every_s=cfg.telemetry.flush_every_s)   # takes the lock

        self.writer = _rank0_call(rank, open_writer)
        if rank != 0:
            return
        writer = self.writer
        if self.resume:
            changed = _changed_keys(writer.meta.get("config", {}), to_dict(cfg))
            if changed:  # e.g. a longer train.num_steps; recorded, not refused
                warnings.warn(f"resuming with changed config keys: {', '.join(changed)}",
                              stacklevel=1)
                writer.event("config_changed", step=self.start_step - 1, keys=changed,
                             config=to_dict(cfg))
            if restored is not None:
                self._log_rejected(restored[3], restored[1])
            if writer.repaired_events_tail:
                _warn(f"{out / 'events.jsonl'}: its last line was torn "
                      f"({writer.repaired_events_tail} bytes); moved to events.discarded.jsonl")
        if cfg.telemetry.tensorboard:
            self.tb = TensorBoardScalars(out / "tensorboard")
        if cfg.telemetry.wandb:
            self.wb = WandbScalars(str(out), asked_by="telemetry.wandb = true",
                                   config=to_dict(cfg))
        if self.replay_from is not None:
            writer.event("replay_from", step=restored[0], checkpoint=str(self.replay_from))
        writer.event("start", step=self.start_step, world_size=world, device=info.name,
                     resumed_from=None if restored is None else str(restored[1]))

    def _load_replay_source(self, cfg: RunConfig, model, specs, num_layers: int):
        """Load checkpoint self.replay_from under its own run's config, then hand its state
        to this cfg's optimizer and scheduler (see __init__). Returns (step, path, extra,
        rejected) like CheckpointManager.load_latest_valid."""
        path = self.replay_from
        src_run = path.parent.parent
        try:
            src_cfg = RunConfig.from_dict(flatten(read_meta(src_run)["config"]))
        except (OSError, KeyError, ValueError, RunFormatError) as e:
            raise CheckpointError(path, f"--replay-from: no readable run.json in {src_run} "
                                        f"({e})") from None
        if to_dict(src_cfg.model) != to_dict(cfg.model):
            raise ConfigError("--replay-from: model.* differs from the checkpoint's run")
        src_plan = mitigations.plan(src_cfg, {n: s.depth for n, s in specs.items()}, num_layers)
        src_opt = build_optimizer(model, src_cfg.optim, src_plan)
        src_sched = build_scheduler(src_opt, src_cfg.optim, src_cfg.train.num_steps)
        extra = load(path, model, src_opt, src_sched, position=self.position, guard=None)
        for group in src_opt.param_groups:
            for p in group["params"]:
                if p in src_opt.state:
                    self.optimizer.state[p] = src_opt.state[p]
        with warnings.catch_warnings():   # scheduler steps without optimizer steps: intended
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(int(src_sched.last_epoch)):
                self.scheduler.step()
        return int(extra["step"]), path, extra, []

    # ------------------------------------------------------------------------- the loop
    def run(self) -> int:
        cfg, rank = self.cfg, self.rank
        num_steps = cfg.train.num_steps
        progress = _progress(rank, num_steps, self.start_step - 1)
        step, ok = self.start_step, False
        try:
            while step <= num_steps:
                self._inject_before(step)
                t0 = time.perf_counter()
                lr = self.scheduler.get_last_lr()[0]
                if is_skipped(step, cfg):           # data.skip_batches: measured, not trained
                    self._skip_step(step, lr, t0)
                else:
                    loss = self._forward_backward(step, cfg)
                    self._inject_after_backward(step)
                    grad_norm, clipped = clip_gradients(self.model.parameters(),
                                                        cfg.optim.grad_clip * cfg.train.loss_scale)
                    decision = self._judge(step, loss)   # before the update is applied
                    if decision.action == "rollback":
                        step = self._rollback(step)
                        progress.reset(total=num_steps)
                        progress.update(step - 1)
                        continue
                    self._update_and_log(step, lr, loss, grad_norm, clipped, t0)
                    progress.set_postfix(loss=f"{loss:.4f}", refresh=False)
                kill_point("step", step)
                self._inject_kill(step)
                self._checkpoint_if_due(step)
                step += 1
                progress.update(1)
            self.ckpt.finalize_pending()
            if rank == 0:
                self.writer.event("end", step=num_steps)
            ok = True
        except TrainingAborted as e:
            self.ckpt.close()       # an async save in flight: its "checkpoint" event first
            if rank == 0 and not e.logged:
                self.writer.event("abort", step=step, reason=str(e))
            raise
        except USER_ERRORS as e:
            self.ckpt.close()
            if rank == 0:
                self.writer.event("abort", step=step, reason=str(e))
            raise
        except BaseException as e:
            try:
                reason = _stop_reason(e)
            except Interrupted as i:    # a signal handled on the way in
                reason = _stop_reason(i)
            if isinstance(reason, Interrupted):
                reason.step = step
            # An async save still in flight completes (its "checkpoint" event) or fails
            # before the fault is logged: a stopping rank's last event is why it stopped
            # (a save completed at close() used to log its event after the fault). It
            # waits at most dist.timeout_s for a dead peer (the save's gloo group).
            self.ckpt.close()
            if rank == 0:
                self._log_fault(step, reason)
            if reason is not e:
                raise reason
            raise
        finally:
            progress.close()
            if not ok:
                self.ckpt.close()       # completes an async save still in flight
            if rank == 0:
                try:
                    self.writer.close()     # flushes, releases the run directory
                except Exception:  # noqa: BLE001 - a full disk: the failure that got here counts
                    if ok:
                        raise
                if self.tb is not None:
                    self.tb.close()
                if self.wb is not None:
                    self.wb.close()
        return 0

    # ------------------------------------------------------------------------- steps
    def _forward_backward(self, step: int, cfg: RunConfig) -> float:
        """Gradients of loss_scale * loss over this rank's micro-batches (accumulated in
        p.grad); returns the unscaled loss averaged over the global batch."""
        micro = local_batch(self.source, step, cfg, self.rank, self.world,
                            offset=self.position.offset)
        loss_sum = torch.zeros((), device=self.device)
        for mb in micro:
            loss = loss_terms(self.model(mb.inputs.to(self.device)),
                              mb.targets.to(self.device), cfg.train.z_loss)
            (loss * (cfg.train.loss_scale / len(micro))).backward()
            loss_sum += loss.detach()
        return _mean_over_ranks(loss_sum / len(micro))

    def _skip_step(self, step: int, lr: float, t0: float) -> None:
        """data.skip_batches: forward/backward for loss and grad_norm, logged skipped=True; no
        update (parameters, Adam state and its step count untouched); the lr schedule
        advances (as simulate/llama_train.py)."""
        measure = replace(self.cfg, data=replace(self.cfg.data, skip_batches=[]))
        loss = self._forward_backward(step, measure)
        grad_norm, _ = clip_gradients(self.model.parameters(), 0.0)   # norm only
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.position.step = step
        if self.rank == 0:
            self.writer.log_step(step=step, tokens=step * self.tokens_per_step, loss=loss, lr=lr,
                                 grad_norm=grad_norm, clipped=False, update_norm=0.0,
                                 step_time_s=time.perf_counter() - t0, skipped=True)
            self.writer.event("skip", step=step, reason="data.skip_batches", loss=loss)

    def _judge(self, step: int, loss: float):
        """The spike guard's decision on this loss; raises TrainingAborted to stop."""
        decision = self.guard.observe(step, loss)
        if decision.action == "abort":
            self.ckpt.close()   # an async save in flight: its "checkpoint" event first
        if self.rank == 0:
            for kind, fields in decision.events:
                self.writer.event(kind, **fields)
        if decision.action == "ok" and not math.isfinite(loss):
            raise TrainingAborted(f"non-finite loss {loss} at step {step} (set "
                                  "guard.enabled = true to roll back instead)")
        if decision.action == "abort":
            done = complete(self.ckpt.root)
            good = [p for s, p in done if s not in self._reproduced]
            kept = (f"; last good checkpoint: {good[-1]}" if good else
                    f"; newest checkpoint: {done[-1][1]} (the fault recurred after rolling "
                    "back to it)" if done else "")
            raise TrainingAborted(f"the spike guard gave up: {decision.reason}{kept}",
                                  logged=True)
        return decision

    def _update_and_log(self, step: int, lr: float, loss: float, grad_norm: float,
                        clipped: bool, t0: float) -> None:
        """the registry's mitigations -> telemetry.before_step -> optimizer.step ->
        telemetry.after_step (+ vhists on histogram steps), then the steps row, layers +
        hists + vhists, alarms (rank 0)."""
        info, world = self.info, self.world
        apply_mitigations(self.optimizer, self.mit, step, lr)   # the registry's plan
        if self.telemetry is not None:
            self.telemetry.before_step(step)
        before = [_local(p).detach().clone() for p in self.model.parameters()]
        self.optimizer.step()
        stats = self.telemetry.after_step(step) if self.telemetry is not None else None
        vhists = telemetry_vhists(self.telemetry, step) if self.telemetry is not None else None
        update_norm = _update_norm(self.model, before, self.group)
        del before
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.position.step = step
        devices.synchronize(info)
        dt = time.perf_counter() - t0
        if self.rank != 0:
            return
        tps = self.tokens_per_step
        row = dict(step=step, tokens=step * tps, loss=loss, lr=lr, grad_norm=grad_norm,
                   clipped=clipped, update_norm=update_norm, step_time_s=dt, skipped=False,
                   tokens_per_s=tps / dt)
        row["mfu"] = devices.mfu(tps / dt / world, self.fpt, info)
        mem = devices.memory_stats(info)
        if mem is not None:
            row["peak_mem_gb"] = mem["peak_bytes"] / 2**30
        self.writer.log_step(**row)
        if stats is not None:
            self.telemetry.write(self.writer, stats)
            if self.alarms is not None:
                self.alarms.log(self.writer, step, stats.columns)
        if vhists is not None:
            write_vhists(self.telemetry, self.writer, step, vhists)
        if self.tb is not None:
            self.tb.log(step, row, stats)
        if self.wb is not None:
            self.wb.log(step, stats.columns if stats is not None else None, row)

    # ------------------------------------------------------------------------- recovery
    def _checkpoint_if_due(self, step: int) -> None:
        """Every checkpoint.every steps and at the last: rows <= step are made durable first
        (rank 0's flush), then the collective save. A non-finite state is refused (nothing
        written): the run stops (exit 3) unless the guard is on and steps remain (its next
        judged loss is non-finite and rolls back)."""
        cfg = self.cfg
        every, last = cfg.checkpoint.every, cfg.train.num_steps
        if not ((every and step % every == 0) or step == last):
            return
        if self.rank == 0:
            self.writer.flush()
        try:
            self.ckpt.save(step, self.model, self.optimizer, self.scheduler,
                           extra={"tokens": step * self.tokens_per_step},
                           position=self.position, guard=self.guard)
        except NonFiniteError as e:
            if self.rank == 0:
                self.writer.event("checkpoint_refused", **e.payload)
            if step == last or not cfg.guard.enabled:
                raise TrainingAborted(f"non-finite model/optimizer state at step {step}: "
                                      f"{e.problem}") from None
            if self.rank == 0:
                _warn(f"{e}; the guard rolls back on the next non-finite loss")
            return

    def _checkpoint_complete(self, step: int, path: Path) -> None:
        """CheckpointManager's on_complete: the "checkpoint" event is logged only once the
        checkpoint is on disk (an async save that fails later never claims one)."""
        self._rollback_target = None
        if self.rank == 0 and self.writer is not None:
            self.writer.event("checkpoint", step=step, path=str(path),
                              async_save=self.cfg.checkpoint.async_save)

    def _rollback(self, step: int) -> int:
        """Drop the spike step's gradients, restore the newest checkpoint before `step`, skip
        batches; returns the next step.

        A fault that recurs in the same incident before a newer checkpoint is saved came
        back from the checkpoint restored last: it may hold damaged state that loads (e.g.
        verified against hashes taken after the damage), so the retry steps back to the
        checkpoint before it; with none older, it retries the same one."""
        self.optimizer.zero_grad(set_to_none=True)
        before, suspect = step, None
        if self.guard.retries > 1 and self._rollback_target is not None:
            suspect = self._rollback_target
            self._reproduced.add(suspect)
            before = suspect
        def restore(before_step: int):
            return self.ckpt.load_latest_valid(self.model, self.optimizer, self.scheduler,
                                               before_step=before_step, restore_rng=False)

        found = restore(before)
        if found is None and suspect is not None:
            found = restore(suspect + 1)
        if found is None:
            raise TrainingAborted(f"loss spike at step {step} but no checkpoint before it to "
                                  "roll back to (set checkpoint.every)")
        target, path, extra, rejected = found
        if suspect is not None and target != suspect and self.rank == 0:
            _warn(f"the fault at step {step} recurred after rolling back to checkpoint "
                  f"{suspect}; stepping back to {path}")
        self._rollback_target = target
        plan = self.guard.rollback(step, extra, offset_now=self.position.offset)
        self.position.load_state_dict(plan.position)
        if self.rank == 0:
            self.writer.rewind(target)      # live readers: the run as of the checkpoint
            self._log_rejected(rejected, path)
            for kind, fields in plan.events:
                if kind == "rollback" and suspect is not None:
                    fields = {**fields, "reproduced_from": suspect}
                self.writer.event(kind, **fields, checkpoint=str(path))
        return plan.resume_step

    def _log_early_fault(self, e: BaseException) -> None:
        """Rank 0: the "fault" event of a signal that stops the process before its run
        writer is open (inside the resume's checkpoint load)."""
        try:
            reason = _stop_reason(e)
        except Interrupted as i:        # a signal handled on the way in
            reason = _stop_reason(i)
        if self.rank == 0 and isinstance(reason, Interrupted):
            self._log_fault(None, reason, during=" during the resume's checkpoint load")

    def _log_fault(self, step: int | None, e: BaseException, during: str = "") -> None:
        """The "fault" event of a failure (best effort: on a full disk it may not fit);
        before the run writer is open, appended straight to the run's events
        (adamspike.rundir.append_event; the lock is this process's)."""
        if isinstance(e, Interrupted):
            fields = {"error": f"interrupted by {e}{during}", "signal": str(e)}
            if e.rank is not None:      # learned from the peer rank that received it
                fields.update(error=f"interrupted by {e} (on rank {e.rank}){during}", rank=e.rank)
        else:
            err = storage_error(e) or _disk_full(self.out)
            fields = {"error": (f"storage: {describe_storage_error(err)}" if err is not None
                                else f"{type(e).__name__}: {e}")[:2000]}
        try:
            if self.writer is not None:
                self.writer.event("fault", step=step, **fields)
            else:
                append_event(self.out, "fault", step=step, **fields)
        except OSError:
            pass

    def _log_rejected(self, rejected: list, used: Path) -> None:
        """Rank 0: one stderr line and one event (with the full detail) per checkpoint that
        did not load."""
        for e in rejected:
            _warn(f"{e}; falling back to {used}")
            self.writer.event("checkpoint_rejected", path=e.path, problem=e.problem,
                              detail=e.detail or None, used=str(used))

    # ------------------------------------------------------------------------- faults
    # Each injected fault fires once per launch (a transient fault): the steps re-run
    # after a rollback are clean, as they would be after a real hardware glitch.
    def _once(self, kind: str, step: int) -> bool:
        if (kind, step) in self._fired:
            return False
        self._fired.add((kind, step))
        return True

    def _inject_before(self, step: int) -> None:
        f = self.cfg.faults
        if f.hang_rank_at_step == [self.rank, step] and self._once("hang", step):
            self._fault_event("hang", step, rank=self.rank, seconds=f.hang_s)
            time.sleep(f.hang_s)

    def _inject_after_backward(self, step: int) -> None:
        if step in self.cfg.faults.nan_grad_at_step and self._once("nan_grad", step):
            for p in self.model.parameters():
                if p.grad is not None:
                    _local(p.grad).fill_(math.nan)
            self._fault_event("nan_grad", step)

    def _inject_kill(self, step: int) -> None:
        f = self.cfg.faults
        if f.kill_rank_at_step == [self.rank, step] and not self.resume:
            self._fault_event("kill", step, rank=self.rank)
            if self.rank == 0:
                self.writer.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def _fault_event(self, kind: str, step: int, **fields) -> None:
        if self.writer is not None:
            self.writer.event("fault_injected", step=step, fault=kind, **fields)
        else:   # another rank: say so where the user looks
            print(f"adamspike train: rank {self.rank}: injected fault {kind!r} at step {step}",
                  file=sys.stderr)


def _never_checkpointed(out: Path, ckpt_root: Path) -> None:
    """--resume without a complete checkpoint starts again from step 0 only if the run
    never completed one (no "checkpoint" or "end" event): rows of a run whose checkpoints
    were deleted are not thrown away."""
    events, _ = read_events(out)
    if events["type"].isin(["checkpoint", "end"]).any():
        raise CheckpointError(ckpt_root, "no complete checkpoint to resume from (the run "
                                         "completed some: were they deleted?); --restart "
                                         "moves the run aside and starts again")


def _changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    keys = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += _changed_keys(a, b, prefix + k + ".")
        elif a != b:
            keys.append(prefix + k)
    return keys


def _warn(message: str) -> None:
    """One stderr line, on a line of its own while the progress bar is drawn."""
    tqdm.write(f"adamspike train: warning: {message}", file=sys.stderr)


def _progress(rank: int, total: int, initial: int):
    return tqdm(total=total, initial=initial, disable=rank != 0, file=sys.stderr,
                desc="train", unit="step", mininterval=2.0)


@torch.no_grad()
def _update_norm(model, before, group) -> float:
    """||p_after - p_before||_2 over all (sharded) parameters."""
    after = [_local(p).detach() for p in model.parameters()]
    torch._foreach_sub_(before, after)
    sq = torch.stack([n.double() ** 2 for n in torch._foreach_norm(before)]).sum()
    if group is not None:
        dist.all_reduce(sq, group=group)
    return float(sq.sqrt())


if __name__ == "__main__":
    sys.exit(main())
