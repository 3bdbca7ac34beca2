"""Per-tensor Adam telemetry for the torch trainer: adamspike/metrics.py on the device.

For every parameter tensor, from the gradient AdamW consumed (p.grad after clipping), its
bias-corrected state after the step m_hat = exp_avg / (1 - b1^t), v_hat = exp_avg_sq /
(1 - b2^t) (t = state["step"]), the raw momentum before the step m_prev and the parameter
after the step, the SUM_FIELDS sums are computed on this rank's local shard (FSDP2
DTensors via `.to_local()`), stacked into one (num_tensors, len(SUM_FIELDS) [+ 64 hist
bins]) float64 table and summed across ranks with ONE all_reduce;
`adamspike.metrics.finalize` turns the sums into METRIC_NAMES. Sums of shards are sums of
the whole tensor, so sharded and unsharded runs log the same numbers (up to rounding).

m_prev: with explicit_m_prev (the trainer sets it when an active mitigation edits optimizer
state, adamspike.mitigations.needs_explicit_m_prev) `before_step` copies exp_avg, the
momentum the step will read, and the kernels take that copy as m_prev. Otherwise no copy
is made: AdamW's first moment is m_t = b1 m_prev + (1 - b1) g (torch's `lerp`), so after
the step m_prev = (m_t - (1 - b1) g) / b1, elementwise. The fp32 state
m_t is rounded, so m_prev is recovered to ~2^-24 (|m_t| + (1 - b1)|g|) / b1 per element,
whatever the compute precision: grad_mom_cos is exact to ~1e-7 (|m_t| + 0.1|g|) / |m_prev|,
which stays small even when a spiking gradient is 1000x the momentum. `before_step()`
notes which tensors have no state yet (m_prev = 0 exactly: their m_prev sums are 0).

Per-tensor eps: each param group's eps (per-group eps) enters r, rms_t, eps_frac and rho
of its tensors (a per-tensor row of the bias-correction table; the native kernel is
called once per distinct eps).

Layout: the local tensors are laid end to end in chunks of at most `max_elements`
elements (a big tensor is split across chunks, small ones share one), each segment
starting on a multiple of BLOCK = 256 (its tail padded with zeros). Per chunk, g, m, v, p
are copied into a persistent (4, width) buffer (a run of equal-shaped tensors by one
`torch.stack(out=...)`, the rest by one `_foreach_copy_`) and one kernel, `tensor_sums`
(around `block_sums`), computes every SUM_FIELDS term of every element, sums each over its
256-element block:

    m_hat = m / bc1          v_hat = v / bc2          r = m_hat / (sqrt(v_hat) + eps)
    terms g^2, r, r^2, r^3, r^4, g^2 / max(v_hat, eps^2), |r| > 0.9, sqrt(v_hat) < eps,
          m_hat^2, v_hat, g m_prev, m_prev^2, p^2

and adds the blocks' sums to their tensors' rows of the float64 table (index_add).
Padding contributes 0 to every term but `sqrt(v_hat) < eps` and the histogram's bin of 0,
which are corrected by the known pad counts. On histogram steps a second kernel,
`bin_index`, gives every element's bin (offset by 64 x its tensor), counted by one bincount.

Speed: by default (`compile="auto"`: cpu and cuda) the kernels are compiled. On cpu the
sums and histograms come from fullscale.cpu_kernel's native multi-tensor loop, which reads
g, m, v, p in place (no buffer, no padding) with the same elementwise operations and block
sums; on cuda (and on cpu when the native kernel cannot be built, or the tensors are not
contiguous float32 / float64) `tensor_sums` and `bin_index` are compiled by inductor (one
fused loop that reads the buffer once, instead of ~25 whole-chunk passes that write
temporaries; calling inductor's code directly instead of through torch.compile saves a
Python dispatch per call). npu runs them eagerly (the same functions, op by op). The
overhead against a step without telemetry is measured by bench/bench_telemetry_torch.py.
Builds: the native kernel's C++ compile when
Telemetry is created (once per machine, torch and source version, cached on disk),
inductor's at the first logged step that uses it (cached on disk by inductor). If a build fails (no C++ compiler or headers, no triton, ...)
the trainer warns once and falls back (native -> inductor -> eager). TORCHDYNAMO_DISABLE=1
or ADAMSPIKE_TELEMETRY_COMPILE=off also make "auto" run the kernels eagerly (the test
suite sets the latter). Memory: the (4, width) buffer in the compute dtype (bounded by
max_elements, kept between logged steps; unused by the native path) plus the kernels'
(13, width / 256) outputs; int64 bin indices on histogram steps.

Precision: elementwise math in the compute dtype, `precision` = "float32" (default, like
the JAX side and npu, where float64 kernels are not dependable) or "float64" (the same
operations as the numpy reference); block sums of 256 elements in that dtype, their totals
in float64, so counts are exact. float32 metrics agree with the float64 numpy reference to
~1e-6 relative (sums of signed terms: to ~1e-7 of the sum of their magnitudes). Histogram
edges are rounded up to the compute dtype, so `e_i <= r` is the decision numpy makes in
float64 on the same r; values outside HIST_EDGES go to the end bins, NaN to the last.

Optional TensorBoard scalars (`telemetry.tensorboard`): needs the `tensorboard` package; if
it is missing the trainer warns once and carries on.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Tuple

import numpy as np
import torch
import torch.distributed as dist

from adamspike.metrics import HIST_EDGES, METRIC_NAMES, NUM_HIST_BINS, SUM_FIELDS, finalize
from adamspike.metrics import NUM_VHIST_BINS, VHIST_EDGES
from fullscale import cpu_kernel
from fullscale.device import local_shard as _local
from fullscale.probe.kernels import adam_terms, bin_counts, rounded_edges, update_direction
from fullscale.probe.tensorboard import group_medians

NUM_SUMS = len(SUM_FIELDS)
_COL = {f: i for i, f in enumerate(SUM_FIELDS)}
# elements per chunk: on CPU a (4, 1M) float32 buffer (16 MiB); accelerators take bigger
# chunks (fewer launches for multi-GB shards)
DEFAULT_MAX_ELEMENTS = 1 << 20
ACCELERATOR_MAX_ELEMENTS = 1 << 22
BLOCK = 256
PRECISIONS = {"float32": torch.float32, "float64": torch.float64}
COMPILE_MODES = ("auto", "on", "off")
# the bin that holds r = 0 (the padding's r)
_ZERO_BIN = int(np.searchsorted(HIST_EDGES, 0.0, side="right")) - 1

Segment = Tuple[int, int, int]   # (tensor index, start, stop) in the tensor's flat local view


def _padded(n: int, block: int) -> int:
    return -(-n // block) * block


def plan_chunks(sizes, max_elements: int, block: int = 1, shapes=None) -> list[list[Segment]]:
    """The tensors' elements laid end to end, smallest first (equal shapes next to each
    other), each segment starting on a multiple of `block` (its tail padded up to the next
    one), cut into chunks of at most max(max_elements, block) padded elements: a big tensor
    is split across chunks, small ones share one."""
    cap = max(max_elements // block, 1) * block
    chunks, cur, room = [], [], cap
    key = (lambda i: (sizes[i], tuple(shapes[i]))) if shapes is not None else (lambda i: sizes[i])
    for i in sorted(range(len(sizes)), key=key):
        n, lo = sizes[i], 0
        while lo < n:
            take = min(n - lo, room)
            cur.append((i, lo, lo + take))
            lo, room = lo + take, room - _padded(take, block)
            if room == 0:
                chunks.append(cur)
                cur, room = [], cap
    if cur:
        chunks.append(cur)
    return chunks


# ----------------------------------------------------------------------------- kernels

def _bias_corrections(bc, block_tensor):
    """Per block (as a column), the bias corrections 1 - b1^t, 1 - b2^t and eps of its
    tensor."""
    per_block = bc[:, block_tensor]
    return per_block[0][:, None], per_block[1][:, None], per_block[2][:, None]


def block_sums(x: torch.Tensor, bc: torch.Tensor, block_tensor: torch.Tensor, b1: float,
               zero_eps: bool) -> torch.Tensor:
    """The SUM_FIELDS terms g2 .. p2 (SUM_FIELDS[1:]) summed over each BLOCK-element block.

    x: (4, width) rows g, m, v, p of one chunk (m = exp_avg, v = exp_avg_sq after the
    step), or (5, width) with m_prev as the fifth row; bc: (3, num_tensors) 1 - b1^t,
    1 - b2^t and eps of each tensor (t its Adam step); block_tensor: (width / BLOCK,) the
    tensor of each block. Returns (13, width / BLOCK) in x's dtype. Without a fifth row,
    m_prev = (m - (1 - b1) g) / b1."""
    g, m, v, p = (row.view(-1, BLOCK) for row in x[:4])
    bc1, bc2, eps = _bias_corrections(bc, block_tensor)
    m_prev = x[4].view(-1, BLOCK) if x.shape[0] == 5 else None
    terms, _ = adam_terms(g, m, v, p, bc1, bc2, eps, zero_eps, b1, m_prev)
    return torch.stack([t.sum(1, dtype=x.dtype) for t in terms])


def tensor_sums(x: torch.Tensor, bc: torch.Tensor, block_tensor: torch.Tensor, acc: torch.Tensor,
                b1: float, zero_eps: bool) -> torch.Tensor:
    """acc (num_tensors, NUM_SUMS) float64 + this chunk's `block_sums` added up per tensor
    (in float64) into columns g2 .. p2."""
    per_block = block_sums(x, bc, block_tensor, b1, zero_eps).T.to(torch.float64)
    per_tensor = torch.zeros((acc.shape[0], NUM_SUMS - 1), dtype=torch.float64, device=x.device)
    return acc + torch.nn.functional.pad(per_tensor.index_add(0, block_tensor, per_block), (1, 0))


def bin_index(x: torch.Tensor, bc: torch.Tensor, block_tensor: torch.Tensor, edges: torch.Tensor,
              zero_eps: bool) -> torch.Tensor:
    """Every element's bin of r on edges (ends clipped, last edge in the last bin, NaN in the
    last bin) plus NUM_HIST_BINS x its tensor index: int64 (width,), for one bincount.

    The bin comes from the equal-width formula, corrected by one comparison with each
    neighbouring edge, so it is numpy.histogram's bin of the same value exactly."""
    bc1, bc2, eps = _bias_corrections(bc, block_tensor)
    _, _, _, r = update_direction(x[1].view(-1, BLOCK), x[2].view(-1, BLOCK), bc1, bc2, eps,
                                  zero_eps)
    lo, width = float(HIST_EDGES[0]), float(HIST_EDGES[1] - HIST_EDGES[0])
    idx = torch.nan_to_num((r - lo) / width, nan=NUM_HIST_BINS - 1.0)
    idx = torch.clamp(torch.floor(idx), 0, NUM_HIST_BINS - 1).long()
    idx = idx - (r < edges[idx]).long()                                  # below its left edge
    idx = idx + ((r >= edges[idx + 1]) & (idx < NUM_HIST_BINS - 1)).long()  # at / past its right
    idx = torch.clamp(idx, 0, NUM_HIST_BINS - 1)
    return (idx + block_tensor[:, None] * NUM_HIST_BINS).view(-1)


def _auto_compiles(device: torch.device) -> bool:
    """compile = "auto": on cpu / cuda, unless ADAMSPIKE_TELEMETRY_COMPILE=off (a test suite
    running many short trainings) or TORCHDYNAMO_DISABLE=1."""
    env = os.environ.get("ADAMSPIKE_TELEMETRY_COMPILE", "auto")
    if env not in COMPILE_MODES:
        raise ValueError(f"ADAMSPIKE_TELEMETRY_COMPILE must be one of {COMPILE_MODES}, got {env!r}")
    if env != "auto":
        return env == "on"
    return device.type in ("cpu", "cuda") and os.environ.get("TORCHDYNAMO_DISABLE") != "1"


class _Kernel:
    """fn compiled for the exact arguments it is called with, if mode is "on" or ("auto" and
    `_auto_compiles`), else fn itself (eager).

    Compiling: the call is traced once per argument signature (tensor shapes, dtypes and
    devices; the float arguments as constants) by make_fx into an aten graph that inductor
    compiles (`torch._inductor.compile`); later calls go straight to the compiled code,
    without torch.compile's frame evaluation and guards (~0.1 ms of each call on the tiny
    CPU step; the layout never changes shape, and the compiled code asserts its inputs'
    sizes and strides). On the first failure of a compilation or of a compiled call: one
    warning, then fn eagerly."""

    def __init__(self, fn, mode: str, device: torch.device):
        self.fn = fn
        self.compiled: dict | None = {} if (
            mode == "on" or (mode == "auto" and _auto_compiles(device))) else None

    def _compile(self, args):
        # lazy: inductor is slow to import; only compiled telemetry sums need it
        from torch._inductor import compile as inductor_compile
        from torch.fx.experimental.proxy_tensor import make_fx

        where = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        # the constants only: the graph must not keep this call's tensors alive
        consts = [None if i in where else a for i, a in enumerate(args)]

        def on_tensors(*tensors):
            full = list(consts)
            for i, t in zip(where, tensors):
                full[i] = t
            return self.fn(*full)

        tensors = [args[i] for i in where]
        code = inductor_compile(make_fx(on_tensors)(*tensors), tensors)

        def call(*a):
            out = code(*[a[i] for i in where])
            return out[0] if isinstance(out, (list, tuple)) else out

        return call

    def __call__(self, *args):
        if self.compiled is not None:
            key = tuple((tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor)
                        else (type(a), a) for a in args)
            try:
                if key not in self.compiled:
                    self.compiled[key] = self._compile(args)
                return self.compiled[key](*args)
            except Exception as e:  # noqa: BLE001 - any compiler/backend failure
                warnings.warn(f"telemetry: compiling {self.fn.__name__} failed "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                              "running it eagerly (slower)", RuntimeWarning, stacklevel=2)
                self.compiled = None
        return self.fn(*args)


class _Chunk:
    """One chunk of the layout, built once (shapes do not change): where each segment goes
    in each row of the chunk's buffer, as views shaped like the sources (copying in needs no
    reshape of the source), and the tensor of each BLOCK-wide block.

    Copying in: a run of whole, equal-shaped tensors that fill their blocks exactly lands
    in one `torch.stack(..., out=view)` (one dispatch instead of one per tensor, when the
    sources have the buffer's dtype); the other segments in one `_foreach_copy_`."""

    def __init__(self, segs: list[Segment], shapes, buffer: torch.Tensor, stack: bool):
        self.segs = segs
        starts, a = [], 0
        for _, lo, hi in segs:
            starts.append(a)
            a += _padded(hi - lo, BLOCK)
        # the buffer itself when it is all this chunk's: a view input costs torch.compile's
        # wrapper more per call
        self.x = buffer if a == buffer.shape[1] else buffer[:, :a]
        whole = [lo == 0 and hi == math.prod(shapes[i]) for i, lo, hi in segs]
        runs, k = [], 0          # (first, count) of stackable runs
        while k < len(segs):
            i, lo, hi = segs[k]
            j = k + 1
            if stack and whole[k] and (hi - lo) % BLOCK == 0:
                while (j < len(segs) and whole[j] and tuple(shapes[segs[j][0]]) == tuple(shapes[i])):
                    j += 1
            runs.append((k, j - k))
            k = j
        self.stacked = [(k, n) for k, n in runs if n > 1]
        single = [k for k, n in runs if n == 1]
        self.stacked_src = [[segs[k + q][0] for q in range(n)] for k, n in self.stacked]
        self.single_src = [(segs[k], whole[k]) for k in single]
        self.stacked_dst = [[row[starts[k]:starts[k] + n * (segs[k][2] - segs[k][1])]
                             .view(n, *shapes[segs[k][0]]) for k, n in self.stacked]
                            for row in self.x]
        self.single_dst = [[row[starts[k]:starts[k] + segs[k][2] - segs[k][1]]
                            .view(shapes[segs[k][0]] if whole[k] else (segs[k][2] - segs[k][1],))
                            for k in single] for row in self.x]
        self.block_tensor = torch.tensor([i for i, lo, hi in segs
                                          for _ in range(_padded(hi - lo, BLOCK) // BLOCK)],
                                         device=buffer.device)
        # the chunks share the buffer: another chunk's data may sit in this one's padding
        pad = [torch.arange(s + hi - lo, _padded(s + hi - lo, BLOCK)) for (_, lo, hi), s in zip(segs, starts)]
        self.pad_columns = torch.cat(pad).to(buffer.device) if pad else torch.zeros(0, dtype=torch.long)

    def clear_padding(self) -> None:
        if self.pad_columns.numel():
            self.x.index_fill_(1, self.pad_columns, 0.0)

    def copy_in(self, k: int, locals_: list[torch.Tensor]) -> None:
        """Row k <- the chunk's elements of locals_ (cast to the buffer's dtype); the
        padding keeps its zeros."""
        for dst, idx in zip(self.stacked_dst[k], self.stacked_src):
            torch.stack([locals_[i] for i in idx], out=dst)
        if self.single_src:
            torch._foreach_copy_(self.single_dst[k], [locals_[i] if whole else locals_[i].reshape(-1)[lo:hi]
                                                      for (i, lo, hi), whole in self.single_src])


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
                 every: int = 1, hist_every: int = 0, precision: str = "float32",
                 compile: str = "auto", max_elements: int | None = None,
                 explicit_m_prev: bool = False):
        if precision not in PRECISIONS:
            raise ValueError(f"telemetry: precision must be one of {sorted(PRECISIONS)}, "
                             f"got {precision!r}")
        if compile not in COMPILE_MODES:
            raise ValueError(f"telemetry: compile must be one of {COMPILE_MODES}, got {compile!r}")
        dev = _local(optimizer.param_groups[0]["params"][0]).device
        if max_elements is None:
            max_elements = DEFAULT_MAX_ELEMENTS if dev.type == "cpu" else ACCELERATOR_MAX_ELEMENTS
        if max_elements < 1:
            raise ValueError(f"telemetry: max_elements must be >= 1, got {max_elements}")
        self.optimizer, self.every, self.hist_every = optimizer, int(every), int(hist_every)
        self.max_elements = int(max_elements)
        self.params, self.names, eps = [], [], []
        for group in optimizer.param_groups:
            names = group.get("names") or [f"param{i}" for i in range(len(group["params"]))]
            self.params += list(group["params"])
            self.names += list(names)
            eps += [float(group["eps"])] * len(group["params"])
        group = optimizer.param_groups[0]
        self.b1, self.b2 = group["betas"]
        if any(tuple(g["betas"]) != (self.b1, self.b2) for g in optimizer.param_groups):
            raise ValueError("telemetry: every param group must share betas")
        self.eps = np.asarray(eps, dtype=np.float64)   # per tensor (per-group eps)
        self._zero_eps = bool((self.eps == 0).any())
        self.explicit_m_prev = bool(explicit_m_prev)
        self.device = dev
        # float64 kernels are not dependable on npu: float32 there whatever was asked
        self.dtype = torch.float32 if dev.type == "npu" else PRECISIONS[precision]
        self.edges = rounded_edges(HIST_EDGES, self.dtype).to(dev)
        self.depth = np.array([getattr(specs.get(n), "depth", 0) for n in self.names], dtype=np.int32)
        self.kind = np.array([getattr(specs.get(n), "kind", "param") for n in self.names], dtype=object)
        self.numel = np.array([p.numel() for p in self.params], dtype=np.int64)  # global numel
        self.group = shard_group(self.params)
        self._dtensors = any(hasattr(p, "to_local") for p in self.params)
        shapes = [tuple(_local(p).shape) for p in self.params]
        plan = plan_chunks([math.prod(s) for s in shapes], self.max_elements, BLOCK, shapes)
        width = max((sum(_padded(hi - lo, BLOCK) for _, lo, hi in c) for c in plan), default=0)
        # zeros: the padding must stay 0. Kept between logged steps (on CPU, faulting in
        # fresh pages every step cost more than the math); bounded by max_elements.
        self.buffer = torch.zeros((5 if explicit_m_prev else 4, width), dtype=self.dtype, device=dev)
        stack = all(_local(p).dtype == self.dtype for p in self.params)
        self.chunks = [_Chunk(segs, shapes, self.buffer, stack) for segs in plan]
        pad = np.zeros(len(shapes))
        for segs in plan:
            for i, lo, hi in segs:
                pad[i] += _padded(hi - lo, BLOCK) - (hi - lo)
        self._pad = torch.tensor(pad, dtype=torch.float64, device=dev)
        self._n = torch.tensor([math.prod(s) for s in shapes], dtype=torch.float64, device=dev)
        # n, and the padding's sqrt(0) < eps (subtracted): the start of every step's table
        self._base = torch.zeros((len(shapes), NUM_SUMS), dtype=torch.float64, device=dev)
        self._base[:, _COL["n"]] = self._n
        positive = torch.tensor(self.eps > 0, device=dev)
        self._base[:, _COL["eps_small"]] = torch.where(positive, -self._pad, 0.0)
        self._eps_row = torch.tensor(self.eps, dtype=self.dtype, device=dev)
        self._tensor_sums = _Kernel(tensor_sums, compile, dev)
        self._bin_index = _Kernel(bin_index, compile, dev)
        # compiled kernels on cpu: sums and histograms by the native multi-tensor kernels,
        # which read the tensors in place (fullscale.cpu_kernel; no padding to correct)
        self._native = None
        if dev.type == "cpu" and self._tensor_sums.compiled is not None:
            lib = cpu_kernel.load()
            if lib is not None:
                self._native = cpu_kernel.NativeSums(lib, self.dtype)
                self._native_base = torch.zeros_like(self._base)
                self._native_base[:, _COL["n"]] = self._n
        self._fresh: list[bool] | None = None
        self._m_prev: list[torch.Tensor] | None = None

    def _bias_correction_table(self, steps) -> torch.Tensor:
        """(3, num_tensors) 1 - b1^t, 1 - b2^t of each tensor's Adam step t and its eps, on
        the device.
        Steps kept on an accelerator (capturable / fused AdamW) are read in one go (one
        host sync, not one per tensor); on CPU, int() per tensor is the cheaper (~40 us)."""
        if (steps and all(type(k) is torch.Tensor and k.device == steps[0].device for k in steps)
                and steps[0].device.type != "cpu"):
            steps = torch.stack([k.reshape(()) for k in steps]).tolist()
        t = [int(k) for k in steps]
        bc = torch.tensor([[1 - self.b1 ** k for k in t], [1 - self.b2 ** k for k in t]],
                          dtype=self.dtype, device=self.device)
        return torch.cat([bc, self._eps_row[None]])

    def _sums_in_chunks(self, sources, steps, with_hist: bool) -> torch.Tensor:
        """The table (NUM_SUMS [+ NUM_HIST_BINS] columns) through the chunked buffer: copy
        in, then the `tensor_sums` (and `bin_index`) kernels per chunk."""
        bc = self._bias_correction_table(steps)
        table, hist = self._base, None
        for c in self.chunks:
            if len(self.chunks) > 1:
                c.clear_padding()
            for k, src in enumerate(sources):
                c.copy_in(k, src)
            table = self._tensor_sums(c.x, bc, c.block_tensor, table, self.b1, self._zero_eps)
            if with_hist:
                idx = self._bin_index(c.x, bc, c.block_tensor, self.edges, self._zero_eps)
                counts = torch.bincount(idx, minlength=len(self.params) * NUM_HIST_BINS)
                hist = counts if hist is None else hist + counts
        if with_hist:    # the padding's r = 0 sits in the bin of 0
            hist = hist.view(len(self.params), NUM_HIST_BINS).double()
            hist[:, _ZERO_BIN] -= self._pad
            return torch.cat([table, hist], 1)
        # no chunk (no parameters): do not hand out the base
        return table.clone() if table is self._base else table

    def _native_table(self, sources, steps, with_hist: bool) -> torch.Tensor | None:
        """The table by the native kernel, one call per distinct eps (None when the tensors
        do not qualify)."""
        values = sorted(set(self.eps.tolist()))
        if len(values) == 1:
            return self._native(sources, steps, self._native_base, self.b1, self.b2, values[0],
                                hist=with_hist)
        table = None
        for e in values:
            idx = np.flatnonzero(self.eps == e)
            part = self._native([[src[i] for i in idx] for src in sources],
                                [steps[i] for i in idx], self._native_base[idx], self.b1,
                                self.b2, e, hist=with_hist)
            if part is None:
                return None
            if table is None:
                table = part.new_zeros((len(self.params), part.shape[1]))
            table[torch.from_numpy(idx)] = part
        return table

    def _states(self) -> list:
        """Each parameter's optimizer state dict (None where it has none), by identity:
        `state[p]` would call the Python-level Tensor.__hash__ once per tensor."""
        by_id = {id(k): v for k, v in self.optimizer.state.items()}
        return [by_id.get(id(p)) for p in self.params]

    def active(self, step: int) -> bool:
        return step % self.every == 0

    def hist_active(self, step: int) -> bool:
        return self.hist_every > 0 and step % self.hist_every == 0

    def before_step(self, step: int) -> None:
        """Note the tensors without Adam state yet (their m_prev is 0); with
        explicit_m_prev, copy m_{t-1} (exp_avg as the step will read it: after any
        mitigation's state edit) instead of reconstructing it after the step."""
        if not self.active(step):
            self._fresh = None
            return
        sts = self._states()
        self._fresh = [st is None or "exp_avg" not in st for st in sts]
        if self.explicit_m_prev:
            self._m_prev = [torch.zeros_like(_local(p)) if fresh else _local(st["exp_avg"]).clone()
                            for p, st, fresh in zip(self.params, sts, self._fresh)]

    @torch.no_grad()
    def after_step(self, step: int) -> StepTelemetry | None:
        if not self.active(step):
            return None
        if self._fresh is None:
            raise RuntimeError(f"telemetry: before_step({step}) was not called before the step")
        fresh, self._fresh = self._fresh, None
        with_hist = self.hist_active(step)
        sts = self._states()
        if any(st is None for st in sts):
            missing = [n for n, st in zip(self.names, sts) if st is None]
            raise RuntimeError(f"telemetry: no optimizer state after the step for {missing[:5]} "
                               "(a parameter without a gradient?)")
        sources = ([p.grad for p in self.params], [st["exp_avg"] for st in sts],
                   [st["exp_avg_sq"] for st in sts], self.params)
        if self._dtensors:   # FSDP2: the local shards
            sources = tuple([_local(x) for x in src] for src in sources)
        if self.explicit_m_prev:
            sources, self._m_prev = sources + (self._m_prev,), None
        steps = [st["step"] for st in sts]
        table = None
        if self._native is not None:   # None when the tensors do not qualify
            table = self._native_table(sources, steps, with_hist)
        if table is None:
            table = self._sums_in_chunks(sources, steps, with_hist)
        if any(fresh):   # m_prev = 0 exactly (m_t - (1 - b1) g is rounding noise)
            table = table.clone()
            table[torch.tensor(fresh, device=self.device), _COL["g_mprev"]:_COL["mprev2"] + 1] = 0.0
        _all_reduce(table, self.group)
        table = table.cpu().numpy()
        sums = table[:, :NUM_SUMS]
        metrics = finalize(sums, self.eps if len(set(self.eps)) > 1 else float(self.eps[0]))
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


def vhist_counts(v_hat: torch.Tensor, eps: float, edges: torch.Tensor) -> torch.Tensor:
    """int64 counts (NUM_VHIST_BINS,) of sqrt(v_hat)/eps on `edges` (VHIST_EDGES in v_hat's
    dtype), binned as adamspike.metrics.vhist_bins: torch.bucketize(right=True) - 1 is
    numpy's searchsorted(side="right") - 1; clipped to the bins, NaN to the last."""
    x = v_hat.reshape(-1).sqrt() / eps if eps > 0 else v_hat.reshape(-1).sqrt() / 0.0
    return bin_counts(x, edges[1:-1], NUM_VHIST_BINS)


def telemetry_vhists(telemetry: "Telemetry", step: int) -> np.ndarray | None:
    """sqrt(v_hat)/eps histograms (num_tensors, NUM_VHIST_BINS) int64 on histogram steps
    (telemetry.active and hist_active), else None, with one more column: the coordinates
    with |g| < eps of the gradient AdamW consumed (p.grad after clipping, still set right
    after optimizer.step). Call on every rank after the optimizer
    step: v_hat = exp_avg_sq / (1 - b2^t) of each rank's local shard (FSDP2) is binned in
    the telemetry's compute dtype and the counts are summed across ranks by one all_reduce,
    as the r histograms. The native CPU loop (fullscale.cpu_kernel) is not involved: one
    bucketize + bincount per tensor, on histogram steps only."""
    if not (telemetry.active(step) and telemetry.hist_active(step)):
        return None
    edges = torch.tensor(VHIST_EDGES, dtype=telemetry.dtype, device=telemetry.device)
    table = torch.zeros((len(telemetry.params), NUM_VHIST_BINS + 1), dtype=torch.float64,
                        device=telemetry.device)
    with torch.no_grad():
        for i, (p, st) in enumerate(zip(telemetry.params, telemetry._states())):
            if st is None or "exp_avg_sq" not in st:
                raise RuntimeError(f"telemetry: no optimizer state for {telemetry.names[i]}")
            v = _local(st["exp_avg_sq"]).to(telemetry.dtype)
            bc2 = 1.0 - telemetry.b2 ** int(st["step"])
            eps_i = float(telemetry.eps[i])   # the tensor's own eps (per-group eps)
            table[i, :NUM_VHIST_BINS] = vhist_counts(v / bc2, eps_i, edges).double()
            if p.grad is not None:
                g = _local(p.grad).to(telemetry.dtype)
                table[i, NUM_VHIST_BINS] = float((g.abs() < eps_i).sum())
    _all_reduce(table, telemetry.group)
    return np.rint(table.cpu().numpy()).astype(np.int64)


def write_vhists(telemetry: "Telemetry", writer, step: int, counts: np.ndarray) -> None:
    """Rank 0: the vhists rows of one step (telemetry_vhists' table) into a RunWriter."""
    for i, name in enumerate(telemetry.names):
        writer.log_vhist(step, name, int(telemetry.depth[i]), str(telemetry.kind[i]),
                         counts[i, :NUM_VHIST_BINS], int(counts[i, NUM_VHIST_BINS]))


def shard_group(params):
    """The process group over which the parameters are sharded (FSDP2 DTensors), or None
    for plain tensors: those are whole on every rank and their sums are not reduced."""
    for p in params:
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and mesh.size() > 1 and any(pl.is_shard() for pl in p.placements):
            return mesh.get_group()
    return None


def _all_reduce(t: torch.Tensor, group) -> None:
    if group is not None:
        dist.all_reduce(t, group=group)


class TensorBoardScalars:
    """Optional scalars for TensorBoard: the steps columns, a few per-tensor metrics, and
    the per-group medians the Megatron probe writes too (fullscale.probe.tensorboard)."""

    def __init__(self, log_dir):
        self.writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter   # optional: the tensorboard package
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
            for tag, value in group_medians(out.columns).items():
                self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
