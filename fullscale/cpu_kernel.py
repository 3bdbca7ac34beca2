"""The SUM_FIELDS sums and r histograms of many CPU tensors in one native call, in place.

On the tiny CPU step, fullscale.telemetry's inductor kernels spent more time being fed than
computing: copying g, m, v, p into their buffer (~0.4 ms in-step), and a compiled kernel
that reads the 21 tensors in place instead paid ~0.3 ms in inductor's wrapper (one buffer
per tensor and term). This module is the multi-tensor loop written once in C: for every
tensor, for every BLOCK-element block, the 13 terms of `telemetry.block_sums` are summed
in LANES independent lanes (vectorised by the compiler without reordering any addition),
the lanes are added in order into the block's sum in the compute dtype, and the block sums
into the tensor's float64 total: the precision model of the inductor kernel. A tensor's
last, partial block takes only its own elements (no padding, so no count to correct).
On histogram steps the same pass keeps the block's r and bins it as `telemetry.bin_index`
does (the equal-width guess, clamped, then one comparison with each neighbouring edge;
NaN in the last bin), branch-free so that it vectorises, counted into four interleaved
tables. The tensors come from L3 or memory (the optimizer's passes have evicted most of
them from L2): the loop prefetches PF blocks ahead, and the next tensor's first blocks.

Measured on the tiny model (106,816 elements, 2-core Xeon VM, float32): the C loop takes
0.19 ms with the data in cache and 0.21 ms in-step (0.3 ms before prefetching); the
histogram adds 0.15 ms. In-step the Python around it cost as much as the loop: numpy's
array constructors alone took 78 us with cold caches, so the pointers travel in ctypes
arrays built from plain lists (the call: 0.38 -> 0.29 ms). The inductor path took 0.4 ms
to copy into its buffer, 0.43 ms for the sums kernel and 1.4 ms more on a histogram step.
The loop is divider-bound (five divisions and a square root per element). Tried: float32
reciprocals of 1 - b^t and b1 (0.15 ms in cache, but not the same rounding as a division)
and their exact form, x * (1 / (double)c) rounded to float, which is x / c correctly
rounded (checked for every finite float32 x and 15 divisors c) but slower (0.23 ms): the
kernel keeps the divisions of `block_sums`.

The C source is compiled on first use with the system C compiler ($CC, else cc) at -O3
for this machine's instruction set, and kept in $ADAMSPIKE_KERNEL_DIR (default
~/.cache/adamspike/kernels) under a name that hashes the source, the flags and the CPU's
feature flags (a home directory shared by different CPUs gets one build per CPU kind).
No compiler, a failed build or a failed load: `load` returns None and the caller keeps
its inductor / eager kernels.

Elementwise, exactly the operations of `telemetry.block_sums` (one rounding each in the
compute dtype, no fused multiply-add: -ffp-contract=off):
    m_hat = m / bc1, v_hat = v / bc2, s = sqrt(v_hat), r = m_hat / (s + eps)
    (eps = 0: r = 0 where v_hat = 0), q = g^2 / max(v_hat, eps^2) (eps = 0: 0 where v_hat = 0),
    m_prev = (m - (1 - b1) g) / b1,
    terms g^2, r, r^2, r^2 r, r^2 r^2, q, |r| > 0.9, s < eps, m_hat^2, v_hat, g m_prev,
          m_prev^2, p^2.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from adamspike.metrics import HIST_EDGES, NUM_HIST_BINS, SAT_THRESHOLD, SUM_FIELDS

BLOCK = 256
LANES = 16
NUM_TERMS = len(SUM_FIELDS) - 1   # SUM_FIELDS[1:]: the n column is the caller's
assert NUM_HIST_BINS & (NUM_HIST_BINS - 1) == 0   # the kernel's NaN bin is a mask

_SOURCE = r"""
#include <math.h>
#include <stdint.h>

#define BLOCK %(block)d
#define LANES %(lanes)d
#define NT %(terms)d
#define NB %(bins)d
#ifndef PF
#define PF 2
#endif

/* One element's 13 terms, added into lane accumulators a[k] (k = 0 .. NT-1); with HIST,
   its r is kept in rr[J] for the histogram. */
#define TERMS(T, SQRT, FABS, HIST, G, M, V, P, A, L, J)                              \
  do {                                                                               \
    T g_ = (G), m_ = (M), v_ = (V), p_ = (P);                                        \
    T mh = m_ / c1, vh = v_ / c2, s = SQRT(vh), r = mh / (s + e);                     \
    if (zero_eps && !(vh > 0)) r = 0;                                                \
    if (HIST) rr[J] = r;                                                             \
    T g2 = g_ * g_, r2 = r * r, den = vh > e2 ? vh : e2;                             \
    T q = zero_eps ? (vh > 0 ? g2 / (vh > 0 ? vh : 1) : 0) : g2 / den;               \
    T mp = (m_ - omb1 * g_) / b1t;                                                   \
    A[0][L] += g2; A[1][L] += r; A[2][L] += r2; A[3][L] += r2 * r;                   \
    A[4][L] += r2 * r2; A[5][L] += q; A[6][L] += FABS(r) > sat ? 1 : 0;              \
    A[7][L] += s < e ? 1 : 0; A[8][L] += mh * mh; A[9][L] += vh;                     \
    A[10][L] += g_ * mp; A[11][L] += mp * mp; A[12][L] += p_ * p_;                   \
  } while (0)

/* With HIST, every element's bin of r on the NB + 1 edges (HIST_EDGES rounded up to T) is
   counted into hist[i * stride + bin], as telemetry.bin_index bins it: the equal-width
   guess (NaN in the last bin), clamped, then one comparison with each neighbouring edge. */
#define DEFINE(NAME, IT, T, SQRT, FABS, HIST)                                         \
void NAME(int64_t num, const int64_t *gp, const int64_t *mp_, const int64_t *vp,     \
          const int64_t *pp, const int64_t *numel, const int64_t *stepp,             \
          int step_f64, double b1, double b2, double eps, double *out,               \
          int64_t stride, const T *edges, double lo, double width, double *hist) {   \
  const T b1t = (T)b1, omb1 = (T)(1 - b1), e = (T)eps, e2 = (T)(eps * eps);          \
  const T sat = (T)%(sat)r, lo_ = (T)lo, w = (T)width;                              \
  const int zero_eps = eps == 0;                                                     \
  T rr[BLOCK];                                                                       \
  int32_t bin[BLOCK];                                                                \
  for (int64_t i = 0; i < num; ++i) {                                                \
    const IT *g = (const IT *)gp[i], *m = (const IT *)mp_[i];                        \
    const IT *v = (const IT *)vp[i], *p = (const IT *)pp[i];                         \
    /* Adam's step t of this tensor (a float32 / float64 scalar tensor), truncated   \
       as int() does; the bias corrections as the caller's table: 1 - b^t in double, \
       rounded to T */                                                               \
    const double t = (double)(int64_t)(step_f64 ? *(const double *)stepp[i]          \
                                                : (double)*(const float *)stepp[i]); \
    const T c1 = (T)(1 - pow(b1, t)), c2 = (T)(1 - pow(b2, t));                      \
    const int64_t n = numel[i];                                                      \
    double tot[NT] = {0};                                                            \
    int64_t counts[4][NB] = {{0}};                                                   \
    if (i + 1 < num) {   /* the next tensor's first blocks, which the loop below does not */ \
      const int64_t ahead = numel[i + 1] < PF * BLOCK ? numel[i + 1] : PF * BLOCK;   \
      for (int64_t c = 0; c < ahead * (int64_t)sizeof(IT); c += 64) {                \
        __builtin_prefetch((const char *)gp[i + 1] + c);                             \
        __builtin_prefetch((const char *)mp_[i + 1] + c);                            \
        __builtin_prefetch((const char *)vp[i + 1] + c);                             \
        __builtin_prefetch((const char *)pp[i + 1] + c);                             \
      }                                                                              \
    }                                                                                \
    for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {                                      \
      T a[NT][LANES] = {{0}};                                                        \
      const int64_t len = n - b0 < BLOCK ? n - b0 : BLOCK;                           \
      /* the data comes from L3 or memory after the optimizer's passes: ask ahead */  \
      if (b0 + PF * BLOCK < n)                                                       \
        for (int64_t c = 0; c < BLOCK * (int64_t)sizeof(IT); c += 64) {              \
          __builtin_prefetch((const char *)(g + b0 + PF * BLOCK) + c);               \
          __builtin_prefetch((const char *)(m + b0 + PF * BLOCK) + c);               \
          __builtin_prefetch((const char *)(v + b0 + PF * BLOCK) + c);               \
          __builtin_prefetch((const char *)(p + b0 + PF * BLOCK) + c);               \
        }                                                                            \
      int64_t j = 0;                                                                 \
      for (; j + LANES <= len; j += LANES) {                                         \
        const int64_t o = b0 + j;                                                    \
        for (int l = 0; l < LANES; ++l)                                              \
          TERMS(T, SQRT, FABS, HIST, (T)g[o + l], (T)m[o + l], (T)v[o + l],          \
                (T)p[o + l], a, l, j + l);                                           \
      }                                                                              \
      for (int l = 0; j < len; ++j, ++l)                                             \
        TERMS(T, SQRT, FABS, HIST, (T)g[b0 + j], (T)m[b0 + j], (T)v[b0 + j],         \
              (T)p[b0 + j], a, l, j);                                                \
      for (int k = 0; k < NT; ++k) {                                                 \
        T blk = 0;                                                                   \
        for (int l = 0; l < LANES; ++l) blk += a[k][l];                              \
        tot[k] += (double)blk;                                                       \
      }                                                                              \
      if (HIST) {   /* branch-free, so that it vectorises (edges by gathers) */          \
        for (int64_t q = 0; q < len; ++q) {                                          \
          const T r = rr[q];                                                         \
          T c = (r - lo_) / w;                                                       \
          c = c >= 0 ? c : 0;              /* NaN: 0 here, the last bin below */     \
          c = c < NB - 1 ? c : NB - 1;                                               \
          int32_t k = (int32_t)c;          /* floor, as c >= 0 */                    \
          k -= r < edges[k];                                                         \
          k += (r >= edges[k + 1]) & (k < NB - 1);                                   \
          k = k < 0 ? 0 : k;                                                         \
          k |= -(int32_t)(r != r);                                                   \
          bin[q] = k & (NB - 1);                                                     \
        }                                                                            \
        /* four interleaved tables: runs of one bin do not wait on each other */      \
        for (int64_t q = 0; q < len; ++q) counts[q & 3][bin[q]] += 1;                \
      }                                                                              \
    }                                                                                \
    for (int k = 0; k < NT; ++k) out[i * stride + k] += tot[k];                      \
    if (HIST)                                                                        \
      for (int k = 0; k < NB; ++k)                                                   \
        hist[i * stride + k] += (double)(counts[0][k] + counts[1][k] + counts[2][k]    \
                                         + counts[3][k]);                              \
  }                                                                                  \
}

DEFINE(tensor_sums_f32, float, float, sqrtf, fabsf, 0)
DEFINE(tensor_sums_f64, double, double, sqrt, fabs, 0)
DEFINE(tensor_sums_f32_as_f64, float, double, sqrt, fabs, 0)
DEFINE(tensor_sums_hist_f32, float, float, sqrtf, fabsf, 1)
DEFINE(tensor_sums_hist_f64, double, double, sqrt, fabs, 1)
DEFINE(tensor_sums_hist_f32_as_f64, float, double, sqrt, fabs, 1)
""" % {"block": BLOCK, "lanes": LANES, "terms": NUM_TERMS, "bins": NUM_HIST_BINS,
     "sat": float(SAT_THRESHOLD)}

# (tensors' dtype, compute dtype) -> the suffix of the tensor_sums_* / tensor_hist_* functions
KERNELS = {(torch.float32, torch.float32): "f32",
           (torch.float64, torch.float64): "f64",
           (torch.float32, torch.float64): "f32_as_f64"}
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]
_LOADED: dict[str, object] = {}


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _library_path() -> Path:
    key = hashlib.sha256("\0".join([_SOURCE, *_FLAGS, platform.machine(), _cpu_features()])
                         .encode()).hexdigest()[:16]
    root = Path(os.environ.get("ADAMSPIKE_KERNEL_DIR")
                or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "adamspike" / "kernels")
    return root / f"telemetry_sums_{key}.so"


def _build(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, lib = Path(tmp) / "sums.c", Path(tmp) / "sums.so"
        src.write_text(_SOURCE)
        cc = os.environ.get("CC", "cc")
        run = subprocess.run([cc, *_FLAGS, str(src), "-o", str(lib), "-lm"],
                             capture_output=True, text=True, timeout=120)
        if run.returncode:
            raise RuntimeError(f"{cc} failed: {run.stderr.strip()[-500:]}")
        os.replace(lib, path)   # atomic: concurrent builders leave one whole library


def load():
    """The ctypes library (built on first use), or None (with one warning) if it cannot be
    built or loaded here."""
    path = _library_path()
    if str(path) in _LOADED:
        return _LOADED[str(path)]
    lib = None
    try:
        if not path.exists():
            _build(path)
        lib = ctypes.CDLL(str(path))
        i64, ptr, f64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
        for suffix in KERNELS.values():
            for name in ("tensor_sums_", "tensor_sums_hist_"):
                fn = getattr(lib, name + suffix)
                fn.restype = None
                fn.argtypes = ([i64] + [ptr] * 6 + [ctypes.c_int] + [f64] * 3 + [ptr, i64, ptr]
                               + [f64] * 2 + [ptr])
    except Exception as e:  # noqa: BLE001 - no compiler, sandboxed dlopen, ...
        warnings.warn(f"telemetry: the native CPU sums kernel is unavailable ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}); using the other kernels",
                      RuntimeWarning, stacklevel=2)
        lib = None
    _LOADED[str(path)] = lib
    return lib


class NativeSums:
    """The SUM_FIELDS sums (and the r histogram) of contiguous CPU tensors all of one dtype,
    float32 or float64, computed in `dtype` (float32 tensors in float64 too, as the buffer
    path's cast); `__call__` returns None when the inputs do not qualify (the caller then
    uses its other kernels)."""

    def __init__(self, lib, dtype: torch.dtype, edges: torch.Tensor):
        """edges: HIST_EDGES rounded up to `dtype` (fullscale.telemetry's `_edges`)."""
        assert edges.dtype == dtype and edges.is_cpu and edges.numel() == NUM_HIST_BINS + 1
        self.dtype, self.edges = dtype, edges.contiguous()
        self._fns = {(input_dt, hist): getattr(lib, ("tensor_sums_hist_" if hist else "tensor_sums_")
                                               + suffix)
                     for (input_dt, compute_dt), suffix in KERNELS.items() if compute_dt == dtype
                     for hist in (False, True)}
        self._lo, self._width = float(HIST_EDGES[0]), float(HIST_EDGES[1] - HIST_EDGES[0])

    def __call__(self, sources, steps, acc: torch.Tensor, b1: float, b2: float, eps: float,
                 hist: bool = False) -> torch.Tensor | None:
        """sources: (grads, exp_avgs, exp_avg_sqs, params) lists of equal-sized tensors;
        steps: each tensor's Adam step, a one-element CPU tensor (AdamW's state["step"]),
        all float32 or all float64; acc: (num_tensors, NUM_SUMS) float64, not modified.
        Returns a new float64 table: acc + the sums in columns 1.., and with `hist` the
        NUM_HIST_BINS counts of r after them (exact integers).

        Called every logged step: in-step, with cold caches, each Python-level call costs
        (numpy's array constructors took 78 us of it), so the pointers go to C in ctypes
        arrays built from plain lists."""
        num = len(steps)
        dt = sources[0][0].dtype if num and sources[0][0] is not None else None
        fn = self._fns.get((dt, hist))
        if fn is None or any(len(src) != num for src in sources):
            return None
        ptrs, sizes = [], []
        for src in sources:
            for t in src:   # the cheap attributes (t.device builds an object per call)
                if t is None or t.dtype is not dt or not t.is_cpu or not t.is_contiguous():
                    return None
                ptrs.append(t.data_ptr())
                sizes.append(t.numel())
        step_dt = steps[0].dtype if type(steps[0]) is torch.Tensor else None
        if step_dt not in (torch.float32, torch.float64):
            return None
        for k in steps:   # each a one-element CPU tensor (not an int: AdamW's tensor steps)
            if type(k) is not torch.Tensor or k.dtype is not step_dt or not k.is_cpu or k.numel() != 1:
                return None
            ptrs.append(k.data_ptr())
        numel = sizes[:num]
        if any(sizes[j * num:(j + 1) * num] != numel for j in range(1, len(sources))):
            return None   # the kernel reads numel elements of each
        ptr_array = (ctypes.c_int64 * len(ptrs))(*ptrs)
        numel_array = (ctypes.c_int64 * num)(*numel)
        at = ctypes.addressof(ptr_array)
        table = torch.cat([acc, acc.new_zeros((num, NUM_HIST_BINS))], 1) if hist else acc.clone()
        stride, base = table.shape[1], table.data_ptr()
        fn(num, at, at + 8 * num, at + 16 * num, at + 24 * num, ctypes.addressof(numel_array),
           at + 32 * num, int(step_dt == torch.float64), float(b1), float(b2), float(eps),
           base + 8, stride, self.edges.data_ptr(), self._lo, self._width,
           base + 8 * (NUM_TERMS + 1) if hist else None)
        return table
