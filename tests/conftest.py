"""Suite-wide settings.

The torch telemetry kernels run eagerly in the suite (ADAMSPIKE_TELEMETRY_COMPILE=off):
compiling them costs ~5 s per process and the suite starts dozens of short trainings.
tests/fullscale/test_telemetry.py asks for compile = "on" explicitly where it checks the
compiled kernels against the numpy reference and a compiled training run.

Property tests (hypothesis) are derandomized: the same examples on every run and machine,
so that a failure reproduces (an edge case it finds becomes an explicit regression test)."""

import os
import shutil
import tempfile

from hypothesis import settings

os.environ.setdefault("ADAMSPIKE_TELEMETRY_COMPILE", "off")
settings.register_profile("adamspike", derandomize=True, database=None)
settings.load_profile("adamspike")


def pytest_configure(config):
    """One JAX compilation cache for the whole run (xdist workers and the CLI subprocesses
    the tests start inherit it: they compile the same tiny programs again and again), made
    here, in the controller, before the workers start; removed at the end. Per run: a
    run's timing never depends on an earlier run's cache. A cache hit is the same
    executable, so results are unchanged. Every program is kept, not only those JAX's
    default keeps (>= 1 s to compile): the suite's CLI processes compile the same small
    programs again and again, and loading one costs milliseconds."""
    if hasattr(config, "workerinput") or "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    config._adamspike_jax_cache = tempfile.mkdtemp(prefix="adamspike-test-jax-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = config._adamspike_jax_cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def pytest_unconfigure(config):
    cache = getattr(config, "_adamspike_jax_cache", None)
    if cache:
        shutil.rmtree(cache, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Longest first: `make test` runs two xdist workers that take tests in collection order,
    so the end-to-end quick study (~2.5 min) and the other `slow` tests start at once and
    overlap the short ones, instead of running alone at the end (measured on 2 cores:
    8 min 24 s in collection order)."""
    def rank(item):
        if item.nodeid.startswith("tests/study/"):
            return 0
        return 1 if item.get_closest_marker("slow") else 2
    items.sort(key=rank)   # stable: collection order within each rank
