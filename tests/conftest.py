"""Suite-wide settings.

The torch telemetry kernels run eagerly in the suite (ADAMSPIKE_TELEMETRY_COMPILE=off):
compiling them costs ~5 s per process and the suite starts dozens of short trainings.
tests/fullscale/test_telemetry.py asks for compile = "on" explicitly where it checks the
compiled kernels against the numpy reference and a compiled training run.

Property tests (hypothesis) are derandomized: the same examples on every run and machine,
so that a failure reproduces (an edge case it finds becomes an explicit regression test)."""

import os

from hypothesis import settings

os.environ.setdefault("ADAMSPIKE_TELEMETRY_COMPILE", "off")
# JAX's persistent compilation cache (simulate/__init__.py: per user, jaxlib version and CPU
# kind) is set before any test imports jax; the xdist workers and the CLI subprocesses the
# tests start inherit it, so the suite loads what an earlier run or study compiled (issue
# 37: "a second run and the test suite reuse compiled programs"). A hit is the same
# executable, so results are unchanged; only the first run on a machine compiles them all.
import simulate  # noqa: E402,F401  (sets JAX_COMPILATION_CACHE_DIR)
settings.register_profile("adamspike", derandomize=True, database=None)
settings.load_profile("adamspike")


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
