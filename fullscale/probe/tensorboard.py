"""TensorBoard out: per-group Adam telemetry as scalars beside the run directory's tables
(RUN/tensorboard/), so a Megatron / MindSpeed-LLM user sees them next to Megatron's own
`--tensorboard-dir` curves. One scalar per (kind, metric) per telemetry step: the median over
the group's tensors (tag `adamspike/KIND/METRIC`, e.g. adamspike/wqkv/rho; `group_medians`,
which adamspike's trainer also writes through fullscale.telemetry.TensorBoardScalars when
`telemetry.tensorboard` is on). The probe's writer rank writes them when
torch.utils.tensorboard imports (the `tensorboard` package); off with
ADAMSPIKE_TENSORBOARD=0. The tables stay the record: this is a view.
"""

from __future__ import annotations

import math
import os
from typing import Dict, Optional

import numpy as np

METRICS = ("rho", "update_rms", "grad_rms", "rms_t", "sat_frac", "m_v_ratio")
SUBDIR = "tensorboard"


def group_medians(columns: dict) -> Dict[str, float]:
    """{adamspike/KIND/METRIC: median over the kind's tensors} of a layers table's columns
    (finite values only)."""
    out: Dict[str, float] = {}
    kinds = np.asarray(columns["kind"])
    for kind in sorted(set(kinds.tolist())):
        sel = kinds == kind
        for m in METRICS:
            v = np.asarray(columns[m], dtype=np.float64)[sel]
            v = v[np.isfinite(v)]
            if v.size:
                val = float(np.median(v))
                if math.isfinite(val):
                    out[f"adamspike/{kind}/{m}"] = val
    return out


class GroupScalars:
    """A SummaryWriter on RUN/tensorboard, or nothing (no tensorboard, or switched off)."""

    def __init__(self, run_dir: str, enabled: Optional[bool] = None):
        self.writer = None
        self.reason = ""
        if enabled is None:
            enabled = os.environ.get("ADAMSPIKE_TENSORBOARD", "1").lower() not in ("0", "false", "off", "no")
        if not enabled:
            self.reason = "off (ADAMSPIKE_TENSORBOARD=0)"
            return
        try:
            # lazy: needs the tensorboard package (optional extra), absent on many nodes
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            self.reason = f"no tensorboard ({e})"
            return
        self.writer = SummaryWriter(os.path.join(run_dir, SUBDIR))

    def log(self, step: int, columns: dict) -> None:
        if self.writer is None:
            return
        for tag, value in group_medians(columns).items():
            self.writer.add_scalar(tag, value, int(step))
        self.writer.flush()      # telemetry steps are sparse: on disk at once, crash or not

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
