"""PaLM-style spike guard of the JAX trainer: in-memory snapshots, rollback, batch skipping.

The policy is the torch trainer's (fullscale.guard.SpikeGuard; simulate does not import
fullscale), configured by the same `guard` section (adamspike.train_config.GuardSection:
enabled, window, mad_k, min_rel_jump, skip_batches, max_retries, same meanings):

- Detection is THE project rule, `analysis.spikes.RollingSpikeDetector(window, mad_k,
  min_rel_jump)` on the loss of each trained step, judged before its update is applied; a
  non-finite loss always triggers. Spiking losses do not enter the history. Steps listed in
  data.skip_batches are not judged (as in the torch trainer).
- On a spike, with fewer than `max_retries` rollbacks in the current incident: restore the
  last good snapshot (parameters, optimizer state incl. the lr schedule, the detector's
  history, the data offset) and skip max(guard.skip_batches, batches read since the
  snapshot) batches, so the spike batch and those after it are never read again. An
  incident ends once `window` consecutive normal steps follow its last rollback. A spike
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

import math
from dataclasses import dataclass, field
from typing import Any

from analysis.spikes import RollingSpikeDetector


@dataclass
class Snapshot:
    step: int                   # last applied optimizer step (0 = the initial state)
    params: Any
    opt_state: Any
    offset: int                 # data offset: step s reads batch s + offset
    detector: dict[str, Any]    # RollingSpikeDetector state after judging `step`


@dataclass
class Decision:
    action: str                 # "ok" | "rollback" | "abort"
    reason: str
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


class SnapshotGuard:
    def __init__(self, cfg: Any, every: int, params: Any, opt_state: Any):
        """cfg: GuardSection; every: snapshot interval (checkpoint.every, > 0 when enabled)."""
        self.cfg = cfg
        self.every = int(every)
        self.detector = RollingSpikeDetector(window=cfg.window, k=cfg.mad_k,
                                             min_rel_jump=cfg.min_rel_jump)
        self.good = Snapshot(0, params, opt_state, 0, self.detector.state_dict())
        self.candidate: Snapshot | None = None
        self.retries = 0                # rollbacks in the current incident
        self.num_rollbacks = 0          # over the whole run
        self.num_skipped = 0            # batches skipped by rollbacks
        self.ok_since_rollback = 0

    # -- detection ----------------------------------------------------------------
    def observe(self, step: int, loss: float) -> Decision:
        """Judge the loss of step `step` before its update is applied."""
        loss = float(loss)
        spiked = self.detector.update(loss)
        if not spiked:
            if self.candidate is not None and self.candidate.step < step:
                self.good, self.candidate = self.candidate, None   # its loss was normal
            if self.retries:
                self.ok_since_rollback += 1
                if self.ok_since_rollback >= self.cfg.window:     # incident over
                    self.retries, self.ok_since_rollback = 0, 0
            return Decision("ok", "")
        stats = {"step": int(step), "loss": loss, "baseline": self.detector.baseline,
                 "threshold": self.detector.threshold,
                 "history": len(self.detector.state_dict()["history"]),
                 "retries": self.retries, "max_retries": self.cfg.max_retries}
        finite = math.isfinite(loss)
        what = ("non-finite loss" if not finite else
                f"loss spike: {loss:.6g} > threshold {self.detector.threshold:.6g} "
                f"(median {self.detector.baseline:.6g})")
        spike_event = ("spike" if finite else "nonfinite_loss", {**stats, "reason": what})
        if not self.cfg.enabled:
            return Decision("ok", f"{what} at step {step} (guard disabled)", [spike_event])
        if self.retries >= self.cfg.max_retries:
            reason = (f"{what} at step {step} after {self.retries} rollback(s) "
                      f"(guard.max_retries = {self.cfg.max_retries})")
            return Decision("abort", reason,
                            [spike_event, ("abort", {"step": int(step), "reason": reason})])
        self.retries += 1
        self.num_rollbacks += 1
        self.ok_since_rollback = 0
        return Decision("rollback", f"{what} at step {step} (rollback {self.retries} of at most "
                                    f"{self.cfg.max_retries})", [spike_event])

    # -- snapshots ----------------------------------------------------------------
    def after_step(self, step: int, params: Any, opt_state: Any, offset: int) -> None:
        """Step `step` was applied (or skipped by data.skip_batches): snapshot on the grid."""
        if self.cfg.enabled and step % self.every == 0:
            self.candidate = Snapshot(int(step), params, opt_state, int(offset),
                                      self.detector.state_dict())

    def rollback(self, spike_step: int, offset_now: int) -> tuple[Snapshot, int, list]:
        """Restore the last good snapshot: (snapshot, new data offset, events)."""
        snap = self.good
        self.candidate = None
        self.detector.load_state_dict(snap.detector)
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
