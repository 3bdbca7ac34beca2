"""Per-tensor Adam telemetry for the torch trainer: adamspike/metrics.py on the device.

For every parameter tensor, from the gradient AdamW consumed (p.grad after clipping), its
bias-corrected state after the step m_hat = exp_avg / (1 - b1^t), v_hat = exp_avg_sq /
(1 - b2^t) (t = state["step"]), the raw momentum before the step m_prev and the parameter
after the step, the SUM_FIELDS sums are computed on this rank's local shard (FSDP2
DTensors via `.to_local()`), stacked into one (num_tensors, len(SUM_FIELDS) [+ 64 hist
bins]) tensor and summed across ranks with ONE all_reduce; `adamspike.metrics.finalize`
turns the sums into METRIC_NAMES. Sums of shards are sums of the whole tensor, so sharded
and unsharded runs log the same numbers (up to summation order).

No extra memory across the step: the two sums that need m_prev (sum g m_prev and
sum m_prev^2) are computed by `before_step()`, just before optimizer.step(), so no copy of
m is kept; `after_step()` computes everything else. Transient memory is a few temporaries
of one local tensor at a time.

Precision: elementwise math and sums in float64 on cpu / cuda (the test compares with the
numpy reference at rtol 1e-6 on fp32 data); float32 on npu, where float64 kernels are not
dependable. Histogram edges are rounded up to the compute dtype, so `e_i <= r` is the
decision numpy makes in float64; values outside HIST_EDGES go to the end bins. Counts are
carried in the compute dtype (exact in float64; in float32 up to 2^24 per bin).

Optional TensorBoard scalars (`telemetry.tensorboard`): needs the `tensorboard` package; if
it is missing the trainer warns once and carries on.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from adamspike.metrics import HIST_EDGES, METRIC_NAMES, NUM_HIST_BINS, SAT_THRESHOLD, SUM_FIELDS, finalize

NUM_SUMS = len(SUM_FIELDS)
_G_MPREV, _MPREV2 = SUM_FIELDS.index("g_mprev"), SUM_FIELDS.index("mprev2")


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if hasattr(x, "to_local") else x


def _edges(dtype: torch.dtype) -> torch.Tensor:
    """HIST_EDGES rounded up to `dtype` (x >= e_dtype <=> x >= e_float64 for x in dtype)."""
    npdt = np.float64 if dtype == torch.float64 else np.float32
    e = HIST_EDGES.astype(npdt)
    up = e.astype(np.float64) < HIST_EDGES
    e[up] = np.nextafter(e[up], np.array(np.inf, dtype=npdt))
    return torch.from_numpy(e)


def tensor_sums(g, m, v, p, bc1: float, bc2: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(SUM_FIELDS sums of one flat local tensor, with g_mprev / mprev2 left 0; r).

    g, m = exp_avg, v = exp_avg_sq, p: flat tensors of the compute dtype; bc1 = 1 - b1^t,
    bc2 = 1 - b2^t. Written for few passes: dot products instead of product + sum, and
    in-place updates of a handful of temporaries (one tensor at a time)."""
    m_hat = m / bc1
    v_hat = v / bc2
    den = v_hat.sqrt()
    eps_small = torch.count_nonzero(den < eps)
    r = torch.div(m_hat, den.add_(eps), out=den)          # r = m_hat / (sqrt(v_hat) + eps)
    r2 = r * r
    v_sum = v_hat.sum()
    denom = v_hat.clamp_min_(eps * eps)                   # max(v_hat, eps^2), in place
    if eps > 0:
        g2_over_v = torch.dot(g / denom, g)
    else:  # v_hat = 0 implies g = 0 (v >= (1 - b2) g^2): count 0
        ok = denom > 0
        g2_over_v = torch.where(ok, g * g / torch.where(ok, denom, 1.0), 0.0).sum()
    zero = v_sum.new_zeros(())
    out = torch.stack([
        v_sum.new_tensor(float(g.numel())), torch.dot(g, g), r.sum(), r2.sum(), torch.dot(r2, r),
        torch.dot(r2, r2), g2_over_v, torch.count_nonzero(r.abs() > SAT_THRESHOLD).to(g.dtype),
        eps_small.to(g.dtype), torch.dot(m_hat, m_hat), v_sum, zero, zero, torch.dot(p, p)])
    return out, r


def hist_counts(r: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Counts (NUM_HIST_BINS,) of r on edges, ends clipped, last edge in the last bin.

    The bin index comes from the equal-width formula, then is corrected by one comparison
    with each neighbouring edge, so the result is numpy.histogram's exactly (bucketize
    gives the same answer at ~2.5x the cost on CPU)."""
    lo, width = float(HIST_EDGES[0]), float(HIST_EDGES[1] - HIST_EDGES[0])
    idx = r.sub(lo).div_(width).floor_().clamp_(0, NUM_HIST_BINS - 1).long()
    idx -= (r < edges[idx]).long()                        # below its left edge
    idx += (r >= edges[idx + 1]) & (idx < NUM_HIST_BINS - 1)   # at / past its right edge
    return torch.bincount(idx.clamp_(0, NUM_HIST_BINS - 1), minlength=NUM_HIST_BINS).to(r.dtype)


@dataclass
class StepTelemetry:
    step: int
    columns: dict[str, Any]          # name, depth, kind, numel + METRIC_NAMES arrays
    hists: np.ndarray | None         # (num_tensors, NUM_HIST_BINS) int64 counts, or None
    sums: np.ndarray                 # (num_tensors, NUM_SUMS) all-reduced float64


class Telemetry:
    """Collects per-tensor metrics every `every` steps, histograms every `hist_every`
    (on logged steps, i.e. at common multiples of both).

    All ranks call `before_step(step)` just before optimizer.step() and `after_step(step)`
    just after it (both are no-ops on steps that are not logged); `after_step` performs the
    one all-reduce and returns a StepTelemetry on every rank (or None).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, specs: Mapping[str, Any], *,
                 every: int = 1, hist_every: int = 0, compute_dtype: torch.dtype | None = None):
        self.optimizer, self.every, self.hist_every = optimizer, int(every), int(hist_every)
        self.params, self.names = [], []
        for group in optimizer.param_groups:
            names = group.get("names") or [f"param{i}" for i in range(len(group["params"]))]
            self.params += list(group["params"])
            self.names += list(names)
        group = optimizer.param_groups[0]
        self.b1, self.b2 = group["betas"]
        self.eps = float(group["eps"])
        dev = _local(self.params[0]).device
        self.dtype = compute_dtype or (torch.float32 if dev.type == "npu" else torch.float64)
        self.edges = _edges(self.dtype).to(dev)
        self.depth = np.array([getattr(specs.get(n), "depth", 0) for n in self.names], dtype=np.int32)
        self.kind = np.array([getattr(specs.get(n), "kind", "param") for n in self.names], dtype=object)
        self.numel = np.array([p.numel() for p in self.params], dtype=np.int64)  # global numel
        self.group = shard_group(self.params)
        self._mprev: torch.Tensor | None = None

    def active(self, step: int) -> bool:
        return step % self.every == 0

    def hist_active(self, step: int) -> bool:
        return self.hist_every > 0 and step % self.hist_every == 0

    @torch.no_grad()
    def before_step(self, step: int) -> None:
        """sum g m_prev and sum m_prev^2 per tensor, from exp_avg before it is updated."""
        if not self.active(step):
            self._mprev = None
            return
        rows = []
        for p in self.params:
            g = _local(p.grad).to(self.dtype).reshape(-1)
            state = self.optimizer.state.get(p, {})
            if "exp_avg" in state:
                m = _local(state["exp_avg"]).to(self.dtype).reshape(-1)
                rows.append(torch.stack([torch.dot(g, m), torch.dot(m, m)]))
            else:  # first step: m_prev = 0
                rows.append(g.new_zeros(2))
        self._mprev = torch.stack(rows)

    @torch.no_grad()
    def after_step(self, step: int) -> StepTelemetry | None:
        if not self.active(step):
            return None
        if self._mprev is None:
            raise RuntimeError(f"telemetry: before_step({step}) was not called before the step")
        with_hist = self.hist_active(step)
        rows = []
        for p in self.params:
            state = self.optimizer.state[p]
            t = int(state["step"])
            flat = [_local(x).detach().to(self.dtype).reshape(-1)
                    for x in (p.grad, state["exp_avg"], state["exp_avg_sq"], p)]
            sums, r = tensor_sums(*flat, 1 - self.b1 ** t, 1 - self.b2 ** t, self.eps)
            rows.append(torch.cat([sums, hist_counts(r, self.edges)]) if with_hist else sums)
        table = torch.stack(rows)
        table[:, _G_MPREV], table[:, _MPREV2] = self._mprev[:, 0], self._mprev[:, 1]
        self._mprev = None
        _all_reduce(table, self.group)
        table = table.cpu().double().numpy()
        sums = table[:, :NUM_SUMS]
        metrics = finalize(sums, self.eps)
        columns = {"name": list(self.names), "depth": self.depth, "kind": list(self.kind),
                   "numel": self.numel, **{k: metrics[k] for k in METRIC_NAMES}}
        hists = np.rint(table[:, NUM_SUMS:]).astype(np.int64) if with_hist else None
        return StepTelemetry(step, columns, hists, sums)

    def write(self, writer, out: StepTelemetry) -> None:
        """Rank 0: the layers rows and histograms into a RunWriter."""
        writer.log_layers(out.step, columns=out.columns)
        if out.hists is not None:
            for i, name in enumerate(self.names):
                writer.log_hist(out.step, name, int(self.depth[i]), str(self.kind[i]), out.hists[i])


def shard_group(params):
    """The process group over which the parameters are sharded (FSDP2 DTensors), or None
    for plain tensors: those are whole on every rank and their sums are not reduced."""
    for p in params:
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and mesh.size() > 1 and any(pl.is_shard() for pl in p.placements):
            return mesh.get_group()
    return None


def _all_reduce(t: torch.Tensor, group) -> None:
    import torch.distributed as dist

    if group is not None:
        dist.all_reduce(t, group=group)


class TensorBoardScalars:
    """Optional scalars (steps columns and a few per-depth metrics) for TensorBoard."""

    def __init__(self, log_dir):
        self.writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception as e:  # noqa: BLE001 - tensorboard missing or broken
            warnings.warn(f"telemetry.tensorboard = true but TensorBoard is unavailable ({e}); "
                          "install the `tensorboard` package; continuing without it",
                          RuntimeWarning, stacklevel=2)
            return
        self.writer = SummaryWriter(str(log_dir))

    def log(self, step: int, row: Mapping[str, Any], out: StepTelemetry | None = None) -> None:
        if self.writer is None:
            return
        for k, v in row.items():
            if isinstance(v, (int, float, bool)) and k != "step" and math.isfinite(float(v)):
                self.writer.add_scalar(f"train/{k}", float(v), step)
        if out is not None:
            for metric in ("grad_rms", "update_rms", "rms_t", "rho"):
                for name, value in zip(out.columns["name"], out.columns[metric]):
                    if np.isfinite(value):
                        self.writer.add_scalar(f"{metric}/{name}", float(value), step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
