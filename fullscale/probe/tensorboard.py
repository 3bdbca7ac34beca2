"""TensorBoard out: per-group Adam telemetry as scalars beside the run directory's tables
(RUN/tensorboard/), so a Megatron / MindSpeed-LLM user sees them next to Megatron's own
`--tensorboard-dir` curves. One scalar per (kind, metric) per telemetry step: the median over
the group's tensors (tag `adamspike/KIND/METRIC`, e.g. adamspike/wqkv/rho; `group_medians`,
which adamspike's trainer also writes through fullscale.telemetry.TensorBoardScalars when
`telemetry.tensorboard` is on). The probe's writer rank writes them when
torch.utils.tensorboard imports (the `tensorboard` package); off with
ADAMSPIKE_TENSORBOARD=0. The tables stay the record: this is a view.

W&B (optional, never a requirement): the same scalars to a W&B run when asked for
(ADAMSPIKE_WANDB=1 for the probe, `telemetry.wandb = true` for adamspike's trainer) and the
`wandb` package imports (imported only then). Offline by default: the run goes to
RUN/wandb/ (`wandb sync` uploads it later) unless WANDB_MODE says otherwise (the compute
nodes of a 910B cluster usually have no way out); WANDB_PROJECT names the project (default
adamspike). Asked for without wandb: one line saying so (the trainer refuses to start; the
probe says it once and goes on without W&B, as it never stops a job). Not asked for:
nothing, wandb is not even looked for.
"""

from __future__ import annotations

import math
import os
from typing import Dict, Optional

import numpy as np

METRICS = ("rho", "update_rms", "grad_rms", "rms_t", "sat_frac", "m_v_ratio")
SUBDIR = "tensorboard"
WANDB_ENV = "ADAMSPIKE_WANDB"


class WandbUnavailable(RuntimeError):
    """W&B was asked for and the wandb package does not import (one line)."""


def wandb_asked(env=None) -> bool:
    env = os.environ if env is None else env
    return env.get(WANDB_ENV, "").lower() in ("1", "true", "yes", "on")


def import_wandb(asked_by: str):
    """The wandb module, or WandbUnavailable naming who asked."""
    try:
        import wandb  # lazy: optional, only when asked for
    except ImportError as e:
        raise WandbUnavailable(f"{asked_by} asks for W&B but the wandb package is not "
                               f"installed ({e}); pip install wandb, or leave W&B off") from None
    return wandb


class WandbScalars:
    """A W&B run beside RUN/ (RUN/wandb/, offline unless WANDB_MODE says otherwise) taking
    the same per-group scalars as the TensorBoard view, and the steps row's numbers."""

    def __init__(self, run_dir: str, *, asked_by: str, name: Optional[str] = None,
                 config: Optional[dict] = None):
        wandb = import_wandb(asked_by)
        mode = os.environ.get("WANDB_MODE") or "offline"
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "adamspike",
                              name=name or os.path.basename(os.path.abspath(run_dir)),
                              dir=str(run_dir), mode=mode, config=config or {})
        self.mode = mode

    def log(self, step: int, columns: Optional[dict] = None, row: Optional[dict] = None) -> None:
        data: Dict[str, float] = {}
        for k, v in (row or {}).items():
            if k != "step" and isinstance(v, (int, float, bool)) and math.isfinite(float(v)):
                data[f"train/{k}"] = float(v)
        if columns is not None:
            data.update(group_medians(columns))
        if data:
            self.run.log(data, step=int(step))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


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
    """A SummaryWriter on RUN/tensorboard, or nothing (no tensorboard, or switched off);
    and a W&B run when ADAMSPIKE_WANDB=1 (`wandb_error`: the one line when it cannot)."""

    def __init__(self, run_dir: str, enabled: Optional[bool] = None):
        self.writer = None
        self.reason = ""
        self.wandb: Optional[WandbScalars] = None
        self.wandb_error = ""
        if wandb_asked():
            try:
                self.wandb = WandbScalars(run_dir, asked_by=f"{WANDB_ENV}=1")
            except WandbUnavailable as e:
                self.wandb_error = str(e)
            except Exception as e:  # noqa: BLE001 - W&B must never stop the job
                self.wandb_error = f"W&B could not start ({type(e).__name__}: {e}); going on without it"
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
        if self.wandb is not None:
            self.wandb.log(step, columns)
        if self.writer is None:
            return
        for tag, value in group_medians(columns).items():
            self.writer.add_scalar(tag, value, int(step))
        self.writer.flush()      # telemetry steps are sparse: on disk at once, crash or not

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
