"""simulate package: the JAX side (never torch).

XLA's CPU backend compiles this package's programs at backend optimization level 1 (LLVM
-O1) unless XLA_FLAGS already names a level. The programs here are small (a tiny LLaMA,
toys), so compiling them costs more than running them, and -O2's extra passes bought
nothing measurable in run time: on the 2-core AMD EPYC box (2026-12-05), the phase map's
cell program (4 lanes x 200 steps with curvature) compiled in ~21 s against ~80 s at the
default level 2, the plain 4-lane run of 400 steps ran in the same time (both ~20 s, under
load), and tests/simulate/test_seeds.py + test_golden.py took 71 s against 200 s. The
numbers move at fp32 rounding only (loss and update norm 1e-6 relative apart after 200
steps, as on another CPU; the stored golden trace holds at its tolerance), and one level
for every process keeps "the same program on the same inputs" bit-identical. XLA reads
XLA_FLAGS when its backend starts, after `import jax`, so setting it here, before any of
this package's programs runs, is in time; subprocesses inherit it."""

import os

_LEVEL = "--xla_backend_optimization_level"
if _LEVEL not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_LEVEL}=1".strip()
