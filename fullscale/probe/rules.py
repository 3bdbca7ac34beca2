"""The online spike rules (one RollingSpikeDetector per rule, identical on every rank) and the
numerics they read (loss scale, alarm operators)."""

from __future__ import annotations

from typing import List, Optional

from fullscale.probe.actions import ProbeActions
from fullscale.probe.optimizer import leaf_optimizers


class _SpikeRules:
    """One RollingSpikeDetector per rule (identical on every rank: same all-reduced
    inputs in the same order)."""

    def __init__(self, actions: ProbeActions):
        self.det = {r: actions.spike_params.detector() for r in actions.rules}

    def update(self, loss: Optional[float], grad_norm: Optional[float]) -> List[dict]:
        fired = []
        for metric, v in (("loss", loss), ("grad_norm", grad_norm)):
            d = self.det.get(metric)
            if d is None or v is None:
                continue
            if d.update(v):
                fired.append({"metric": metric, "value": float(v), "baseline": d.baseline,
                              "threshold": d.threshold})
        return fired


def _loss_scale(optimizer) -> float:
    """Megatron's loss scale (fp16; 1 for bf16 / fp32 and plain torch optimizers)."""
    for leaf in leaf_optimizers(optimizer):
        if getattr(leaf, "grad_scaler", None) is not None:
            try:
                return float(leaf.get_loss_scale())
            except Exception:  # noqa: BLE001 - no scaler API: unscaled
                return 1.0
    return 1.0


def _op(alarms, rule_id: str) -> str:
    for r in getattr(alarms, "rules", []):
        if r.id == rule_id:
            return r.op
    return ">"
