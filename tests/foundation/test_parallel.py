"""adamspike.parallel.process_map: the order of its items, and workers that do not inherit
this process's held locks (a fork did: issue 37's suite hung in `analyze --jobs 2`)."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from adamspike.parallel import process_map

ROOT = Path(__file__).resolve().parents[2]


def _square(x: int) -> int:
    return x * x


def test_results_come_in_the_order_of_the_items():
    items = list(range(7))
    assert list(process_map(_square, items, jobs=2)) == [x * x for x in items]
    assert list(process_map(_square, items, jobs=1)) == [x * x for x in items]


def test_a_lock_held_in_the_parent_does_not_hang_the_workers(tmp_path):
    """The parent holds a module's lock (as another thread holding pyparsing's cache lock
    did) while the workers need that module's lock: forked from the parent they would wait
    for it forever; from a forkserver they have their own."""
    (tmp_path / "held_lock.py").write_text(textwrap.dedent("""
        import threading
        LOCK = threading.Lock()

        def double_under_lock(x):
            with LOCK:
                return 2 * x
        """))
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(tmp_path)!r}, {str(ROOT)!r}]
        import held_lock
        from adamspike.parallel import process_map
        with held_lock.LOCK:
            print(list(process_map(held_lock.double_under_lock, [1, 2, 3], jobs=2)))
        """)
    # its own process group, so that a hang's workers are killed with it
    job = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:   # 120 s: a hang is the failure; a loaded 2-core box starts the server in ~2 s
        out, err = job.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
        raise AssertionError("the workers hung on the lock their parent held") from None
    assert job.returncode == 0 and out.strip() == "[2, 4, 6]", err[-2000:]
