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
this package's programs runs, is in time; subprocesses inherit it.

JAX's persistent compilation cache is on for every process that imports this package
(adamspike.cells.jax_cache_dir: per user, jaxlib version and CPU kind), unless
JAX_COMPILATION_CACHE_DIR names another: a study, the test suite and a later command load
what an earlier one compiled (a hit is the same executable, so results are unchanged).
It keeps every program, not only those that took >= 1 s (JAX's default): the study and the
suite compile many small programs, each again in every process, and a load costs
milliseconds. jax reads these variables when it is imported; a process that imported jax
before this package gets them through jax.config instead."""

import os

_LEVEL = "--xla_backend_optimization_level"
if _LEVEL not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_LEVEL}=1".strip()

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    from adamspike.cells import jax_cache_dir
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(jax_cache_dir())
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
if "jax" in __import__("sys").modules:      # imported before us: tell its config directly
    import jax
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs",
                          float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
