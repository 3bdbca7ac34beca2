"""The telemetry sums loop in C, shared by both backends' native CPU kernels, and its build.

fullscale/cpu_kernel.py binds it to torch (a C++ extension module that unpacks tensors),
simulate/native_telemetry.py to XLA (an FFI custom call inside the jitted step). This
module imports neither framework: it holds the C source and compiles a binding's C++
source into a cached shared library.

The loop (`KERNEL_SOURCE`, C that is also C++): for every tensor, for every BLOCK-element
block, the 13 terms of SUM_FIELDS[1:] are summed in LANES independent lanes (vectorised by
the compiler without reordering any addition), the lanes are added in order into the
block's sum in the compute dtype T, and the block sums into the tensor's float64 total. A
tensor's last, partial block takes only its own elements (no padding, so no count to
correct). Per element, one rounding each in T, no fused multiply-add (-ffp-contract=off):

    g = g * gscale, m_hat = m / c1, v_hat = v / c2, s = sqrt(v_hat), r = m_hat / (s + eps)
    (eps = 0: r = 0 where v_hat = 0), q = g^2 / max(v_hat, eps^2) (eps = 0: 0 where
    v_hat = 0), m_prev = the input m_prev, or (m - (1 - b1) g) / b1 (torch: AdamW keeps no
    copy), terms g^2, r, r^2, r^2 r, r^2 r^2, q, |r| > 0.9, s < eps, m_hat^2, v_hat,
    g m_prev, m_prev^2, p^2

with c1 = 1 - b1^t, c2 = 1 - b2^t given per tensor (as double, rounded to T). On histogram
steps the same pass keeps the block's r and bins it as the frameworks' `bin_index` /
`hist_bins` do (HIST_EDGES rounded up to T; the equal-width guess, clamped, then one
comparison with each neighbouring edge; NaN in the last bin), branch-free so that it vectorises (edges by gathers), counted
into four interleaved tables. The tensors come from L3 or memory after the optimizer's
passes: the loop prefetches PF blocks ahead, and the next tensor's first blocks.

Functions: tensor_sums[_hist][_mprev]_{f32, f64, f32_as_f64} (input dtype, compute dtype),
    (num, g, m, v, m_prev, p: int64 arrays of num data pointers (m_prev unused without
     _mprev), numel, c1, c2, b1, eps, gscale, out, stride, hist)
adding the 13 sums of tensor i into out[i * stride + 0..12] and, with _hist, its
NUM_HIST_BINS counts into hist[i * stride + 0..63].

Build: `build_library(name, source, cflags, ldflags, key)` compiles with the system C++
compiler ($CXX, else c++) at -O3 for this machine's instruction set, into
$ADAMSPIKE_KERNEL_DIR (default ~/.cache/adamspike/kernels) under a directory that hashes
the source, the flags, the CPU's feature flags, the compiler and the caller's key (its
framework's version); written by atomic rename, so concurrent builders leave one whole
library.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

from adamspike.metrics import HIST_EDGES, NUM_HIST_BINS, SAT_THRESHOLD, SUM_FIELDS

BLOCK = 256
LANES = 16
NUM_TERMS = len(SUM_FIELDS) - 1   # SUM_FIELDS[1:]: the n column is the caller's
assert NUM_HIST_BINS & (NUM_HIST_BINS - 1) == 0   # the kernel's NaN bin is a mask

KERNEL_SOURCE = r"""
#include <math.h>
#include <stdint.h>

#define BLOCK %(block)d
#define LANES %(lanes)d
#define NT %(terms)d
#define NB %(bins)d
#ifndef PF
#define PF 2
#endif
#define HIST_LO %(lo)r
#define HIST_WIDTH %(width)r

/* HIST_EDGES (float64); the kernels round them up to T: x >= e_T <=> x >= e for x in T */
static const double kHistEdges[NB + 1] = {%(edges)s};

/* One element's 13 terms, added into lane accumulators a[k] (k = 0 .. NT-1); with HIST,
   its r is kept in rr[J] for the histogram. */
#define TERMS(T, SQRT, FABS, HIST, MPREV, G, M, V, MP, P, A, L, J)                   \
  do {                                                                               \
    T g_ = (G) * gs, m_ = (M), v_ = (V), p_ = (P);                                   \
    T mh = m_ / c1, vh = v_ / c2, s = SQRT(vh), r = mh / (s + e);                     \
    if (zero_eps && !(vh > 0)) r = 0;                                                \
    if (HIST) rr[J] = r;                                                             \
    T g2 = g_ * g_, r2 = r * r, den = vh > e2 ? vh : e2;                             \
    T q = zero_eps ? (vh > 0 ? g2 / (vh > 0 ? vh : 1) : 0) : g2 / den;               \
    T mp = MPREV ? (MP) : (m_ - omb1 * g_) / b1t;                                    \
    A[0][L] += g2; A[1][L] += r; A[2][L] += r2; A[3][L] += r2 * r;                   \
    A[4][L] += r2 * r2; A[5][L] += q; A[6][L] += FABS(r) > sat ? 1 : 0;              \
    A[7][L] += s < e ? 1 : 0; A[8][L] += mh * mh; A[9][L] += vh;                     \
    A[10][L] += g_ * mp; A[11][L] += mp * mp; A[12][L] += p_ * p_;                   \
  } while (0)

#define PREFETCH(PTR, BYTES)                                                         \
  for (int64_t c_ = 0; c_ < (BYTES); c_ += 64) __builtin_prefetch((const char *)(PTR) + c_)

#define DEFINE(NAME, IT, T, SQRT, FABS, NEXTAFTER, HIST, MPREV)                       \
static void NAME(int64_t num, const int64_t *gp, const int64_t *mp_, const int64_t *vp, \
                 const int64_t *mprevp, const int64_t *pp, const int64_t *numel,     \
                 const double *c1s, const double *c2s, double b1, double eps,        \
                 double gscale, double *out, int64_t stride, double *hist) {         \
  T edges[NB + 1];                                                                   \
  for (int k = 0; k <= NB; ++k) {                                                    \
    edges[k] = (T)kHistEdges[k];                                                     \
    if ((double)edges[k] < kHistEdges[k]) edges[k] = NEXTAFTER(edges[k], (T)INFINITY); \
  }                                                                                  \
  const T b1t = (T)b1, omb1 = (T)(1 - b1), e = (T)eps, e2 = (T)(eps * eps);          \
  const T sat = (T)%(sat)r, lo_ = (T)HIST_LO, w = (T)HIST_WIDTH, gs = (T)gscale;    \
  const int zero_eps = eps == 0;                                                     \
  T rr[BLOCK];                                                                       \
  int32_t bin[BLOCK];                                                                \
  for (int64_t i = 0; i < num; ++i) {                                                \
    const IT *g = (const IT *)gp[i], *m = (const IT *)mp_[i];                        \
    const IT *v = (const IT *)vp[i], *p = (const IT *)pp[i];                         \
    const IT *mv = MPREV ? (const IT *)mprevp[i] : m;                                \
    const T c1 = (T)c1s[i], c2 = (T)c2s[i];                                          \
    const int64_t n = numel[i];                                                      \
    double tot[NT] = {0};                                                            \
    int64_t counts[4][NB] = {{0}};                                                   \
    if (i + 1 < num) {   /* the next tensor's first blocks, which the loop does not */ \
      const int64_t ahead = (numel[i + 1] < PF * BLOCK ? numel[i + 1] : PF * BLOCK)  \
                            * (int64_t)sizeof(IT);                                   \
      PREFETCH(gp[i + 1], ahead); PREFETCH(mp_[i + 1], ahead);                       \
      PREFETCH(vp[i + 1], ahead); PREFETCH(pp[i + 1], ahead);                        \
      if (MPREV) PREFETCH(mprevp[i + 1], ahead);                                     \
    }                                                                                \
    for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {                                      \
      T a[NT][LANES] = {{0}};                                                        \
      const int64_t len = n - b0 < BLOCK ? n - b0 : BLOCK;                           \
      if (b0 + PF * BLOCK < n) {                                                     \
        const int64_t o = b0 + PF * BLOCK, bytes = BLOCK * (int64_t)sizeof(IT);      \
        PREFETCH(g + o, bytes); PREFETCH(m + o, bytes);                              \
        PREFETCH(v + o, bytes); PREFETCH(p + o, bytes);                              \
        if (MPREV) PREFETCH(mv + o, bytes);                                          \
      }                                                                              \
      int64_t j = 0;                                                                 \
      for (; j + LANES <= len; j += LANES) {                                         \
        const int64_t o = b0 + j;                                                    \
        for (int l = 0; l < LANES; ++l)                                              \
          TERMS(T, SQRT, FABS, HIST, MPREV, (T)g[o + l], (T)m[o + l], (T)v[o + l],   \
                (T)mv[o + l], (T)p[o + l], a, l, j + l);                             \
      }                                                                              \
      for (int l = 0; j < len; ++j, ++l)                                             \
        TERMS(T, SQRT, FABS, HIST, MPREV, (T)g[b0 + j], (T)m[b0 + j], (T)v[b0 + j],  \
              (T)mv[b0 + j], (T)p[b0 + j], a, l, j);                                 \
      for (int k = 0; k < NT; ++k) {                                                 \
        T blk = 0;                                                                   \
        for (int l = 0; l < LANES; ++l) blk += a[k][l];                              \
        tot[k] += (double)blk;                                                       \
      }                                                                              \
      if (HIST) {                                                                    \
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

#define DEFINE_ALL(SUFFIX, IT, T, SQRT, FABS, NEXTAFTER)                              \
  DEFINE(tensor_sums_##SUFFIX, IT, T, SQRT, FABS, NEXTAFTER, 0, 0)                    \
  DEFINE(tensor_sums_hist_##SUFFIX, IT, T, SQRT, FABS, NEXTAFTER, 1, 0)               \
  DEFINE(tensor_sums_mprev_##SUFFIX, IT, T, SQRT, FABS, NEXTAFTER, 0, 1)              \
  DEFINE(tensor_sums_hist_mprev_##SUFFIX, IT, T, SQRT, FABS, NEXTAFTER, 1, 1)

DEFINE_ALL(f32, float, float, sqrtf, fabsf, nextafterf)
DEFINE_ALL(f64, double, double, sqrt, fabs, nextafter)
DEFINE_ALL(f32_as_f64, float, double, sqrt, fabs, nextafter)

typedef void (*kernel_fn)(int64_t, const int64_t *, const int64_t *, const int64_t *,
                          const int64_t *, const int64_t *, const int64_t *, const double *,
                          const double *, double, double, double, double *, int64_t,
                          double *);

/* the kernel for (input float64?, compute float64?, hist, mprev), or NULL */
static kernel_fn pick_kernel(int in_f64, int compute_f64, int hist, int mprev) {
#define PICK(SUFFIX) (hist ? (mprev ? tensor_sums_hist_mprev_##SUFFIX : tensor_sums_hist_##SUFFIX) \
                           : (mprev ? tensor_sums_mprev_##SUFFIX : tensor_sums_##SUFFIX))
  if (!in_f64 && !compute_f64) return PICK(f32);
  if (in_f64 && compute_f64) return PICK(f64);
  if (!in_f64 && compute_f64) return PICK(f32_as_f64);
  return NULL;
#undef PICK
}
""" % {"block": BLOCK, "lanes": LANES, "terms": NUM_TERMS, "bins": NUM_HIST_BINS,
       "sat": float(SAT_THRESHOLD), "lo": float(HIST_EDGES[0]),
       "width": float(HIST_EDGES[1] - HIST_EDGES[0]),
       "edges": ", ".join(repr(float(e)) for e in HIST_EDGES)}

FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-std=c++17",
         "-shared", "-fPIC", "-w"]


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def library_path(file_name: str, source: str, cflags, ldflags, key: str) -> Path:
    """Where the build of `source` goes: one directory per source, flags, CPU kind,
    compiler and key."""
    digest = hashlib.sha256("\0".join([source, *FLAGS, *cflags, *ldflags, platform.machine(),
                                       _cpu_features(), os.environ.get("CXX", "c++"), key])
                            .encode()).hexdigest()[:16]
    root = Path(os.environ.get("ADAMSPIKE_KERNEL_DIR")
                or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "adamspike" / "kernels")
    return root / digest / file_name


def build_library(file_name: str, source: str, cflags=(), ldflags=(), key: str = "") -> Path:
    """The compiled library of C++ `source` (built on first use, then cached); raises
    RuntimeError with the compiler's message if it does not build."""
    path = library_path(file_name, source, cflags, ldflags, key)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, lib = Path(tmp) / "kernel.cpp", Path(tmp) / file_name
        src.write_text(source)
        cxx = os.environ.get("CXX", "c++")
        try:
            run = subprocess.run([cxx, *FLAGS, *cflags, str(src), "-o", str(lib), *ldflags],
                                 capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"{cxx}: {e}") from e
        if run.returncode:
            raise RuntimeError(f"{cxx} failed: {run.stderr.strip()[-500:]}")
        os.replace(lib, path)   # atomic: concurrent builders leave one whole library
    return path
