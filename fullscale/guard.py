"""Spike guard: detect a loss spike online, roll back to the last good checkpoint and skip
the offending window of batches (PaLM), with bounded retries.

Detection is THE project rule, `adamspike.guard.RollingSpikeDetector` (stdlib only):
with med and MAD the median and median absolute deviation of the past `guard.window`
normal losses, step t spikes when

    loss_t > med + mad_k * 1.4826 * MAD    and    loss_t > (1 + min_rel_jump) * med

once min(window, max(5, window // 2)) losses are in the history; a non-finite loss always
triggers. Spiking losses do not enter the history.

Policy per observed loss (`observe(step, loss) -> Decision`, adamspike.guard.GuardPolicy,
shared with the JAX trainer's simulate.guard):
- "ok": normal; the loss joins the history.
- "rollback": spike or non-finite loss, and fewer than `max_retries` rollbacks in the
  current incident. The trainer then restores the newest checkpoint with step < the spike
  step and calls `rollback(...)`, which restores the detector's pre-incident history (not
  the checkpoint's; adamspike.guard explains why; retry counters are kept) and returns the
  new data position: the offset grows
  by max(guard.skip_batches, batches read since the checkpoint) so the spike batch and
  those after it are never read again (PaLM: restart ~100 steps back, skip 200-500 batches).
- "abort": a spike after `max_retries` rollbacks of the same incident (an incident ends once
  `window` consecutive normal steps follow its last rollback), or max_retries = 0.

Every action comes with the event payloads the trainer logs, in order: "spike" (or
"nonfinite_loss") -> "rollback" -> "skip_batches", or "abort".

Trainer sketch:

    d = guard.observe(step, loss)
    if d.action != "ok":
        for type, fields in d.events: writer.event(type, **fields)
        if d.action == "abort": raise SystemExit(...)
        optimizer.zero_grad(set_to_none=True)
        found = ckpt.load_latest_valid(model, optimizer, scheduler,  # a CheckpointManager
                                       before_step=step)   # None -> abort; no guard=
        plan = guard.rollback(step, found[2], offset_now=position.offset)
        position.load_state_dict(plan.position)
        for type, fields in plan.events: writer.event(type, **fields)
        # continue the loop at plan.resume_step
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from adamspike.guard import Decision, GuardPolicy

__all__ = ["Decision", "RollbackPlan", "SpikeGuard"]


@dataclass
class RollbackPlan:
    resume_step: int            # first step to run after the rollback (checkpoint step + 1)
    position: dict[str, int]    # fullscale.sampler.DataPosition state to load
    num_skipped: int            # batches skipped
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


class SpikeGuard(GuardPolicy):
    """adamspike.guard.GuardPolicy (detection, retries, abort, state) + rollback to an
    on-disk checkpoint."""

    # -- recovery -----------------------------------------------------------------
    def rollback(self, spike_step: int, checkpoint_extra: dict[str, Any],
                 offset_now: int) -> RollbackPlan:
        """After restoring the checkpoint (whose `load()` returned `checkpoint_extra`: step,
        position): restore the pre-incident loss history, keep the retry counters, and
        return where the data continues.

        Batches read since the checkpoint: (spike_step + offset_now) - (ckpt_step + ckpt_offset);
        skipped: max(guard.skip_batches, that), so the spike batch is always skipped."""
        ckpt_step = int(checkpoint_extra["step"])
        pos = checkpoint_extra.get("position") or {"step": ckpt_step, "offset": 0}
        ckpt_offset = int(pos["offset"])
        if ckpt_step >= spike_step:
            raise ValueError(f"rollback target step {ckpt_step} is not before the spike step "
                             f"{spike_step}")
        self.restore_baseline()
        seen = (int(spike_step) + int(offset_now)) - (ckpt_step + ckpt_offset)
        num_skipped = max(int(self.cfg.skip_batches), seen)
        new_offset = ckpt_offset + num_skipped
        first_batch = ckpt_step + 1 + ckpt_offset
        events = [("rollback", {"step": int(spike_step), "from_step": int(spike_step),
                                "to_step": ckpt_step, "retry": self.retries,
                                "max_retries": self.cfg.max_retries}),
                  ("skip_batches", {"step": ckpt_step + 1, "first_batch": first_batch,
                                    "last_batch": first_batch + num_skipped - 1,
                                    "num_batches": num_skipped, "offset_before": ckpt_offset,
                                    "offset_after": new_offset})]
        return RollbackPlan(ckpt_step + 1, {"step": ckpt_step, "offset": new_offset},
                            num_skipped, events)
