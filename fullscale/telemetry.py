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
m is kept; `after_step()` computes everything else.

Speed: a per-tensor loop would issue ~20 small kernels per tensor (most of the cost for
small models). Instead the local tensors are laid end to end in chunks of at most
`max_elements` elements (a big tensor is split across chunks, small ones share one) and
each chunk is processed with a fixed number of whole-chunk kernels writing into one
(rows, chunk) scratch, each row holding one SUM_FIELDS term, e.g.

    row v_hat  = cat(exp_avg_sq) / bc2                 row r1 = m_hat / (sqrt(v_hat) + eps)
    row eps    = sqrt(v_hat) < eps                     row r2, r3, r4 = r^2, r^2 r, r^2 r^2
    row sat    = |r| > 0.9                             row g2_over_v = g^2 / max(v_hat, eps^2)

then the per-tensor sums are one reduction per (tensor, chunk) segment; no host sync until
the one all-reduced table is copied to the host. Memory: a scratch of 11 rows x
`max_elements` in the compute dtype plus one staging row of the parameters' dtype, kept
between logged steps (bounded whatever the model size; on CPU re-faulting fresh pages each
step cost more than the math), + int64 bin indices on histogram steps.

Precision: elementwise math and sums in float64 on cpu / cuda (the same operations as the
numpy reference, which the test compares at rtol 1e-6 on fp32 data); float32 on npu, where
float64 kernels are not dependable. Histogram edges are rounded up to the compute dtype, so
`e_i <= r` is the decision numpy makes in float64; values outside HIST_EDGES go to the end
bins. Counts are carried in the compute dtype (exact in float64; in float32 up to 2^24).

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
_COL = {f: i for i, f in enumerate(SUM_FIELDS)}
# after_step's scratch rows: SUM_FIELDS columns 1..10 (g2 .. v_hat), then p2
_ROWS = SUM_FIELDS[_COL["g2"]:_COL["v_hat"] + 1] + ("p2",)
_R = {f: i for i, f in enumerate(_ROWS)}
# elements per chunk: on CPU 11 float64 rows = 88 MiB of temporaries at most; accelerators
# take bigger chunks (fewer kernel launches for multi-GB shards; 11 x 32 MiB float64 rows)
DEFAULT_MAX_ELEMENTS = 1 << 20
ACCELERATOR_MAX_ELEMENTS = 1 << 22

Segment = tuple[int, int, int]   # (tensor index, start, stop) in the tensor's flat local view


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if hasattr(x, "to_local") else x


def _flat(x: torch.Tensor) -> torch.Tensor:
    """The local shard as a 1-D tensor (callers run under no_grad: no detach needed)."""
    return _local(x).reshape(-1)


def _edges(dtype: torch.dtype) -> torch.Tensor:
    """HIST_EDGES rounded up to `dtype` (x >= e_dtype <=> x >= e_float64 for x in dtype)."""
    npdt = np.float64 if dtype == torch.float64 else np.float32
    e = HIST_EDGES.astype(npdt)
    up = e.astype(np.float64) < HIST_EDGES
    e[up] = np.nextafter(e[up], np.array(np.inf, dtype=npdt))
    return torch.from_numpy(e)


def plan_chunks(sizes, max_elements: int) -> list[list[Segment]]:
    """The tensors' elements laid end to end, smallest tensors first, cut into chunks of at
    most max_elements. Sorting by size makes runs of equal-sized segments (a transformer
    has few distinct shapes), each reduced by one kernel (`_segment_sums`)."""
    chunks, cur, room = [], [], max_elements
    for i in sorted(range(len(sizes)), key=lambda i: sizes[i]):
        n, lo = sizes[i], 0
        while lo < n:
            take = min(n - lo, room)
            cur.append((i, lo, lo + take))
            lo, room = lo + take, room - take
            if room == 0:
                chunks.append(cur)
                cur, room = [], max_elements
    if cur:
        chunks.append(cur)
    return chunks


def _gather(flats, segs, out: torch.Tensor, stage: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate the segments' slices of flats into out, casting to out's dtype.

    A cast inside cat is ~2x slower than a same-dtype cat into `stage` (a buffer of the
    sources' dtype) followed by one whole-chunk cast."""
    parts = [flats[i] if lo == 0 and hi == flats[i].shape[0] else flats[i][lo:hi]
             for i, lo, hi in segs]
    if len(parts) == 1:
        return out.copy_(parts[0])
    if stage is not None and stage.dtype != out.dtype and all(x.dtype == stage.dtype for x in parts):
        return out.copy_(torch.cat(parts, out=stage[:out.numel()]))
    return torch.cat(parts, out=out)


def _segment_sums(w: torch.Tensor, segs) -> torch.Tensor:
    """(num_segments, rows) sums of the columns of w belonging to each segment: one
    reduction per run of equal-length segments, viewed as (rows, segments, length)."""
    sums, a, k = [], 0, 0
    while k < len(segs):
        n, j = segs[k][2] - segs[k][1], k + 1
        while j < len(segs) and segs[j][2] - segs[j][1] == n:
            j += 1
        sums.append(w[:, a:a + (j - k) * n].reshape(w.shape[0], j - k, n).sum(2).T)
        a, k = a + (j - k) * n, j
    return torch.cat(sums)


def _bias_correct(x: torch.Tensor, segs, bc: list[float]) -> None:
    """x /= bc of each segment's tensor, in place (one kernel when all share one step)."""
    vals = {bc[i] for i, _, _ in segs}
    if len(vals) == 1:
        x.div_(vals.pop())
        return
    a = 0
    for i, lo, hi in segs:
        x[a:a + hi - lo].div_(bc[i])
        a += hi - lo


def chunk_sums(w: torch.Tensor, g, m, v, p, segs, bc1, bc2, eps: float,
               stage: torch.Tensor | None = None) -> torch.Tensor:
    """The after-step SUM_FIELDS terms of one chunk, row by row into w (_ROWS x chunk).

    Returns r (a view of row r1). Each row ends holding the elementwise term whose sum is
    that field: the same float operations as adamspike.metrics.shard_sums."""
    row = {f: w[k] for f, k in _R.items()}
    v_hat, m_hat, r = row["v_hat"], row["m_hat2"], row["r1"]
    _bias_correct(_gather(v, segs, v_hat, stage), segs, bc2)
    _bias_correct(_gather(m, segs, m_hat, stage), segs, bc1)
    torch.sqrt(v_hat, out=r)
    torch.lt(r, eps, out=row["eps_small"])                # sqrt(v_hat) < eps
    torch.div(m_hat, r.add_(eps), out=r)                  # r = m_hat / (sqrt(v_hat) + eps)
    m_hat.mul_(m_hat)
    torch.mul(r, r, out=row["r2"])
    torch.mul(row["r2"], r, out=row["r3"])
    torch.mul(row["r2"], row["r2"], out=row["r4"])
    torch.abs(r, out=row["sat"]).gt_(SAT_THRESHOLD)
    g2 = _gather(g, segs, row["g2"], stage)
    g2.mul_(g2)
    q = row["g2_over_v"]
    if eps > 0:
        torch.div(g2, torch.clamp_min(v_hat, eps * eps, out=q), out=q)
    else:  # v_hat = 0 implies g = 0 (v >= (1 - b2) g^2): count 0
        torch.div(g2, v_hat, out=q).masked_fill_(v_hat <= 0, 0.0)
    p2 = _gather(p, segs, row["p2"], stage)
    p2.mul_(p2)
    return r


def hist_counts(r: torch.Tensor, edges: torch.Tensor, segs=None) -> torch.Tensor:
    """Counts (num_segments, NUM_HIST_BINS) of r on edges (ends clipped, last edge in the
    last bin), r being the segments laid end to end (segs=None: one segment, all of r).

    The bin index comes from the equal-width formula, then is corrected by one comparison
    with each neighbouring edge, so the result is numpy.histogram's exactly (bucketize
    gives the same answer at ~2.5x the cost on CPU); one bincount covers all segments."""
    lo, width = float(HIST_EDGES[0]), float(HIST_EDGES[1] - HIST_EDGES[0])
    idx = r.sub(lo).div_(width).floor_().clamp_(0, NUM_HIST_BINS - 1).long()
    idx -= (r < edges[idx]).long()                        # below its left edge
    idx += (r >= edges[idx + 1]) & (idx < NUM_HIST_BINS - 1)   # at / past its right edge
    idx.clamp_(0, NUM_HIST_BINS - 1)
    num_segs = 1 if segs is None else len(segs)
    if num_segs > 1:
        lengths = torch.tensor([hi - lo for _, lo, hi in segs], device=r.device)
        offsets = torch.arange(num_segs, device=r.device) * NUM_HIST_BINS
        idx += torch.repeat_interleave(offsets, lengths)
    counts = torch.bincount(idx, minlength=num_segs * NUM_HIST_BINS)
    return counts.view(num_segs, NUM_HIST_BINS).to(r.dtype)


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
                 every: int = 1, hist_every: int = 0, compute_dtype: torch.dtype | None = None,
                 max_elements: int | None = None):
        dev = _local(optimizer.param_groups[0]["params"][0]).device
        if max_elements is None:
            max_elements = DEFAULT_MAX_ELEMENTS if dev.type == "cpu" else ACCELERATOR_MAX_ELEMENTS
        if max_elements < 1:
            raise ValueError(f"telemetry: max_elements must be >= 1, got {max_elements}")
        self.optimizer, self.every, self.hist_every = optimizer, int(every), int(hist_every)
        self.max_elements = int(max_elements)
        self.params, self.names = [], []
        for group in optimizer.param_groups:
            names = group.get("names") or [f"param{i}" for i in range(len(group["params"]))]
            self.params += list(group["params"])
            self.names += list(names)
        group = optimizer.param_groups[0]
        self.b1, self.b2 = group["betas"]
        self.eps = float(group["eps"])
        dev = _local(self.params[0]).device
        self.device = dev
        self.dtype = compute_dtype or (torch.float32 if dev.type == "npu" else torch.float64)
        self.edges = _edges(self.dtype).to(dev)
        self.depth = np.array([getattr(specs.get(n), "depth", 0) for n in self.names], dtype=np.int32)
        self.kind = np.array([getattr(specs.get(n), "kind", "param") for n in self.names], dtype=object)
        self.numel = np.array([p.numel() for p in self.params], dtype=np.int64)  # global numel
        self.group = shard_group(self.params)
        self.param_dtype = _local(self.params[0]).dtype
        self._work: tuple[torch.Tensor, torch.Tensor] | None = None
        self._mprev: torch.Tensor | None = None

    def active(self, step: int) -> bool:
        return step % self.every == 0

    def hist_active(self, step: int) -> bool:
        return self.hist_every > 0 and step % self.hist_every == 0

    def _scratch(self, chunks) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, width) compute-dtype scratch and a (width,) staging buffer of the
        parameters' dtype, kept between logged steps: on CPU, faulting in fresh pages every
        step cost more than the math. Bounded by max_elements, whatever the model size."""
        width = max((sum(hi - lo for _, lo, hi in c) for c in chunks), default=0)
        if self._work is None or self._work[0].shape[1] < width:
            self._work = None   # free the old one first
            self._work = (torch.empty((len(_ROWS), width), dtype=self.dtype, device=self.device),
                          torch.empty(width, dtype=self.param_dtype, device=self.device))
        return self._work

    def _segment_index(self, segs) -> torch.Tensor:
        return torch.tensor([i for i, _, _ in segs], device=self.device)

    @torch.no_grad()
    def before_step(self, step: int) -> None:
        """sum g m_prev and sum m_prev^2 per tensor, from exp_avg before it is updated."""
        if not self.active(step):
            self._mprev = None
            return
        state = self.optimizer.state
        g = [_flat(p.grad) for p in self.params]
        m = [_flat(state[p]["exp_avg"]) if "exp_avg" in state.get(p, {})
             else torch.zeros_like(g[i]) for i, p in enumerate(self.params)]   # first step: 0
        chunks = plan_chunks([x.numel() for x in g], self.max_elements)
        out = torch.zeros((len(self.params), 2), dtype=self.dtype, device=self.device)
        w, stage = self._scratch(chunks)
        for segs in chunks:
            n = sum(hi - lo for _, lo, hi in segs)
            gm, mm = _gather(g, segs, w[0, :n], stage), _gather(m, segs, w[1, :n], stage)
            gm.mul_(mm)
            mm.mul_(mm)
            out.index_add_(0, self._segment_index(segs), _segment_sums(w[:2, :n], segs))
        self._mprev = out

    @torch.no_grad()
    def after_step(self, step: int) -> StepTelemetry | None:
        if not self.active(step):
            return None
        if self._mprev is None:
            raise RuntimeError(f"telemetry: before_step({step}) was not called before the step")
        with_hist = self.hist_active(step)
        state = self.optimizer.state
        sts = [state[p] for p in self.params]
        g = [_flat(p.grad) for p in self.params]
        m = [_flat(st["exp_avg"]) for st in sts]
        v = [_flat(st["exp_avg_sq"]) for st in sts]
        p = [_flat(x) for x in self.params]
        t = [int(st["step"]) for st in sts]
        bc1 = [1 - self.b1 ** k for k in t]
        bc2 = [1 - self.b2 ** k for k in t]
        table = torch.zeros((len(self.params), NUM_SUMS + (NUM_HIST_BINS if with_hist else 0)),
                            dtype=self.dtype, device=self.device)
        sizes = [x.numel() for x in g]
        chunks = plan_chunks(sizes, self.max_elements)
        table[:, _COL["n"]] = torch.tensor(sizes, dtype=self.dtype)
        table[:, _COL["g_mprev"]:_COL["mprev2"] + 1] = self._mprev
        self._mprev = None
        w, stage = self._scratch(chunks)
        after = table[:, _COL["g2"]:_COL["v_hat"] + 1]
        for segs in chunks:
            n = sum(hi - lo for _, lo, hi in segs)
            r = chunk_sums(w[:, :n], g, m, v, p, segs, bc1, bc2, self.eps, stage)
            sums, index = _segment_sums(w[:, :n], segs), self._segment_index(segs)
            after.index_add_(0, index, sums[:, :-1])
            table[:, _COL["p2"]].index_add_(0, index, sums[:, -1])
            if with_hist:
                table[:, NUM_SUMS:].index_add_(0, index, hist_counts(r, self.edges, segs))
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
