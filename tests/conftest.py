"""Suite-wide settings.

The torch telemetry kernels run eagerly in the suite (ADAMSPIKE_TELEMETRY_COMPILE=off):
compiling them costs ~5 s per process and the suite starts dozens of short trainings.
tests/fullscale/test_telemetry.py asks for compile = "on" explicitly where it checks the
compiled kernels against the numpy reference and a compiled training run.

Property tests (hypothesis) are derandomized: the same examples on every run and machine,
so that a failure reproduces (an edge case it finds becomes an explicit regression test)."""

import functools
import os
from pathlib import Path

import pytest
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


@functools.lru_cache(maxsize=None)
def _shares_a_module_fixture(path: str) -> bool:
    f = Path(path)
    return f.is_file() and 'scope="module"' in f.read_text(errors="replace")


@pytest.hookimpl(tryfirst=True, optionalhook=True)   # before xdist's own choice of scheduler
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` (`make test`): a test module that builds a module-scoped fixture
    is one work unit, so the fixture is built on one worker, not on each (scattered test
    by test, the Megatron probe's and the probe loops' reference runs were built twice:
    ~45 s of test time). Every other test is a unit of its own, handed to whichever
    worker is free, in collection order (longest first, above).

    xdist's own loadgroup would group only `xdist_group` marks, and with pytest 9 it
    groups nothing (xdist 3.8 appends the group to `item._nodeid`, which pytest 9 no
    longer reads), so the grouping is decided here from the module's source."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if _shares_a_module_fixture(path) else nodeid

    config.option.loadscopereorder = False   # keep the collection order, not largest-first
    return ModuleFixtureScheduling(config, log)
