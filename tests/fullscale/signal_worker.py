"""The worker torchrun starts in test_faults_part2's torchrun signal tests: it runs
`python -m fullscale.train ARGS` as its child, forwards the SIGINT / SIGTERM torchrun sends
its workers to it, and writes the child's pid to DIR/rank<RANK>.pid, its stderr to
DIR/rank<RANK>.stderr and its exit status to DIR/rank<RANK>.rc. torchrun itself reports no
exit status of a worker it has signalled (it raises its own SignalException), so this is
where the test reads them.

    python -m torch.distributed.run ... tests/fullscale/signal_worker.py DIR ARGS...

With SIGNAL_IN_DCP="write@STEP:RANK:SIGNAL" (or read@...) in the environment, the trainer
of rank RANK sends itself SIGNAL as DCP starts writing (reading) checkpoint STEP's model
and optimizer state, so the signal lands inside DCP, which catches a rank's exception and
hands it to every rank inside its CheckpointException.
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
    trainer = ([__file__, "--trainer"] if os.environ.get("SIGNAL_IN_DCP")
               else ["-m", "fullscale.train"])
    with open(logs / f"rank{rank}.stderr", "w") as err:
        child.append(subprocess.Popen([sys.executable, *trainer, *args], stderr=err))
        (logs / f"rank{rank}.pid").write_text(str(child[0].pid))
        rc = child[0].wait()
    (logs / f"rank{rank}.rc").write_text(str(rc))
    return rc if rc >= 0 else 128 - rc


def trainer(args: list[str]) -> int:
    """fullscale.train's main, signalling itself inside DCP (SIGNAL_IN_DCP)."""
    from torch.distributed.checkpoint import filesystem

    from fullscale.train import main as train_main

    what, _, rest = os.environ["SIGNAL_IN_DCP"].partition("@")
    step, rank, name = rest.split(":")
    cls, method = ((filesystem._FileSystemWriter, "write_data") if what == "write" else
                   (filesystem.FileSystemReader, "read_data"))
    original = getattr(cls, method)

    def signalled(self, *a, **kw):
        if os.environ["RANK"] == rank and f"step-{int(step):08d}" in str(self.path):
            os.kill(os.getpid(), signal.Signals[name])
        return original(self, *a, **kw)

    setattr(cls, method, signalled)
    return train_main(args)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--trainer"]:
        sys.exit(trainer(sys.argv[2:]))
    sys.exit(main())
