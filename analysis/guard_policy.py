"""The spike guard's decision rule, shared by the torch trainer (fullscale.guard) and the
JAX trainer (simulate.guard); numpy/stdlib only. How a rollback restores state (on-disk
checkpoints vs in-memory snapshots) is each trainer's own.

Per observed loss, `GuardPolicy.observe(step, loss) -> Decision`:
- "ok": normal (the loss joins the detector's history), or a spike while guard.enabled is
  false (then the "spike" event is still reported).
- "rollback": spike or non-finite loss, and fewer than `max_retries` rollbacks in the
  current incident (an incident ends once `window` consecutive normal steps follow its last
  rollback).
- "abort": a spike after `max_retries` rollbacks of one incident (or with max_retries = 0).
Events, in order: "spike" (or "nonfinite_loss") and, on abort, "abort".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from analysis.spikes import RollingSpikeDetector


@dataclass
class Decision:
    action: str                 # "ok" | "rollback" | "abort"
    reason: str
    stats: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    spiked: bool = False        # the detector fired (also when the guard is disabled)


class GuardPolicy:
    def __init__(self, cfg: Any):
        """cfg: adamspike.train_config.GuardSection (enabled, window, mad_k, min_rel_jump,
        skip_batches, max_retries)."""
        self.cfg = cfg
        self.detector = RollingSpikeDetector(window=cfg.window, k=cfg.mad_k,
                                             min_rel_jump=cfg.min_rel_jump)
        self.retries = 0                # rollbacks in the current incident
        self.num_rollbacks = 0          # over the whole run
        self.ok_since_rollback = 0      # consecutive normal steps after the last rollback
        self.last_spike_step: int | None = None

    def observe(self, step: int, loss: float) -> Decision:
        """Judge the loss of optimizer step `step`, before its update is applied."""
        loss = float(loss)
        spiked = self.detector.update(loss)
        stats = {"step": int(step), "loss": loss, "baseline": self.detector.baseline,
                 "threshold": self.detector.threshold,
                 "history": len(self.detector.state_dict()["history"]),
                 "retries": self.retries, "max_retries": self.cfg.max_retries}
        if not spiked:
            if self.retries:
                self.ok_since_rollback += 1
                if self.ok_since_rollback >= self.cfg.window:   # incident over
                    self.retries, self.ok_since_rollback = 0, 0
            return Decision("ok", "", stats)
        finite = math.isfinite(loss)
        what = ("non-finite loss" if not finite else
                f"loss spike: {loss:.6g} > threshold {self.detector.threshold:.6g} "
                f"(median {self.detector.baseline:.6g})")
        spike_event = ("spike" if finite else "nonfinite_loss", {**stats, "reason": what})
        if not self.cfg.enabled:
            return Decision("ok", f"{what} at step {step} (guard disabled)", stats,
                            [spike_event], spiked=True)
        self.last_spike_step = int(step)
        if self.retries >= self.cfg.max_retries:
            reason = (f"{what} at step {step} after {self.retries} rollback(s) "
                      f"(guard.max_retries = {self.cfg.max_retries})")
            return Decision("abort", reason, stats,
                            [spike_event, ("abort", {"step": int(step), "reason": reason})],
                            spiked=True)
        self.retries += 1
        self.num_rollbacks += 1
        self.ok_since_rollback = 0
        return Decision("rollback", f"{what} at step {step} (rollback {self.retries} of at most "
                                    f"{self.cfg.max_retries})", stats, [spike_event], spiked=True)
