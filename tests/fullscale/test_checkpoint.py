"""fullscale.checkpoint on a small module + AdamW: exact round trips (1 process, and FSDP2
over 2 gloo processes), manifest-last crash safety (real kill -9 while saving), corruption
detection with fallback, refusal of non-finite state, keep-k pruning.

This file is also the 2-process worker: `python test_checkpoint.py worker MODE ROOT OUT`.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fullscale import checkpoint as ck
from fullscale.guard import SpikeGuard
from fullscale.sampler import DataPosition
from adamspike.train_config import GuardSection

ROOT = Path(__file__).resolve().parents[2]


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return m, opt, sched


def _train(m, opt, sched, steps) -> list[float]:
    """Steps that draw their data from the global torch RNG, so the RNG restore matters."""
    losses = []
    for _ in steps:
        x, y = torch.randn(4, 6), torch.randn(4, 3)
        opt.zero_grad()
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def test_roundtrip_resumes_bitwise(tmp_path):
    m, opt, sched = _model()
    _train(m, opt, sched, range(3))
    guard = SpikeGuard(GuardSection(enabled=True, window=8))
    for s in range(1, 7):
        guard.observe(s, 2.0 + 0.01 * s)
    pos = DataPosition(step=3, offset=7)
    torch.manual_seed(123)
    np.random.seed(5)
    random.seed(9)
    path = ck.CheckpointManager(tmp_path).save(3, m, opt, sched, {"tokens": 1234, "note": "x"},
                                               position=pos, guard=guard)
    assert path == tmp_path / "step-00000003" and (path / "COMPLETE").is_file()
    expect_losses = _train(m, opt, sched, range(4))
    expect_params = [p.detach().clone() for p in m.parameters()]
    expect_draws = (np.random.rand(), random.random())

    m2, opt2, sched2 = _model(seed=1)   # different init: everything must come from the file
    pos2, guard2 = DataPosition(), SpikeGuard(GuardSection(enabled=True, window=8))
    extra = ck.load(ck.complete(tmp_path)[-1][1], m2, opt2, sched2, position=pos2, guard=guard2)
    assert extra["tokens"] == 1234 and extra["note"] == "x" and extra["step"] == 3
    assert extra["rng_restored"] is True
    assert pos2.state_dict() == {"step": 3, "offset": 7}
    assert guard2.state_dict() == guard.state_dict()
    assert sched2.state_dict()["last_epoch"] == 3
    got_losses = _train(m2, opt2, sched2, range(4))
    assert got_losses == expect_losses                      # bitwise
    for a, b in zip(expect_params, m2.parameters()):
        assert torch.equal(a, b)
    assert (np.random.rand(), random.random()) == expect_draws


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # from DCP's thread
def test_async_save_stages_the_state_and_completes_on_finalize(tmp_path):
    m, opt, sched = _model()
    _train(m, opt, sched, range(2))
    expect = [p.detach().clone() for p in m.parameters()]
    mgr = ck.CheckpointManager(tmp_path, async_save=True)
    path = mgr.save(2, m, opt, sched, {"a": 1})
    _train(m, opt, sched, range(2))              # training goes on while it is written
    assert ck.complete(tmp_path) == []           # not complete before finalize
    assert mgr.finalize_pending() == path and ck.complete(tmp_path) == [(2, path)]
    assert mgr.finalize_pending() is None
    # A run that ends with a save pending (an abort) completes it on close (not collective).
    other = ck.CheckpointManager(tmp_path, async_save=True)
    lin = nn.Linear(3, 2)
    with other:
        other.save(7, lin, torch.optim.AdamW(lin.parameters()), None)
    assert ck.complete(tmp_path)[-1][0] == 7
    closed = ck.read_manifest(ck.step_dir(tmp_path, 7))
    assert closed["finalized"] == "at close" and all(f["sha256"] for f in closed["files"].values())
    ck.verify(ck.step_dir(tmp_path, 7))
    m2, opt2, sched2 = _model(seed=5)
    ck.load(path, m2, opt2, sched2)
    for a, b in zip(expect, m2.parameters()):
        assert torch.equal(a, b)


def test_keep_and_latest_ignore_partial(tmp_path):
    m, opt, sched = _model()
    for s in (2, 4, 6):
        _train(m, opt, sched, range(2))
        ck.CheckpointManager(tmp_path, keep=2).save(s, m, opt, sched)
    assert [st for st, _ in ck.complete(tmp_path)] == [4, 6]
    # A save killed before its marker: a .partial dir, and a step dir without COMPLETE.
    (tmp_path / "step-00000008.partial").mkdir()
    (tmp_path / "step-00000010").mkdir()
    (tmp_path / "step-00000010" / ".metadata").write_bytes(b"junk")
    assert [st for st, _ in ck.complete(tmp_path)] == [4, 6]
    assert ck.complete(tmp_path / "nope") == []
    with pytest.raises(ck.CheckpointError, match="no COMPLETE marker"):
        ck.load(tmp_path / "step-00000010", m, opt, sched)
    # Re-saving the same step (after a rollback) replaces it atomically.
    ck.CheckpointManager(tmp_path, keep=2).save(6, m, opt, sched, {"again": True})
    assert ck.load(tmp_path / "step-00000006", m, opt, sched)["again"] is True


@pytest.mark.parametrize("damage", ["truncate", "flip", "missing", "manifest", "trainer"])
def test_corrupt_checkpoint_is_rejected_and_falls_back(tmp_path, damage):
    m, opt, sched = _model()
    _train(m, opt, sched, range(2))
    ck.CheckpointManager(tmp_path).save(2, m, opt, sched, {"which": 2})
    good = [p.detach().clone() for p in m.parameters()]
    _train(m, opt, sched, range(2))
    bad = ck.CheckpointManager(tmp_path).save(4, m, opt, sched, {"which": 4})
    shard = next(bad.glob("*.distcp"))
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
        problem = "truncated"
    elif damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        problem = "sha256"
    elif damage == "missing":
        (bad / ".metadata").unlink()
        problem = ".metadata is missing"
    elif damage == "manifest":
        (bad / "COMPLETE").write_text("{not json")
        problem = "not valid JSON"
    else:
        (bad / "trainer.pt").write_bytes(b"\0" * (bad / "trainer.pt").stat().st_size)
        problem = "trainer.pt does not match its sha256"
    m2, opt2, sched2 = _model(seed=3)
    with pytest.raises(ck.CheckpointError) as err:
        ck.load(bad, m2, opt2, sched2)
    assert str(bad) in str(err.value) and problem in str(err.value)
    step, path, extra, rejected = ck.CheckpointManager(tmp_path).load_latest_valid(m2, opt2, sched2)
    assert (step, extra["which"]) == (2, 2) and len(rejected) == 1
    assert ck.CheckpointManager(tmp_path).load_latest_valid(m2, opt2, sched2, before_step=4)[3] == []
    assert ck.CheckpointManager(tmp_path).load_latest_valid(m2, opt2, sched2, before_step=2) is None
    assert str(bad) in str(rejected[0])
    for a, b in zip(good, m2.parameters()):
        assert torch.equal(a, b)


def test_all_corrupt_is_an_error_and_empty_is_none(tmp_path):
    m, opt, sched = _model()
    assert ck.CheckpointManager(tmp_path).load_latest_valid(m, opt, sched) is None
    p = ck.CheckpointManager(tmp_path).save(1, m, opt, sched)
    (p / "trainer.pt").unlink()
    with pytest.raises(ck.CheckpointError, match="no loadable checkpoint.*trainer.pt is missing"):
        ck.CheckpointManager(tmp_path).load_latest_valid(m, opt, sched)


def test_nonfinite_state_is_never_saved(tmp_path):
    m, opt, sched = _model()
    _train(m, opt, sched, range(2))
    ck.CheckpointManager(tmp_path).save(2, m, opt, sched)
    with torch.no_grad():
        m[2].bias[1] = float("nan")
    with pytest.raises(ck.NonFiniteError) as err:
        ck.CheckpointManager(tmp_path).save(3, m, opt, sched)
    assert "2.bias" in str(err.value) and err.value.payload["num_nonfinite"] == 1
    with torch.no_grad():
        m[2].bias[1] = 0.0
    opt.state[m[0].weight]["exp_avg_sq"][0, 0] = float("inf")
    with pytest.raises(ck.NonFiniteError, match="0.weight:exp_avg_sq"):
        ck.CheckpointManager(tmp_path).save(3, m, opt, sched)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]


def test_bad_extra_and_mismatched_model(tmp_path):
    m, opt, sched = _model()
    with pytest.raises(ck.CheckpointError, match="cannot be stored safely"):
        ck.CheckpointManager(tmp_path).save(1, m, opt, sched, {"obj": object()})
    with pytest.raises(ck.CheckpointError, match=r"reserved key\(s\) \['step'\]"):
        ck.CheckpointManager(tmp_path).save(1, m, opt, sched, {"step": 1})
    assert not any(tmp_path.iterdir())
    p = ck.CheckpointManager(tmp_path).save(1, m, opt, sched)
    other = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    with pytest.raises(ck.CheckpointError, match="does not load into this model"):
        ck.load(p, other, torch.optim.AdamW(other.parameters()), None)


_SAVER = """
import sys, torch
from torch import nn
from fullscale import checkpoint as ck
m = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
opt = torch.optim.AdamW(m.parameters())
m(torch.randn(2, 256)).sum().backward(); opt.step()
print("ready", flush=True)
for s in range(1, 10_000):
    ck.CheckpointManager(sys.argv[1], keep=3).save(s, m, opt, None, {"s": s})
"""


def test_kill_minus_9_while_saving_leaves_loadable_checkpoints(tmp_path):
    """A real crash at a random point of a save: only complete checkpoints are visible, and
    every one of them verifies and loads."""
    root = tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(root)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout.readline().strip() == "ready"
    rng = random.Random(1543)
    deadline = time.monotonic() + 30
    while len(ck.complete(root)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 0.3))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = ck.complete(root)
    assert len(done) >= 2
    m = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
    opt = torch.optim.AdamW(m.parameters())
    for step, path in done:
        assert ck.load(path, m, opt, None)["s"] == step
    # a kill during pruning may leave a hidden .deleting-* (never a complete checkpoint);
    # the next save's prune removes it
    names = [p.name for p in root.iterdir()]
    assert all(n.startswith(("step-", ".deleting-step-")) for n in names), names
    ck.prune(root, keep=3)
    assert all(p.name.startswith("step-") for p in root.iterdir())


# ----------------------------------------------------------------------------- 2 processes

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_pair(mode: str, root: Path, out: Path, world: int = 2) -> list[dict]:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world)}
        procs.append(subprocess.Popen([sys.executable, "-c", _WORKER, mode, str(root), str(out)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    results = []
    for rank, p in enumerate(procs):
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, f"rank {rank} failed:\n{stderr[-3000:]}"
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results


# FSDP2 over gloo: each rank trains on its own slice of a fixed data set.
_WORKER = """
import json, sys
from datetime import timedelta
from pathlib import Path
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from fullscale import checkpoint as ck

mode, root, out = sys.argv[1:4]
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
mesh = init_device_mesh("cpu", (world,))
fully_shard(m[0], mesh=mesh)
fully_shard(m[2], mesh=mesh)
fully_shard(m, mesh=mesh)
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1)
data_x, data_y = torch.randn(64, 6, generator=g), torch.randn(64, 3, generator=g)

def step(i):
    lo = (i * 2 * world + 2 * rank) % 64
    opt.zero_grad()
    loss = ((m(data_x[lo:lo + 2]) - data_y[lo:lo + 2]) ** 2).mean()
    loss.backward()
    opt.step()
    return loss.item()

result = {"rank": rank}
if mode == "first":
    step(0)
    mgr = ck.CheckpointManager(root, async_save=True)
    mgr.save(1, m, opt, None, {"world": world})   # written while training
    full = {n: p.full_tensor() for n, p in m.named_parameters()}
    if rank == 0:
        torch.save(full, Path(out) / "full_at_1.pt")
    [step(i) for i in range(1, 3)]
    mgr.async_save = False
    mgr.save(3, m, opt, None, {"world": world})     # completes the async one first
    full = {n: p.full_tensor() for n, p in m.named_parameters()}   # collective
    if rank == 0:
        torch.save(full, Path(out) / "full_at_3.pt")
    result["losses"] = [step(i) for i in range(3, 6)]
else:
    extra = ck.load(ck.complete(root)[-1][1], m, opt, None)
    result["extra_world"] = extra["world"]
    result["losses"] = [step(i) for i in range(3, 6)]
    # A nan in rank 1's shard only: both ranks must refuse, nothing is written.
    if rank == 1:
        with torch.no_grad():
            next(m.parameters()).to_local().view(-1)[0] = float("nan")
    try:
        ck.CheckpointManager(root).save(9, m, opt, None)
        result["refused"] = False
    except ck.NonFiniteError as e:
        result.update(refused=True, num_nonfinite=e.num_nonfinite, names=e.names)
dist.barrier()
dist.destroy_process_group()
print(json.dumps(result))
"""


@pytest.mark.slow
def test_two_process_fsdp2_async_resume_reshard_and_nonfinite(tmp_path):
    root = tmp_path / "ckpt"
    first = _run_pair("first", root, tmp_path)
    files = sorted(p.name for p in (root / "step-00000003").iterdir())
    assert files == [".metadata", "COMPLETE", "__0_0.distcp", "__1_0.distcp", "rng-00000.pt",
                     "rng-00001.pt", "trainer.pt"]
    assert [st for st, _ in ck.complete(root)] == [1, 3]
    resumed = _run_pair("resume", root, tmp_path)
    for a, b in zip(first, resumed):
        assert a["losses"] == b["losses"]          # bitwise, per rank
        assert b["extra_world"] == 2
    assert all(r["refused"] and r["num_nonfinite"] == 1 for r in resumed)
    assert resumed[1]["names"] == ["0.weight"] and resumed[0]["names"] == []
    assert [st for st, _ in ck.complete(root)] == [1, 3] and not (root / "step-00000009.partial").exists()

    # Reshard: the 2-rank checkpoint loads into a plain 1-process module (global tensors).
    torch.manual_seed(7)
    m = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    extra = ck.load(root / "step-00000003", m, opt, None)
    assert extra["rng_restored"] is False          # world size changed: RNG not restored
    for at in (3, 1):   # 1: the async save holds the state of its step, not a later one
        if at == 1:
            ck.load(root / "step-00000001", m, opt, None)
        full = torch.load(tmp_path / f"full_at_{at}.pt")
        assert set(full) == {n for n, _ in m.named_parameters()}
        for n, p in m.named_parameters():
            assert torch.equal(p.detach(), full[n]), (at, n)
