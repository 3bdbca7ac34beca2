"""The spike detector and the spike guard's decision rule, shared by the torch trainer
(fullscale.guard), the JAX trainer (simulate.guard) and analysis (analysis.spikes runs the
same detector offline); stdlib only. How a rollback restores state (on-disk checkpoints vs
in-memory snapshots) is each trainer's own.

Detector (`RollingSpikeDetector`, the project rule): with med and MAD the median and median
absolute deviation of the past `window` normal values (strictly before t), x_t is anomalous
when

    x_t > med + k * 1.4826 * MAD      and      x_t > med + min_rel_jump * |med|

and at least `min_history` (default min(window, max(5, window // 2))) past values exist;
NaN / inf are always anomalous. Anomalous values do not enter the history (unless
`absorb=True`). With `log=True` the rule runs on log(x). 1.4826 * MAD estimates sigma for
Gaussian noise.

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
from collections import deque
from dataclasses import dataclass, field
from typing import Any

MAD_TO_SIGMA = 1.4826

__all__ = ["MAD_TO_SIGMA", "Decision", "GuardPolicy", "RollingSpikeDetector"]


def _default_min_history(window: int) -> int:
    return min(window, max(5, window // 2))


def _median_sorted(s: list[float]) -> float:
    n = len(s)
    h = n // 2
    return s[h] if n % 2 else 0.5 * (s[h - 1] + s[h])


class RollingSpikeDetector:
    """Online spike rule. `update(x)` returns True when x is anomalous (see module doc).

    After each update, `baseline` (median of the history, in the units of x) and
    `threshold` (the smallest anomalous value, in the units of x; NaN until min_history
    values exist) describe the band the point was judged against.
    """

    def __init__(self, window: int = 50, k: float = 6.0, min_rel_jump: float = 0.2,
                 min_history: int | None = None, *, log: bool = False, absorb: bool = False):
        if int(window) < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        if not (k >= 0 and math.isfinite(k)):
            raise ValueError(f"k must be a finite number >= 0, got {k}")
        if not (min_rel_jump >= 0 and math.isfinite(min_rel_jump)):
            raise ValueError(f"min_rel_jump must be a finite number >= 0, got {min_rel_jump}")
        self.window = int(window)
        self.k = float(k)
        self.min_rel_jump = float(min_rel_jump)
        self.min_history = _default_min_history(self.window) if min_history is None \
            else int(min_history)
        if not 1 <= self.min_history <= self.window:
            raise ValueError(f"min_history must be in [1, window={self.window}], "
                             f"got {self.min_history}")
        self.log = bool(log)
        self.absorb = bool(absorb)
        self._hist: deque[float] = deque(maxlen=self.window)
        self.num_updates = 0
        self.baseline = math.nan
        self.threshold = math.nan

    def _band(self) -> tuple[float, float]:
        """(median, anomaly threshold) of the history, in transformed units."""
        s = sorted(self._hist)
        med = _median_sorted(s)
        mad = _median_sorted(sorted(abs(x - med) for x in s))
        jump = math.log1p(self.min_rel_jump) if self.log else self.min_rel_jump * abs(med)
        return med, med + max(self.k * MAD_TO_SIGMA * mad, jump)

    def update(self, value: float) -> bool:
        x = float(value)
        self.num_updates += 1
        if not math.isfinite(x):
            return True
        if self.log:
            if x <= 0:
                return False
            x = math.log(x)
        anomalous = False
        if len(self._hist) >= self.min_history:
            med, thr = self._band()
            anomalous = x > thr
            self.baseline = math.exp(med) if self.log else med
            self.threshold = math.exp(thr) if self.log else thr
        else:
            self.baseline = self.threshold = math.nan
        if self.absorb or not anomalous:
            self._hist.append(x)
        return anomalous

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "k": self.k, "min_rel_jump": self.min_rel_jump,
                "min_history": self.min_history, "log": self.log, "absorb": self.absorb,
                "history": list(self._hist), "num_updates": self.num_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("window", "k", "min_rel_jump", "min_history", "log", "absorb"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"spike detector state has {key}={state[key]!r}, this "
                                 f"detector has {getattr(self, key)!r}")
        hist = [float(x) for x in state["history"]]
        if len(hist) > self.window:
            raise ValueError(f"spike detector state has {len(hist)} history values > window")
        self._hist = deque(hist, maxlen=self.window)
        self.num_updates = int(state.get("num_updates", len(hist)))


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
        self.detector = RollingSpikeDetector(window=cfg.window, k=cfg.mad_k,
                                             min_rel_jump=cfg.min_rel_jump)
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
            RollingSpikeDetector(self.detector.window, self.detector.k,
                                 self.detector.min_rel_jump).load_state_dict(base)  # checks it
        self.baseline_state = base
