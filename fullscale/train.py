"""`adamspike train`: the torch trainer (FSDP2, per-tensor Adam telemetry, spike guard).

    adamspike train --config configs/tiny.toml --out RUN [--resume] [--section.key value ...]
    python -m fullscale.train ...            torchrun --nproc-per-node 8 -m fullscale.train ...

The loop, top to bottom (one optimizer step s = 1..train.num_steps):
    config -> device + process group -> model on meta -> parallelize -> to_empty ->
    init_weights -> AdamW + LambdaLR -> data source -> run directory (rank 0) -> [resume]
    for each step s:
        data.skip_batches hit?      forward/backward for loss and grad_norm, logged with
                                    skipped=True; no update (parameters, Adam state and its
                                    step count untouched), lr schedule advances ("skip" event)
        micro-batches of this rank  (sampler.local_batch: batch s + offset, poison_steps)
        forward / backward          loss_scale * (ce + z_loss * mean(logsumexp^2)) / accum
        loss = mean over the global batch (all-reduced); clip (threshold grad_clip * s)
        guard.observe(s, loss)      spike / non-finite -> roll back to the newest checkpoint
                                    before s, skip a window of batches (PaLM); or abort
        [update clip] -> telemetry.before_step -> optimizer.step -> telemetry.after_step
        steps row, layers + hists (telemetry.every / hist_every), alarms, checkpoint

Interfaces used (all collective where marked in their modules):
- fullscale.device: detect, init_distributed, torch_device, synchronize, mfu, memory_stats
- fullscale.checkpoint: save(root, step, model, optimizer, scheduler, extra, position=,
  guard=, keep=, async_save=), load_latest_valid(root, model, optimizer, scheduler,
  before_step=, position=, guard=) -> (step, path, extra, rejected) | None,
  finalize_pending(); NonFiniteError -> "checkpoint_refused" event
- fullscale.guard: SpikeGuard(cfg.guard).observe(step, loss) -> Decision(action, reason,
  events); rollback(spike_step, extra, offset_now) -> RollbackPlan(resume_step, position)
- fullscale.sampler: batch_plan, local_batch, is_skipped, DataPosition(step, offset)

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

Exit status: 0 done; 2 bad input (config, data, predictions, run directory, checkpoint to
resume); 3 training aborted (guard gave up, non-finite loss with the guard disabled, no
checkpoint to roll back to); 1 unexpected failure (logged as a "fault" event first).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from adamspike import mitigations
from adamspike.config import ConfigError, load_config, to_dict
from adamspike.llama import flops_per_token, num_params, spec_by_name
from adamspike.predictions import PredictionsError
from adamspike.rundir import RunFormatError, RunWriter, environment
from adamspike.train_config import RunConfig
from fullscale import checkpoint, device as devices
from fullscale.alarms import build_alarms
from fullscale.data import DataFormatError, build_source
from fullscale.guard import SpikeGuard
from fullscale.hf import resolve_model
from fullscale.model import Transformer
from fullscale.optim import apply_mitigations, build_optimizer, build_scheduler, clip_gradients
from fullscale.parallelize import parallelize
from fullscale.sampler import DataPosition, batch_plan, is_skipped, local_batch
from fullscale.telemetry import Telemetry, TensorBoardScalars, shard_group, telemetry_vhists, write_vhists

USER_ERRORS = (ConfigError, DataFormatError, PredictionsError, RunFormatError,
               checkpoint.CheckpointError, devices.DeviceError)


class TrainingAborted(RuntimeError):
    """The run cannot continue (guard gave up, non-finite loss, nothing to roll back to)."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="adamspike train", description=__doc__.split("\n")[0],
                                allow_abbrev=False,
                                epilog="Any --section.key value pair overrides the config.")
    p.add_argument("--config", help="run config TOML (defaults: adamspike.train_config)")
    p.add_argument("--out", required=True, help="run directory (new, or the one to --resume)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest valid checkpoint in OUT/checkpoints")
    return p


# ----------------------------------------------------------------------------- helpers

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
            kinds = {c.__name__: c for c in (RunFormatError, PredictionsError, DataFormatError)}
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


def _local(x):
    return x.to_local() if hasattr(x, "to_local") else x


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, overrides = parser().parse_known_args(argv)
    own_group = finished = False
    try:
        cfg = load_config(RunConfig, args.config, overrides)
        cfg.check()
        own_group = _setup_distributed(cfg)
        rc = train(cfg, Path(args.out), resume=args.resume)
        finished = True
        return rc
    except USER_ERRORS as e:
        print(f"adamspike train: error: {e}", file=sys.stderr)
        return 2
    except TrainingAborted as e:
        print(f"adamspike train: aborted: {e}", file=sys.stderr)
        return 3
    finally:
        if own_group or dist.is_initialized():
            devices.destroy_distributed(synchronize=finished)


def _setup_distributed(cfg: RunConfig) -> bool:
    """Process group from torchrun, or a one-rank group of our own (returns True then)."""
    info = devices.detect(cfg.dist.device, int(os.environ.get("LOCAL_RANK", 0)))
    devices.init_distributed(info, cfg.dist.timeout_s)
    if dist.is_initialized():
        return False
    dist.init_process_group(info.backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def train(cfg: RunConfig, out: Path, *, resume: bool = False) -> int:
    # --- device, model, optimizer ----------------------------------------------------
    rank, world = dist.get_rank(), dist.get_world_size()
    info = devices.detect(cfg.dist.device, int(os.environ.get("LOCAL_RANK", 0)))
    device = devices.torch_device(info)
    if cfg.train.dtype == "bf16" and not info.supports_bf16:
        raise ConfigError(f"train.dtype: bf16 is not supported by {info.name}")
    arch = resolve_model(cfg.model)
    if cfg.train.seq_len > arch.max_seq_len:
        raise ConfigError(f"train.seq_len: {cfg.train.seq_len} exceeds model max_seq_len={arch.max_seq_len}")
    plan = batch_plan(cfg, world)
    if cfg.alarms.predictions and not cfg.telemetry.enabled:
        raise ConfigError("alarms.predictions: the alarm rules read per-tensor telemetry; set "
                          "telemetry.enabled = true")
    torch.manual_seed(cfg.train.seed)
    specs = spec_by_name(arch)
    mit = mitigations.plan(cfg, {n: s.depth for n, s in specs.items()}, arch.num_layers)
    with torch.device("meta"):
        model = Transformer(arch, **mit.model_options)
    parallelize(model, world, activation_checkpointing=cfg.train.activation_checkpointing,
                mixed_precision=cfg.train.dtype, device=device)
    model.to_empty(device=device)
    model.init_weights(_init_generator(cfg.train.seed, device))
    optimizer = build_optimizer(model, cfg.optim, mit)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.num_steps)
    source = build_source(cfg.data, cfg.train.seq_len, arch.vocab_size, cfg.train.seed)
    position, guard = DataPosition(), SpikeGuard(cfg.guard)
    telemetry = (Telemetry(optimizer, spec_by_name(arch), every=cfg.telemetry.every,
                           hist_every=cfg.telemetry.hist_every, precision=cfg.telemetry.precision,
                           compile=cfg.telemetry.compile,
                           explicit_m_prev=mitigations.needs_explicit_m_prev(cfg))
                 if cfg.telemetry.enabled else None)
    alarms = _rank0_call(rank, lambda: build_alarms(cfg.alarms))   # evaluated on rank 0
    ckpt_root = out / "checkpoints"

    # --- run directory and resume ------------------------------------------------------
    start_step, restored = 1, None
    if resume:
        restored = checkpoint.load_latest_valid(ckpt_root, model, optimizer, scheduler,
                                                position=position, guard=guard)
        if restored is None:
            raise checkpoint.CheckpointError(ckpt_root, "no complete checkpoint to resume from")
        start_step = restored[0] + 1
    fpt = flops_per_token(arch, cfg.train.seq_len)
    meta = {"architecture": asdict(arch), "num_params": num_params(arch), "flops_per_token": fpt,
            "world_size": world, "batch_plan": asdict(plan)}

    def open_writer():
        if resume:
            return RunWriter(out, backend="torch", resume_from_step=restored[0],
                             flush_every_s=cfg.telemetry.flush_every_s)
        return RunWriter(out, backend="torch", config=to_dict(cfg), extra_meta=meta,
                         env=environment(**devices.environment_info(info, world)),
                         flush_every_s=cfg.telemetry.flush_every_s)

    writer = _rank0_call(rank, open_writer)
    if rank == 0 and resume:
        changed = _changed_keys(writer.meta.get("config", {}), to_dict(cfg))
        if changed:  # e.g. a longer train.num_steps; recorded, not refused
            warnings.warn(f"resuming with changed config keys: {', '.join(changed)}", stacklevel=1)
            writer.event("config_changed", step=start_step - 1, keys=changed,
                         config=to_dict(cfg))
    tb = TensorBoardScalars(out / "tensorboard") if rank == 0 and cfg.telemetry.tensorboard else None
    if rank == 0:
        if restored is not None:
            for e in restored[3]:
                writer.event("checkpoint_rejected", path=e.path, problem=e.problem)
        writer.event("start", step=start_step, world_size=world, device=info.name,
                     resumed_from=None if restored is None else str(restored[1]))

    # --- the loop ------------------------------------------------------------------------
    scale, num_steps = cfg.train.loss_scale, cfg.train.num_steps
    # skipped steps still read and measure their batch (as simulate/llama_train.py)
    cfg_measure = replace(cfg, data=replace(cfg.data, skip_batches=[]))
    tokens_per_step = plan.global_batch_size * cfg.train.seq_len
    group = shard_group(p for g in optimizer.param_groups for p in g["params"])
    progress = _progress(rank, num_steps, start_step - 1)
    step = start_step
    try:
        while step <= num_steps:
            t0 = time.perf_counter()
            lr = scheduler.get_last_lr()[0]
            if is_skipped(step, cfg):  # data.skip_batches: measured, not trained on
                loss = _forward_backward(model, source, step, cfg_measure, rank, world,
                                         position.offset, device)
                grad_norm, _ = clip_gradients(model.parameters(), 0.0)   # norm only
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                position.step = step
                if rank == 0:
                    writer.log_step(step=step, tokens=step * tokens_per_step, loss=loss, lr=lr,
                                    grad_norm=grad_norm, clipped=False, update_norm=0.0,
                                    step_time_s=time.perf_counter() - t0, skipped=True)
                    writer.event("skip", step=step, reason="data.skip_batches", loss=loss)
                _maybe_checkpoint(cfg, step, ckpt_root, model, optimizer, scheduler, position,
                                  guard, writer, rank)
                step += 1
                progress.update(1)
                continue

            loss = _forward_backward(model, source, step, cfg, rank, world, position.offset, device)
            grad_norm, clipped = clip_gradients(model.parameters(), cfg.optim.grad_clip * scale)

            # spike guard: judge the loss before its update is applied
            decision = guard.observe(step, loss)
            if rank == 0:
                for kind, fields in decision.events:
                    writer.event(kind, **fields)
            if decision.action == "ok" and not math.isfinite(loss):
                raise TrainingAborted(f"non-finite loss {loss} at step {step} (set "
                                      "guard.enabled = true to roll back instead)")
            if decision.action == "abort":
                raise TrainingAborted(decision.reason)
            if decision.action == "rollback":
                optimizer.zero_grad(set_to_none=True)
                step = _rollback(step, ckpt_root, model, optimizer, scheduler, position, guard,
                                 writer, rank)
                progress.reset(total=num_steps)
                progress.update(step - 1)
                continue

            # optimizer step, telemetry
            apply_mitigations(optimizer, mit, step, lr)   # the registry's plan
            if telemetry is not None:
                telemetry.before_step(step)
            before = [_local(p).detach().clone() for p in model.parameters()]
            optimizer.step()
            stats = telemetry.after_step(step) if telemetry is not None else None
            vhists = telemetry_vhists(telemetry, step) if telemetry is not None else None
            update_norm = _update_norm(model, before, group)
            del before
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            position.step = step
            devices.synchronize(info)
            dt = time.perf_counter() - t0

            # logging, alarms, checkpoint
            if rank == 0:
                row = dict(step=step, tokens=step * tokens_per_step, loss=loss, lr=lr,
                           grad_norm=grad_norm, clipped=clipped, update_norm=update_norm,
                           step_time_s=dt, skipped=False, tokens_per_s=tokens_per_step / dt)
                row["mfu"] = devices.mfu(tokens_per_step / dt / world, fpt, info)
                mem = devices.memory_stats(info)
                if mem is not None:
                    row["peak_mem_gb"] = mem["peak_bytes"] / 2**30
                writer.log_step(**row)
                if stats is not None:
                    telemetry.write(writer, stats)
                    if alarms is not None:
                        alarms.log(writer, step, stats.columns)
                if vhists is not None:
                    write_vhists(telemetry, writer, step, vhists)
                if tb is not None:
                    tb.log(step, row, stats)
                progress.set_postfix(loss=f"{loss:.4f}", refresh=False)
            _maybe_checkpoint(cfg, step, ckpt_root, model, optimizer, scheduler, position,
                              guard, writer, rank)
            step += 1
            progress.update(1)
        checkpoint.finalize_pending()
        if rank == 0:
            writer.event("end", step=num_steps)
    except (TrainingAborted, *USER_ERRORS) as e:
        if rank == 0:
            writer.event("abort", step=step, reason=str(e))
        raise
    except BaseException as e:
        if rank == 0:
            writer.event("fault", step=step, error=f"{type(e).__name__}: {e}")
        raise
    finally:
        progress.close()
        if rank == 0:
            writer.close()
            if tb is not None:
                tb.close()
    return 0


def _changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    keys = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += _changed_keys(a, b, prefix + k + ".")
        elif a != b:
            keys.append(prefix + k)
    return keys


def _forward_backward(model, source, step, cfg, rank, world, offset, device) -> float:
    """Gradients of loss_scale * loss over this rank's micro-batches (accumulated in
    p.grad); returns the unscaled loss averaged over the global batch."""
    micro = local_batch(source, step, cfg, rank, world, offset=offset)
    loss_sum = torch.zeros((), device=device)
    for mb in micro:
        loss = loss_terms(model(mb.inputs.to(device)), mb.targets.to(device), cfg.train.z_loss)
        (loss * (cfg.train.loss_scale / len(micro))).backward()
        loss_sum += loss.detach()
    return _mean_over_ranks(loss_sum / len(micro))


def _progress(rank: int, total: int, initial: int):
    from tqdm import tqdm

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


def _maybe_checkpoint(cfg, step, root, model, optimizer, scheduler, position, guard, writer,
                      rank) -> None:
    every = cfg.checkpoint.every
    if not ((every and step % every == 0) or step == cfg.train.num_steps):
        return
    try:
        path = checkpoint.save(root, step, model, optimizer, scheduler,
                               extra={"tokens": step * cfg.train.global_batch_size * cfg.train.seq_len},
                               position=position, guard=guard, keep=cfg.checkpoint.keep,
                               async_save=cfg.checkpoint.async_save)
    except checkpoint.NonFiniteError as e:
        if rank == 0:
            writer.event("checkpoint_refused", **e.payload)
        return
    if rank == 0:
        writer.event("checkpoint", step=step, path=str(path), async_save=cfg.checkpoint.async_save)


def _rollback(step, root, model, optimizer, scheduler, position, guard, writer, rank) -> int:
    """Restore the newest checkpoint before `step`, skip batches; returns the next step."""
    found = checkpoint.load_latest_valid(root, model, optimizer, scheduler, before_step=step,
                                         restore_rng=False)
    if found is None:
        raise TrainingAborted(f"loss spike at step {step} but no checkpoint before it to roll "
                              "back to (set checkpoint.every)")
    ckpt_step, path, extra, rejected = found
    plan = guard.rollback(step, extra, offset_now=position.offset)
    position.load_state_dict(plan.position)
    if rank == 0:
        for e in rejected:
            writer.event("checkpoint_rejected", path=e.path, problem=e.problem)
        for kind, fields in plan.events:
            writer.event(kind, **fields, checkpoint=str(path))
    return plan.resume_step


if __name__ == "__main__":
    sys.exit(main())
