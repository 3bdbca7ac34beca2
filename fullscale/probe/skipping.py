"""The two things the probe does for the stack where the training loop does not (what the
loop does comes from fullscale.probe.loop, with its upstream sources):

- skip listed iterations (ADAMSPIKE_PROBE_SKIP_ITERATIONS, logged 1-based numbers) on every
  rank: the batch is drawn from the data iterator (as Megatron's dummy_train_step does:
  num_microbatches `next()` on each iterator that is not None, i.e. the ranks that read data)
  and train_step returns "skipped, no update" without a forward / backward pass, so the loop
  counts the iteration and its samples and the lr schedule does not step, as in Megatron's
  own `iterations_to_skip` branch. A loop that skips by itself never calls train_step for
  those iterations, so the probe's list cannot skip twice.
- the rerun state machine's checkpoint-and-exit where the loop ignores train_step's
  should_checkpoint / should_exit (MindSpeed-LLM): save with the loop's own save function at
  the loop's `iteration` (what Megatron's loop passes), then sys.exit(exit_code) as Megatron's
  loop does after it breaks.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Optional

from fullscale.probe.loop import LoopFacts


def num_microbatches(margs) -> int:
    """Micro batches per iteration: megatron's calculator (core >= 0.8, then older
    homes), else global batch / (micro batch x data parallel)."""
    for mod, fn in (("megatron.core.num_microbatches_calculator", "get_num_microbatches"),
                    ("megatron.training.global_vars", "get_num_microbatches"),
                    ("megatron", "get_num_microbatches")):
        m = sys.modules.get(mod)
        if m is not None and callable(getattr(m, fn, None)):
            try:
                return int(getattr(m, fn)())
            except Exception:  # noqa: BLE001 - calculator not initialised: next home
                continue
    gbs = getattr(margs, "global_batch_size", None)
    mbs = getattr(margs, "micro_batch_size", None)
    dp = getattr(margs, "data_parallel_size", None)
    if gbs and mbs and dp:
        return int(gbs) // (int(mbs) * int(dp))
    raise RuntimeError("cannot tell the number of micro batches per iteration "
                       "(no megatron microbatch calculator, no global / micro batch sizes)")


def consume_batch(data_iterator, n: int) -> int:
    """Draw one iteration's micro batches from each iterator (a list with virtual
    pipeline stages); returns how many were drawn."""
    its = data_iterator if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    drawn = 0
    for it in its:
        if it is None:
            continue
        for _ in range(n):
            next(it)
            drawn += 1
    return drawn


def skipped_return(loop: Optional[LoopFacts]):
    """train_step's value for an iteration without an update, in the arity the loop
    unpacks (core_v0.12+ and MindSpeed-LLM: loss dict, skipped, should_checkpoint,
    should_exit, exit_code, grad norm, zeros [, max attention logit: core_v0.16]; before:
    loss dict, skipped, grad norm, zeros)."""
    if loop is not None:
        n = loop.returns
    else:   # the loop's source is unreadable: the rerun machine's presence tells 7 from 4
        try:
            n = 7 if importlib.util.find_spec("megatron.core.rerun_state_machine") else 4
        except (ImportError, ValueError):
            n = 4
    if n < 7:
        return {}, 1, None, None
    return ({}, 1, False, False, 0) + (None,) * (n - 5)


def honour_exit(ret, loop: Optional[LoopFacts], model, optimizer, opt_param_scheduler,
                say=print) -> None:
    """Where the loop ignores them: train_step said should_exit (the rerun state machine,
    agreed over all ranks) -> checkpoint when it asks, then exit with its code."""
    if loop is None or loop.honours_exit or not (isinstance(ret, tuple) and len(ret) >= 7):
        return
    should_checkpoint, should_exit, exit_code = ret[2], ret[3], ret[4]
    if not should_exit:
        return
    frame = loop.frame
    g = frame.f_globals if frame is not None else {}
    loc = frame.f_locals if frame is not None else {}
    if should_checkpoint:
        save = g.get("save_checkpoint_and_time")
        if save is None:
            say("adamspike probe: the rerun state machine asks for a checkpoint before exiting, "
                "but the loop's module has no save_checkpoint_and_time: exiting without it")
        else:
            save(loc.get("iteration"), model, optimizer, opt_param_scheduler,
                 loc.get("num_floating_point_operations_so_far", 0), checkpointing_context=None)
            fin = g.get("maybe_finalize_async_save")
            if callable(fin):
                fin(blocking=True)
    say(f"adamspike probe: the rerun state machine stopped the job (exit code {exit_code}"
        f"{', checkpoint saved' if should_checkpoint else ''}); {loop.name} ignores "
        "should_exit, so the probe exits as Megatron's loop would")
    sys.exit(exit_code)
