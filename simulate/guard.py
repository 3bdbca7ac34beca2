"""PaLM-style spike guard of the JAX trainer: in-memory snapshots, rollback, batch skipping.

The policy is the torch trainer's (adamspike.guard.GuardPolicy, which
fullscale.guard.SpikeGuard also builds on; simulate does not import fullscale), configured
by the same `guard` section (adamspike.train_config.GuardSection:
enabled, window, mad_k, min_rel_jump, skip_batches, max_retries, same meanings):

- Detection is THE project rule, `adamspike.spikes.RollingSpikeDetector(window, mad_k,
  min_rel_jump)` on the loss of each trained step, judged before its update is applied; a
  non-finite loss always triggers. Spiking losses do not enter the history. Steps listed in
  data.skip_batches are not judged (as in the torch trainer).
- On a spike, with fewer than `max_retries` rollbacks in the current incident: restore the
  last good snapshot (parameters, optimizer state incl. the lr schedule, the data offset),
  keep the detector's pre-incident history (adamspike.guard), and skip
  max(guard.skip_batches, batches read since the snapshot) batches, so the spike batch and
  those after it are never read again. An incident ends once `window` consecutive normal steps follow its last rollback. A spike
  after `max_retries` rollbacks of one incident (or with max_retries = 0) aborts the run.
- With guard.enabled = false the detector still runs and logs "spike" events (as torch).

Snapshots (where this differs from torch's on-disk checkpoints): the JAX state is an
immutable pytree, so a snapshot is a reference, taken every `checkpoint.every` steps (the
torch trainer's checkpoint interval; the guard requires it > 0) and at step 0 (the initial
state). A snapshot becomes the rollback target only once the loss of its parameters (the
next judged step's loss) is normal, so the state restored is never one already in a spike.

Events (names and fields as fullscale.guard): "spike" (or "nonfinite_loss") -> "rollback"
(step, from_step, to_step, retry, max_retries) -> "skip_batches" (step, first_batch,
last_batch, num_batches, offset_before, offset_after), or "abort" (step, reason).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adamspike.guard import Decision, GuardPolicy

__all__ = ["Decision", "Snapshot", "SnapshotGuard"]


@dataclass
class Snapshot:
    step: int                   # last applied optimizer step (0 = the initial state)
    params: Any
    opt_state: Any
    offset: int                 # data offset: step s reads batch s + offset


class SnapshotGuard(GuardPolicy):
    """adamspike.guard.GuardPolicy (detection, retries, abort, the pre-incident baseline;
    shared with the torch trainer) + in-memory snapshots and rollback."""

    def __init__(self, cfg: Any, every: int, params: Any, opt_state: Any):
        """cfg: GuardSection; every: snapshot interval (checkpoint.every, > 0 when enabled)."""
        super().__init__(cfg)
        self.every = int(every)
        self.good = Snapshot(0, params, opt_state, 0)
        self.candidate: Snapshot | None = None
        self.num_skipped = 0            # batches skipped by rollbacks

    def observe(self, step: int, loss: float) -> Decision:
        """Judge the loss of step `step` before its update is applied; a normal loss also
        confirms the pending snapshot (its parameters gave it) as the rollback target."""
        d = super().observe(step, loss)
        if not d.spiked and self.candidate is not None and self.candidate.step < step:
            self.good, self.candidate = self.candidate, None
        return d

    # -- snapshots ----------------------------------------------------------------
    def after_step(self, step: int, params: Any, opt_state: Any, offset: int) -> None:
        """Step `step` was applied (or skipped by data.skip_batches): snapshot on the grid."""
        if self.cfg.enabled and step % self.every == 0:
            self.candidate = Snapshot(int(step), params, opt_state, int(offset))

    def rollback(self, spike_step: int, offset_now: int) -> tuple[Snapshot, int, list]:
        """Restore the last good snapshot: (snapshot, new data offset, events)."""
        snap = self.good
        self.candidate = None
        self.restore_baseline()
        seen = (int(spike_step) + int(offset_now)) - (snap.step + snap.offset)
        num = max(int(self.cfg.skip_batches), seen)
        new_offset = snap.offset + num
        self.num_skipped += num
        first = snap.step + 1 + snap.offset
        events = [("rollback", {"step": int(spike_step), "from_step": int(spike_step),
                                "to_step": snap.step, "retry": self.retries,
                                "max_retries": self.cfg.max_retries}),
                  ("skip_batches", {"step": snap.step + 1, "first_batch": first,
                                    "last_batch": first + num - 1, "num_batches": num,
                                    "offset_before": snap.offset, "offset_after": new_offset})]
        return snap, new_offset, events
