"""The spike guard's decision rule, shared by the torch trainer (fullscale.guard) and the JAX
trainer (simulate.guard); the detector is the project's one spike rule (adamspike.spikes,
which analysis runs offline). How a rollback restores state (on-disk checkpoints vs
in-memory snapshots) is each trainer's own.

Detector: `adamspike.spikes.RollingSpikeDetector` with `SpikeParams.from_config(guard)`
(guard.window, guard.mad_k, guard.min_rel_jump).

Policy (`GuardPolicy.observe(step, loss) -> Decision`):
- "ok": normal (the loss joins the detector's history), or a spike while guard.enabled is
  false (then the "spike" event is still reported).
- "rollback": spike or non-finite loss, and fewer than `max_retries` rollbacks in the
  current incident (an incident ends once `window` consecutive normal steps follow its last
  rollback).
- "abort": a spike after `max_retries` rollbacks of one incident (or with max_retries = 0).
Events, in order: "spike" (or "nonfinite_loss") and, on abort, "abort".

Baseline across a rollback: the detector's history at the first spike of an incident (the
pre-incident baseline) is kept and restored after every rollback of that incident
(`restore_baseline()`), instead of the history saved with the checkpoint rolled back to.
A checkpoint's history can be too short to judge (fewer than min_history values) or
already include slowly rising losses; judged against it, persistently poisoned batches
would pass as normal, enter the history and the run would train on them. Against the
pre-incident baseline they keep spiking, and after `max_retries` rollbacks the guard gives
up.

References: PaLM (Chowdhery et al., 2022, sec. 5.1): restart ~100 steps before a spike and
skip 200-500 batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from adamspike.spikes import MAD_TO_SIGMA, RollingSpikeDetector, SpikeParams

__all__ = ["MAD_TO_SIGMA", "Decision", "GuardPolicy", "RollingSpikeDetector"]


@dataclass
class Decision:
    action: str                 # "ok" | "rollback" | "abort"
    reason: str
    stats: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    spiked: bool = False        # the detector fired (also when the guard is disabled)


class GuardPolicy:
    """Detection, bounded retries, abort; the pre-incident baseline across rollbacks."""

    def __init__(self, cfg: Any):
        """cfg: adamspike.train_config.GuardSection (enabled, window, mad_k, min_rel_jump,
        skip_batches, max_retries)."""
        self.cfg = cfg
        self.detector = SpikeParams.from_config(cfg).detector()
        self.retries = 0                # rollbacks in the current incident
        self.num_rollbacks = 0          # over the whole run
        self.ok_since_rollback = 0      # consecutive normal steps after the last rollback
        self.last_spike_step: int | None = None
        self.baseline_state: dict[str, Any] | None = None   # detector at the incident's start

    def observe(self, step: int, loss: float) -> Decision:
        """Judge the loss of optimizer step `step`, before its update is applied."""
        loss = float(loss)
        before = self.detector.state_dict() if self.baseline_state is None else None
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
                    self.baseline_state = None
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
        if self.baseline_state is None:     # first spike of an incident
            self.baseline_state = before
        self.retries += 1
        self.num_rollbacks += 1
        self.ok_since_rollback = 0
        return Decision("rollback", f"{what} at step {step} (rollback {self.retries} of at most "
                                    f"{self.cfg.max_retries})", stats, [spike_event], spiked=True)

    def restore_baseline(self) -> None:
        """After a rollback: the detector's history is the pre-incident one again (the
        losses judged normal after it on the abandoned trajectory are dropped)."""
        if self.baseline_state is not None:
            self.detector.load_state_dict(self.baseline_state)

    # -- state (checkpoints / resume) ----------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"detector": self.detector.state_dict(), "retries": self.retries,
                "num_rollbacks": self.num_rollbacks, "ok_since_rollback": self.ok_since_rollback,
                "last_spike_step": self.last_spike_step, "baseline": self.baseline_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Full restore (resume of a killed run): history, counters, incident baseline."""
        self.detector.load_state_dict(state["detector"])
        self.retries = int(state.get("retries", 0))
        self.num_rollbacks = int(state.get("num_rollbacks", 0))
        self.ok_since_rollback = int(state.get("ok_since_rollback", 0))
        last = state.get("last_spike_step")
        self.last_spike_step = None if last is None else int(last)
        base = state.get("baseline")
        if base is not None:
            self.detector.fresh().load_state_dict(base)  # checks it
        self.baseline_state = base
