"""A rank that dies (SIGKILL) or hangs (SIGSTOP, the HCCL "notify wait timeout" case) makes
the surviving rank exit non-zero within the process-group timeout, and the newest complete
checkpoint stays loadable.

Measured (torch 2.13, gloo): a killed peer gives "Connection reset by peer" at once; a
stopped peer gives "Timed out waiting <timeout>ms for recv operation" after the
process-group timeout, so gloo collectives honour `dist.timeout_s` and no watchdog is
needed on CPU. The trainer must let that RuntimeError end the process with a non-zero
status (log a "fault" event first) and must not call destroy_process_group() after a
failed collective (it can block); see the trainer test at the end of this file.
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
from torch import nn

from fullscale import checkpoint as ck

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 10.0

# Two gloo ranks of an FSDP2 model that train and checkpoint every step, forever.
_WORKER = """
import sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from fullscale import checkpoint as ck

root, timeout_s = sys.argv[1], float(sys.argv[2])
dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
mesh = init_device_mesh("cpu", (world,))
for layer in (m[0], m[2], m):
    fully_shard(layer, mesh=mesh)
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
try:
    for step in range(1, 100_000):
        opt.zero_grad()
        m(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        ck.save(root, step, m, opt, None, {"step": step}, keep=2)
        if step == 2:
            print("ready", flush=True)
except Exception as e:
    print(f"FAULT {type(e).__name__}: {str(e)[:300]}", file=sys.stderr, flush=True)
    sys.stderr.flush()
    import os
    os._exit(3)
"""


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


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_surviving_rank_exits_and_last_checkpoint_loads(tmp_path, sig):
    root = tmp_path / "ckpt"
    survivor, victim = _launch(_WORKER, [str(root), str(TIMEOUT_S)])
    try:
        assert survivor.stdout.readline().strip() == "ready", survivor.stderr.read()[-2000:]
        time.sleep(random.Random(1543 + int(sig)).uniform(0.0, 0.5))   # a seeded random moment
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
    assert rc != 0 and "FAULT" in err, err[-2000:]
    assert elapsed < TIMEOUT_S + 15, f"survivor took {elapsed:.1f} s to fail"
    step, path = ck.latest(root)
    m = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    assert ck.load(path, m, opt, None)["step"] == step
    assert all(torch.isfinite(p).all() for p in m.parameters())
