"""Independent units of CPU work (one run's analysis, one run's figures) in processes.

`process_map(fn, items, jobs)` yields fn(item) in the order of `items`: in this process when
jobs <= 1 or there is one item, else in a pool of `jobs` processes (fork where the platform
has it: the workers inherit the parent's imports, so no start-up per worker). fn must be a
module-level function and the items picklable. A consumer that stops early leaves the pool
to finish the tasks already running.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def process_map(fn: Callable[[T], R], items: Sequence[T], jobs: int = 1) -> Iterator[R]:
    if jobs <= 1 or len(items) <= 1:
        yield from map(fn, items)
        return
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        yield from pool.map(fn, items)
