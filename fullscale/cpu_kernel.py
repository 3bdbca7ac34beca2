"""The SUM_FIELDS sums and r histograms of many CPU tensors in one native call, in place.

On the tiny CPU step, fullscale.telemetry's inductor kernels spent more time being fed than
computing: copying g, m, v, p into their buffer (~0.4 ms in-step), and a compiled kernel
that reads the 21 tensors in place instead paid ~0.3 ms in inductor's wrapper (one buffer
per tensor and term). This module binds adamspike.native's C loop (the same elementwise
operations as `telemetry.block_sums`, block sums in the compute dtype, totals in float64:
the precision model of the inductor kernel) to torch: a small C++ extension module whose
one function `sums` takes the Python lists of tensors and unpacks them in C++ (pointers,
dtypes, sizes, contiguity), reads each tensor's Adam step and computes its bias
corrections 1 - b^t in double, as `Telemetry._bias_correction_table` does. m_prev is an
explicit input list when the trainer copies it (a state-editing mitigation), else it is
reconstructed from AdamW's m_t (fullscale.telemetry's docstring). Unpacking in C++ matters:
reading those attributes from Python for many small tensors costs more than the loop. The
loop keeps true divisions (reciprocal multiplies would not round as the other kernels do).

Built on first use (~10-15 s; adamspike.native.build_library) against the running
torch's headers and libraries (as torch.utils.cpp_extension would, without its setuptools
import), keyed by torch's and Python's versions. No compiler, no headers, a failed build
or a failed load: `load` returns None (one warning) and the caller keeps its inductor /
eager kernels.
"""

from __future__ import annotations

import importlib.util
import sys
import sysconfig
import warnings
from pathlib import Path

import torch

from adamspike import native

MODULE = "adamspike_telemetry_native"

_BINDING = r"""
/* ---- torch binding: sums(grads, exp_avgs, exp_avg_sqs, params, steps, acc, b1, b2, eps,
   hist, compute_f64[, m_prevs]) -> the float64 table, or None if the inputs do not qualify;
   without m_prevs (or None) the kernel reconstructs m_prev from AdamW's rule */

/* ptrs[i], sizes[i] of the list's tensors; false unless each is a defined, contiguous CPU
   tensor of dtype dt with storage (a DTensor wrapper has none) and, given sizes_in, of
   those sizes */
static bool gather(PyObject *list, Py_ssize_t num, c10::ScalarType dt, int64_t *ptrs,
                   int64_t *sizes, const int64_t *sizes_in) {
  if (!PyList_Check(list) || PyList_GET_SIZE(list) != num) return false;
  for (Py_ssize_t i = 0; i < num; ++i) {
    PyObject *o = PyList_GET_ITEM(list, i);
    if (!THPVariable_Check(o)) return false;   /* None (no gradient), not a tensor */
    const at::Tensor &t = THPVariable_Unpack(o);
    if (!t.defined() || !t.has_storage() || t.scalar_type() != dt || !t.device().is_cpu()
        || !t.is_contiguous() || (sizes_in && t.numel() != sizes_in[i]))
      return false;
    ptrs[i] = (int64_t)(intptr_t)t.const_data_ptr();
    if (sizes) sizes[i] = t.numel();
  }
  return true;
}

static PyObject *sums(PyObject *, PyObject *args) {
  PyObject *lists[5], *acc_obj, *mprev_obj = Py_None;
  double b1, b2, eps;
  int hist, compute_f64;
  if (!PyArg_ParseTuple(args, "OOOOOOdddpp|O", &lists[0], &lists[1], &lists[2], &lists[3],
                        &lists[4], &acc_obj, &b1, &b2, &eps, &hist, &compute_f64, &mprev_obj))
    return NULL;
  const int mprev = mprev_obj != Py_None;
  try {
    if (!PyList_Check(lists[4]) || !THPVariable_Check(acc_obj))
      Py_RETURN_NONE;
    const Py_ssize_t num = PyList_GET_SIZE(lists[4]);
    if (num == 0 || !PyList_Check(lists[0]) || PyList_GET_SIZE(lists[0]) != num
        || !THPVariable_Check(PyList_GET_ITEM(lists[0], 0)))
      Py_RETURN_NONE;
    const c10::ScalarType dt = THPVariable_Unpack(PyList_GET_ITEM(lists[0], 0)).scalar_type();
    if (dt != at::kFloat && dt != at::kDouble) Py_RETURN_NONE;
    kernel_fn fn = pick_kernel(dt == at::kDouble, compute_f64, hist, mprev);
    if (!fn) Py_RETURN_NONE;
    std::vector<int64_t> ptrs(4 * num), numel(num), mprev_ptrs(num);
    std::vector<double> c1(num), c2(num);
    if (!gather(lists[0], num, dt, ptrs.data(), numel.data(), NULL)) Py_RETURN_NONE;
    for (int k = 1; k < 4; ++k)   /* exp_avg, exp_avg_sq, param: the gradient's sizes */
      if (!gather(lists[k], num, dt, ptrs.data() + k * num, NULL, numel.data())) Py_RETURN_NONE;
    if (mprev && !gather(mprev_obj, num, dt, mprev_ptrs.data(), NULL, numel.data()))
      Py_RETURN_NONE;
    /* steps: one-element CPU tensors, float32 or float64 (AdamW's state["step"]); the bias
       corrections of its integer value, in double */
    for (Py_ssize_t i = 0; i < num; ++i) {
      PyObject *o = PyList_GET_ITEM(lists[4], i);
      if (!THPVariable_Check(o)) Py_RETURN_NONE;   /* e.g. plain ints */
      const at::Tensor &t = THPVariable_Unpack(o);
      if (!t.defined() || !t.has_storage() || !t.device().is_cpu() || t.numel() != 1)
        Py_RETURN_NONE;
      double step;
      if (t.scalar_type() == at::kFloat) step = *(const float *)t.const_data_ptr();
      else if (t.scalar_type() == at::kDouble) step = *(const double *)t.const_data_ptr();
      else Py_RETURN_NONE;
      const double k = (double)(int64_t)step;   /* as int() */
      c1[i] = 1 - pow(b1, k);
      c2[i] = 1 - pow(b2, k);
    }
    const at::Tensor &acc = THPVariable_Unpack(acc_obj);
    if (acc.scalar_type() != at::kDouble || !acc.device().is_cpu() || acc.dim() != 2
        || acc.size(0) != num || acc.size(1) != NT + 1)
      Py_RETURN_NONE;
    const int64_t stride = NT + 1 + (hist ? NB : 0);
    at::Tensor table = acc.new_zeros({(int64_t)num, stride});
    table.narrow(1, 0, NT + 1).copy_(acc);
    double *out = table.mutable_data_ptr<double>();
    const int64_t *p = ptrs.data();
    fn(num, p, p + num, p + 2 * num, mprev ? mprev_ptrs.data() : NULL, p + 3 * num,
       numel.data(), c1.data(), c2.data(),
       b1, eps, 1.0, out + 1, stride, hist ? out + NT + 1 : NULL);
    return THPVariable_Wrap(std::move(table));
  } catch (const std::exception &e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return NULL;
  }
}

static PyMethodDef methods[] = {{"sums", sums, METH_VARARGS, "the SUM_FIELDS sums"},
                                {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "%(module)s", NULL, -1, methods};
PyMODINIT_FUNC PyInit_%(module)s(void) { return PyModule_Create(&module); }
""" % {"module": MODULE}

_SOURCE = ("#include <Python.h>\n#include <torch/csrc/autograd/python_variable.h>\n"
           "#include <vector>\n" + native.KERNEL_SOURCE + _BINDING)
_LOADED: dict[str, object] = {}


def _torch_build() -> tuple[list[str], list[str]]:
    """Compiler and linker arguments for torch's headers and libraries (what
    torch.utils.cpp_extension passes, without importing it: setuptools is heavy)."""
    root = Path(torch.__file__).parent
    lib = root / "lib"
    cflags = [f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
              f"-I{sysconfig.get_paths()['include']}",
              f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    ldflags = [f"-L{lib}", "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]
    if sys.platform == "darwin":
        ldflags += ["-undefined", "dynamic_lookup"]
    return cflags, ldflags


def load():
    """The extension module (built on first use, ~10-15 s), or None (with one warning) if
    it cannot be built or loaded here."""
    cflags, ldflags = _torch_build()
    key = f"torch {torch.__version__}, python {sys.version}"
    file_name = MODULE + sysconfig.get_config_var("EXT_SUFFIX")
    where = str(native.library_path(file_name, _SOURCE, cflags, ldflags, key))
    if where in _LOADED:
        return _LOADED[where]
    module = None
    try:
        path = native.build_library(file_name, _SOURCE, cflags, ldflags, key)
        spec = importlib.util.spec_from_file_location(MODULE, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - no compiler, no headers, sandboxed dlopen, ...
        warnings.warn(f"telemetry: the native CPU sums kernel is unavailable ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}); using the other kernels",
                      RuntimeWarning, stacklevel=2)
        module = None
    _LOADED[where] = module
    return module


class NativeSums:
    """The SUM_FIELDS sums (and the r histogram) of contiguous CPU tensors all of one dtype,
    float32 or float64, computed in `dtype` (float32 tensors in float64 too, as the buffer
    path's cast); `__call__` returns None when the inputs do not qualify (the caller then
    uses its other kernels)."""

    def __init__(self, module, dtype: torch.dtype):
        assert dtype in (torch.float32, torch.float64)
        self.module, self.dtype = module, dtype

    def __call__(self, sources, steps, acc: torch.Tensor, b1: float, b2: float, eps: float,
                 hist: bool = False) -> torch.Tensor | None:
        """sources: (grads, exp_avgs, exp_avg_sqs, params[, m_prevs]) lists of equal-sized
        tensors (without m_prevs, m_prev is reconstructed from AdamW's rule);
        steps: each tensor's Adam step, a one-element CPU tensor (AdamW's state["step"]);
        acc: (num_tensors, NUM_SUMS) float64, not modified. Returns a new float64 table:
        acc + the sums in columns 1.., and with `hist` the NUM_HIST_BINS counts of r after
        them (exact integers)."""
        m_prev = list(sources[4]) if len(sources) > 4 else None
        return self.module.sums(*(list(x) for x in sources[:4]), list(steps), acc, float(b1),
                                float(b2), float(eps), bool(hist), self.dtype == torch.float64,
                                m_prev)
