"""Does fullscale/dcp_metadata.py admit everything the installed torch writes into a DCP
checkpoint's `.metadata`? Writes a real checkpoint (torch.distributed.checkpoint, one
process, no process group) of a small state dict with every kind of entry the trainer
saves (tensors of several dtypes and shapes, a 0-d tensor, nested dicts, lists, plain
Python values stored as bytes), lists the globals its `.metadata` refers to, and checks
each against the allowlist; then reads it through the restricted unpickler and compares
with DCP's own reading. Exit 0 and one summary line, or exit 1 naming what is refused.

    PYTHONPATH=. python tests/compat/dcp_metadata_check.py [DIR]

Runs on every supported torch (2.1 on Python 3.8: .ci/compat.sh py38; the main
environment's: tests/fullscale/test_checkpoint_trust.py), so it uses no newer syntax.
"""

import io
import pickle
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from fullscale.dcp_metadata import MetadataUnpickler, admitted


def state_dict():
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(4, 3, generator=g), "b": torch.zeros(3, dtype=torch.bfloat16),
                  "emb": torch.randn(5, 2, generator=g).half(), "ids": torch.arange(6)},
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(4, 3),
                                "exp_avg_sq": torch.ones(4, 3)}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8,
                                    "params": [0]}]},
        "trainer": {"step": 3, "name": "tiny", "flags": [True, None]},
    }


def write(path):
    """A DCP checkpoint of state_dict() at `path`, with the installed torch's API."""
    writer = dcp.FileSystemWriter(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if hasattr(dcp, "save"):                      # torch >= 2.2
            dcp.save(state_dict(), storage_writer=writer)
        else:                                         # torch 2.1
            dcp.save_state_dict(state_dict(), storage_writer=writer, no_dist=True)


def referred_globals(data):
    """The (module, name) globals a trusted pickle refers to, in order of first use."""
    seen = []

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) not in seen:
                seen.append((module, name))
            return super().find_class(module, name)

    Recorder(io.BytesIO(data)).load()
    return seen


def check(path):
    """Problems found (empty: every global admitted, same metadata read back)."""
    write(path)
    data = (Path(path) / ".metadata").read_bytes()
    used = referred_globals(data)
    problems = ["torch %s writes %s.%s into .metadata, which fullscale/dcp_metadata.py "
                "does not admit (add it to OTHER_GLOBALS after checking it cannot run code)"
                % (torch.__version__, m, n) for m, n in used if not admitted(m, n)]
    if not problems:
        mine = MetadataUnpickler(io.BytesIO(data)).load()
        theirs = dcp.FileSystemReader(str(path)).read_metadata()
        if mine.state_dict_metadata != theirs.state_dict_metadata:
            problems.append("the restricted unpickler read different metadata than DCP")
    return problems, used


def main(argv):
    path = Path(argv[0]) if argv else Path(tempfile.mkdtemp()) / "ckpt"
    problems, used = check(path)
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        return 1
    print("torch %s: .metadata refers to %d globals, all admitted: %s"
          % (torch.__version__, len(used), ", ".join("%s.%s" % g for g in used)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
