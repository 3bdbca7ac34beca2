"""A rank that dies (SIGKILL) or hangs (SIGSTOP, the HCCL "notify wait timeout" case) makes
the surviving rank exit non-zero within the process-group timeout, and the newest complete
checkpoint stays loadable.

Measured (torch 2.13, gloo): a killed peer gives "Connection reset by peer" at once; a
stopped peer gives "Timed out waiting <timeout>ms for recv operation" after the
process-group timeout, so gloo collectives honour `dist.timeout_s` and no watchdog is
needed on CPU. The trainer must let that RuntimeError end the process with a non-zero
status after logging a "fault" event; fullscale.train does (exit 1), and its
destroy_process_group() after the failed gloo collective returned promptly here. On
HCCL/NCCL the same role is played by HCCL_EXEC_TIMEOUT / the NCCL watchdog, not tested here.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fullscale import checkpoint as ck

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(code: str, args: list[str], world: int = 2) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}
        procs.append(subprocess.Popen([sys.executable, "-c", code, *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


# ----------------------------------------------------------------------------- the trainer

TRAIN_RUN = f"""
[model]
preset = "tiny"
[train]
num_steps = 100000
global_batch_size = 8
seq_len = 32
[telemetry]
every = 10
hist_every = 0
flush_every_s = 0.0
[checkpoint]
every = 1
keep = 2
[dist]
timeout_s = {TIMEOUT_S}
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig, async_save", [(signal.SIGKILL, False), (signal.SIGSTOP, False),
                                             (signal.SIGSTOP, True)],
                         ids=["killed", "hung", "hung-async-save"])
def test_trainer_rank_failure(tmp_path, sig, async_save):
    """2-rank trainer checkpointing every step (so the failure usually lands inside a save);
    rank 1 dies or hangs at a seeded random moment after the first checkpoints: rank 0
    logs a fault, exits non-zero within dist.timeout_s, and its newest checkpoint loads.
    With async saves the background thread's gloo group must carry the same timeout (a
    new_group defaults to 30 min): that hang was found by this test."""
    from adamspike.rundir import load_run
    from adamspike.train_config import RunConfig
    from fullscale.model import Transformer
    from fullscale.optim import build_optimizer

    config, out = tmp_path / "run.toml", tmp_path / "run"
    config.write_text(TRAIN_RUN)
    code = "import sys; from fullscale.train import main; sys.exit(main())"
    survivor, victim = _launch(code, ["--config", str(config), "--out", str(out),
                                      "--checkpoint.async_save", str(async_save).lower()])
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and survivor.poll() is None and \
                len(ck.complete(out / "checkpoints")) < 2:
            time.sleep(0.02)
        assert survivor.poll() is None, survivor.stderr.read()[-3000:]
        time.sleep(random.Random(1543 + int(sig)).uniform(0.0, 0.5))
        victim.send_signal(sig)
        t0 = time.monotonic()
        rc = survivor.wait(timeout=TIMEOUT_S + 30)
        elapsed = time.monotonic() - t0
        err = survivor.stderr.read()
    finally:
        for p in (survivor, victim):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert rc != 0, err[-3000:]
    assert elapsed < TIMEOUT_S + 15, f"rank 0 took {elapsed:.1f} s to fail"
    events = load_run(out, tables=()).events
    assert events["type"].iloc[-1] == "fault", events.tail()
    step, path = ck.complete(out / "checkpoints")[-1]
    model = Transformer(RunConfig().model.llama())
    ck.load(path, model, build_optimizer(model, RunConfig().optim), None, restore_rng=False)
    assert step >= 1 and all(torch.isfinite(p).all() for p in model.parameters())
    print(f"{sig.name} async={async_save}: rank 0 exited {rc} after {elapsed:.1f} s; newest checkpoint {step}")
