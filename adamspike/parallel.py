"""Independent units of CPU work (one run's analysis, one run's figures) in processes.

`process_map(fn, items, jobs)` yields fn(item) in the order of `items`: in this process when
jobs <= 1 or there is one item, else in a pool of `jobs` processes. fn must be a
module-level function and the items picklable. A consumer that stops early leaves the pool
to finish the tasks already running.

The workers are forked from a forkserver (spawned where there is none), never from this
process: a fork copies every lock as it is at that moment, and a lock another thread held
then stays held in the child forever. The suite met it: `analyze --jobs 2` inside a process
where another thread had been drawing with matplotlib hung both workers in pyparsing's
packrat-cache lock. The forkserver imports fn's module once, so the workers do not pay
for it one by one.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterator, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def _pool_context(module: str):
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([module])   # no effect once this process's server runs
    return ctx


def process_map(fn: Callable[[T], R], items: Sequence[T], jobs: int = 1) -> Iterator[R]:
    if jobs <= 1 or len(items) <= 1:
        yield from map(fn, items)
        return
    with ProcessPoolExecutor(max_workers=jobs, mp_context=_pool_context(fn.__module__)) as pool:
        yield from pool.map(fn, items)
