"""simulate.telemetry's sums and histograms on CPU by adamspike.native's C loop, as an XLA
FFI custom call inside the jitted step.

XLA:CPU compiles the telemetry's variadic column reduce to scalar code (~3-7 ns per
element; its fast-math flag would vectorise it, but that flag is process-wide and changes
training numerics). The FFI handler reads g, mu_t, nu_t, mu_{t-1} and p of every tensor in
place (one pass, five streams, the gradient's clip factor applied inside) and writes the
(num_tensors, NUM_SUMS) sums in the compute dtype (block sums in that dtype, totals in
float64 before the final rounding) and, on histogram steps, the int32 counts of r.

Under vmap (sweeps over seeds or configurations) the call is made once with every input
broadcast to the batch (vmap_method="broadcast_all") and the handler loops over the batch.

Used by `step_telemetry` when the call qualifies: the CPU backend, eps > 0 known at trace
time (a zero eps, or a traced one not declared positive, keeps XLA's path: its r is NaN
where v_hat = 0 = eps, which the loop would count as 0), every leaf of the compute dtype
(float32, or float64 under x64). b1 and eps reach the loop as an operand, their float64
bit patterns (uint32[4], `exact_bits`), not as attributes: a program traced with them as
inputs serves every (b1, eps), so settings that differ only there compile one step. Built on first use (~5 s; adamspike.native.build_library against
jaxlib's FFI headers); if that fails, one warning and XLA's path.
"""

from __future__ import annotations

import ctypes
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from adamspike import native
from adamspike.metrics import NUM_HIST_BINS, SUM_FIELDS

TARGET = "adamspike_telemetry_sums"
NUM_SUMS = len(SUM_FIELDS)

_BINDING = r"""
namespace ffi = xla::ffi;

/* consts: b1 and eps as float64 bit patterns (batch x 4 uint32); args: bc1, bc2, scale
   (each of the batch's shape), then g, mu_t, nu_t, mu_{t-1}, p of the num tensors (each
   batch x tensor); rets: sums (batch x num x (NT + 1)) and, with hist, counts
   (batch x num x NB, int32) */
static ffi::Error Impl(ffi::AnyBuffer consts, ffi::RemainingArgs args, ffi::RemainingRets rets,
                       int64_t num, bool hist) {
  if (consts.element_type() != ffi::DataType::U32)
    return ffi::Error::InvalidArgument("adamspike telemetry: b1, eps bits must be uint32");
  if (num < 1 || (int64_t)args.size() != 3 + 5 * num)
    return ffi::Error::InvalidArgument("adamspike telemetry: wrong number of operands");
  auto first = args.get<ffi::AnyBuffer>(0);
  if (!first.has_value()) return first.error();
  const ffi::DataType dt = first->element_type();
  if (dt != ffi::DataType::F32 && dt != ffi::DataType::F64)
    return ffi::Error::InvalidArgument("adamspike telemetry: float32 or float64 only");
  const bool f64 = dt == ffi::DataType::F64;
  const size_t width = f64 ? 8 : 4;
  const int64_t batch = (int64_t)first->element_count();
  if ((int64_t)consts.element_count() != 4 * batch)
    return ffi::Error::InvalidArgument("adamspike telemetry: b1, eps bits differ in batch");
  const uint32_t *bits = (const uint32_t *)consts.untyped_data();
  std::vector<const char *> base(3 + 5 * num);
  std::vector<int64_t> numel(num);
  for (int64_t j = 0; j < 3 + 5 * num; ++j) {
    auto buf = args.get<ffi::AnyBuffer>(j);
    if (!buf.has_value()) return buf.error();
    if (buf->element_type() != dt)
      return ffi::Error::InvalidArgument("adamspike telemetry: mixed dtypes");
    const int64_t count = (int64_t)buf->element_count();
    if (batch == 0 || count % batch)
      return ffi::Error::InvalidArgument("adamspike telemetry: operands differ in batch");
    if (j < 3 && count != batch)
      return ffi::Error::InvalidArgument("adamspike telemetry: scalars differ in batch");
    if (j >= 3) {
      const int64_t i = (j - 3) % num;
      if (j < 3 + num) numel[i] = count / batch;
      else if (numel[i] != count / batch)
        return ffi::Error::InvalidArgument("adamspike telemetry: tensor sizes differ");
    }
    base[j] = (const char *)buf->untyped_data();
  }
  auto out = rets.get<ffi::AnyBuffer>(0);
  if (!out.has_value()) return out.error();
  if ((int64_t)(*out)->element_count() != batch * num * (NT + 1))
    return ffi::Error::InvalidArgument("adamspike telemetry: sums of the wrong shape");
  int32_t *counts = NULL;
  if (hist) {
    auto h = rets.get<ffi::AnyBuffer>(1);
    if (!h.has_value()) return h.error();
    if ((int64_t)(*h)->element_count() != batch * num * NB)
      return ffi::Error::InvalidArgument("adamspike telemetry: counts of the wrong shape");
    counts = (int32_t *)(*h)->untyped_data();
  }
  kernel_fn fn = pick_kernel(f64, f64, hist, 1);
  const int64_t stride = NT + 1 + (hist ? NB : 0);
  std::vector<int64_t> ptrs(5 * num);
  std::vector<double> c1(num), c2(num), table(num * stride);
  for (int64_t b = 0; b < batch; ++b) {
    double sc[3], b1, eps;
    std::memcpy(&b1, bits + 4 * b, 8);
    std::memcpy(&eps, bits + 4 * b + 2, 8);
    for (int k = 0; k < 3; ++k)
      sc[k] = f64 ? ((const double *)base[k])[b] : (double)((const float *)base[k])[b];
    for (int64_t k = 0; k < 5; ++k)
      for (int64_t i = 0; i < num; ++i)
        ptrs[k * num + i] = (int64_t)(intptr_t)(base[3 + k * num + i] + b * numel[i] * width);
    for (int64_t i = 0; i < num; ++i) { c1[i] = sc[0]; c2[i] = sc[1]; }
    std::fill(table.begin(), table.end(), 0.0);
    const int64_t *p = ptrs.data();
    fn(num, p, p + num, p + 2 * num, p + 3 * num, p + 4 * num, numel.data(), c1.data(),
       c2.data(), b1, eps, sc[2], table.data() + 1, stride, hist ? table.data() + NT + 1 : NULL);
    for (int64_t i = 0; i < num; ++i) {
      table[i * stride] = (double)numel[i];
      for (int k = 0; k <= NT; ++k) {
        const int64_t o = (b * num + i) * (NT + 1) + k;
        if (f64) ((double *)(*out)->untyped_data())[o] = table[i * stride + k];
        else ((float *)(*out)->untyped_data())[o] = (float)table[i * stride + k];
      }
      if (hist)
        for (int k = 0; k < NB; ++k)
          counts[(b * num + i) * NB + k] = (int32_t)table[i * stride + NT + 1 + k];
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(AdamspikeTelemetrySums, Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_tensors")
                                  .Attr<bool>("hist"));
"""

_SOURCE = ('#include "xla/ffi/api/ffi.h"\n#include <algorithm>\n#include <cstring>\n#include <vector>\n'
           + native.KERNEL_SOURCE + _BINDING)
_STATE: dict[str, bool] = {}


def available() -> bool:
    """Whether the FFI target is registered (built and registered on the first call; one
    warning and False if that fails)."""
    if "ok" in _STATE:
        return _STATE["ok"]
    ok = False
    try:
        path = native.build_library("adamspike_telemetry_ffi.so", _SOURCE,
                                    [f"-I{jax.ffi.include_dir()}"], [],
                                    key=f"jax {jax.__version__}")
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.AdamspikeTelemetrySums),
                                    platform="cpu")
        ok = True
    except Exception as e:  # noqa: BLE001 - no compiler, no headers, old jaxlib, ...
        warnings.warn(f"simulate telemetry: the native CPU kernel is unavailable "
                      f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                      "using XLA's reductions", RuntimeWarning, stacklevel=2)
    _STATE["ok"] = ok
    return ok


def usable(leaves, dt, b1, b2, eps, eps_positive: bool = False) -> bool:
    """The conditions of the module docstring, checked at trace time: b1, b2, eps static
    Python numbers with eps > 0, or traced with `eps_positive` (static) declaring eps > 0."""
    static = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (b1, b2, eps))
    return ((static and eps > 0 or eps_positive) and jax.default_backend() == "cpu"
            and np.dtype(dt) in (np.dtype(np.float32), np.dtype(np.float64))
            and all(x.dtype == dt for xs in leaves for x in xs) and available())


def exact_bits(b1: float, eps: float) -> np.ndarray:
    """uint32[4]: the float64 bit patterns of b1 and eps, the loop's exact constants (a
    float32 input would round them: the loop computes eps^2 in double)."""
    return np.array([b1, eps], np.float64).view(np.uint32)


def step_sums(g_l, mu_l, nu_l, mp_l, p_l, bc1, bc2, scale, b1, eps, dt, with_hist: bool,
              bits=None):
    """(sums (num_tensors, NUM_SUMS) in dt, hists (num_tensors, NUM_HIST_BINS) int32 or
    None), as simulate.telemetry.step_telemetry returns them. bits: exact_bits(b1, eps),
    traced; None: made from b1 and eps (static floats)."""
    num = len(g_l)
    shapes = [jax.ShapeDtypeStruct((num, NUM_SUMS), dt)]
    if with_hist:
        shapes.append(jax.ShapeDtypeStruct((num, NUM_HIST_BINS), jnp.int32))
    scalars = [jnp.asarray(x, dt).reshape(()) for x in (bc1, bc2, 1.0 if scale is None else scale)]
    bits = jnp.asarray(exact_bits(b1, eps) if bits is None else bits, jnp.uint32).reshape(4)
    out = jax.ffi.ffi_call(TARGET, shapes, vmap_method="broadcast_all")(
        bits, *scalars, *g_l, *mu_l, *nu_l, *mp_l, *p_l, num_tensors=np.int64(num),
        hist=bool(with_hist))
    return (out[0], out[1]) if with_hist else (out[0], None)
