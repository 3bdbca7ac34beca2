"""The worker torchrun starts in test_faults_part2's torchrun signal test: it runs
`python -m fullscale.train ARGS` as its child, forwards the SIGINT / SIGTERM torchrun sends
its workers to it, and writes the child's pid to DIR/rank<RANK>.pid, its stderr to
DIR/rank<RANK>.stderr and its exit status to DIR/rank<RANK>.rc. torchrun itself reports no
exit status of a worker it has signalled (it raises its own SignalException), so this is
where the test reads them.

    python -m torch.distributed.run ... tests/fullscale/signal_worker.py DIR ARGS...
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def main() -> int:
    logs, args = Path(sys.argv[1]), sys.argv[2:]
    rank = os.environ["RANK"]
    child: list[subprocess.Popen] = []

    def forward(signum, frame):
        if child:
            child[0].send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    with open(logs / f"rank{rank}.stderr", "w") as err:
        child.append(subprocess.Popen([sys.executable, "-m", "fullscale.train", *args],
                                      stderr=err))
        (logs / f"rank{rank}.pid").write_text(str(child[0].pid))
        rc = child[0].wait()
    (logs / f"rank{rank}.rc").write_text(str(rc))
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
