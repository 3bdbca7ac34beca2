"""kill -9 of the real trainer at a seeded random step, then --resume: the steps table has
every step exactly once, losses and grad norms are bitwise those of an uninterrupted run,
and so are the final parameters and optimizer state."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from adamspike.rundir import load_run
from adamspike.train_config import RunConfig
from fullscale import checkpoint as ck

ROOT = Path(__file__).resolve().parents[2]
NUM_STEPS = 32

CONFIG = f"""
[model]
preset = "tiny"
[optim]
lr = 3e-3
warmup_steps = 4
[train]
num_steps = {NUM_STEPS}
global_batch_size = 8
micro_batch_size = 4
seq_len = 32
seed = 1
[telemetry]
every = 4
hist_every = 8
flush_every_s = 0.0
[checkpoint]
every = 5
keep = 2
"""


def _cmd(config: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "fullscale.train", "--config", str(config), "--out", str(out),
            *extra]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _final_state(run: Path) -> dict[str, torch.Tensor]:
    """Parameters and optimizer moments of the run's newest checkpoint, as plain tensors."""
    from fullscale.model import Transformer
    from fullscale.optim import build_optimizer

    cfg = RunConfig()
    model = Transformer(cfg.model.llama())
    opt = build_optimizer(model, cfg.optim)
    step, path = ck.latest(run / "checkpoints")
    assert step == NUM_STEPS
    ck.load(path, model, opt, None, restore_rng=False)
    state = {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        name = next(n for n, q in model.named_parameters() if q is p)
        state.update({f"{k}:{name}": v.clone() for k, v in st.items() if torch.is_tensor(v)})
    return state


def _num_step_parts(run: Path) -> int:
    try:
        return len([p for p in os.listdir(run / "steps") if p.startswith("part-")])
    except FileNotFoundError:
        return 0


@pytest.mark.slow
def test_kill_minus_9_then_resume_is_bitwise_identical(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    ref, run = tmp_path / "ref", tmp_path / "run"
    done = subprocess.run(_cmd(config, ref), env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    kill_at = random.Random(1543).randint(8, NUM_STEPS - 12)
    proc = subprocess.Popen(_cmd(config, run), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while _num_step_parts(run) < kill_at and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    killed_steps = load_run(run, tables=("steps",)).steps
    ckpt_at_kill = ck.latest(run / "checkpoints")
    print(f"killed after {len(killed_steps)} logged steps (target {kill_at}), newest "
          f"checkpoint {ckpt_at_kill}")
    assert kill_at <= len(killed_steps) < NUM_STEPS and ckpt_at_kill is not None

    resumed = subprocess.run(_cmd(config, run, "--resume"), env=_env(), capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    a = load_run(ref, tables=("steps", "layers"))
    b = load_run(run, tables=("steps", "layers"))
    # Every step exactly once (the reader would hide duplicates, so check the raw parts too).
    import pyarrow.parquet as pq
    raw = [s for p in sorted((run / "steps").glob("part-*.parquet"))
           for s in pq.read_table(p, columns=["step"]).column("step").to_pylist()]
    assert sorted(raw) == list(range(1, NUM_STEPS + 1))
    assert b.steps["step"].tolist() == list(range(1, NUM_STEPS + 1))
    for col in ("loss", "grad_norm", "update_norm", "lr", "tokens"):
        assert a.steps[col].tolist() == b.steps[col].tolist(), col      # bitwise
    assert a.layers[["step", "name", "grad_rms"]].equals(b.layers[["step", "name", "grad_rms"]])
    assert "resume" in set(b.events["type"])

    sa, sb = _final_state(ref), _final_state(run)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.slow
def test_two_rank_resume_from_a_mid_run_checkpoint_is_bitwise_identical(tmp_path):
    """FSDP2 over 2 gloo ranks: a copy of a finished run cut back to its step-8 checkpoint
    (as if both ranks had died after step 11) and resumed re-logs steps 9..16 bitwise
    (sharded model + Adam state, data position restored; rows after 8 truncated)."""
    import shutil
    import socket

    config = tmp_path / "run.toml"
    config.write_text(CONFIG.replace(f"num_steps = {NUM_STEPS}", "num_steps = 16")
                      .replace("every = 5\nkeep = 2", "every = 4\nkeep = 4"))

    def run2(out, *extra):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen(_cmd(config, out, *extra), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True,
                                  env={**_env(), "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": str(port), "RANK": str(r),
                                       "LOCAL_RANK": str(r), "WORLD_SIZE": "2"})
                 for r in range(2)]
        for p in procs:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]

    ref, cut = tmp_path / "ref", tmp_path / "cut"
    run2(ref)
    assert ck.steps_of(ref / "checkpoints") == [4, 8, 12, 16]
    shutil.copytree(ref, cut)
    for step in (12, 16):
        shutil.rmtree(ck.step_dir(cut / "checkpoints", step))
    run2(cut, "--resume")
    a = load_run(ref, tables=("steps",)).steps
    b = load_run(cut, tables=("steps",)).steps
    assert b["step"].tolist() == list(range(1, 17))
    for col in ("loss", "grad_norm", "update_norm"):
        assert a[col].tolist() == b[col].tolist(), col
    import pyarrow.parquet as pq
    raw = [s for p in sorted((cut / "steps").glob("part-*.parquet"))
           for s in pq.read_table(p, columns=["step"]).column("step").to_pylist()]
    assert sorted(raw) == list(range(1, 17))          # 9..16 truncated, then re-logged once
    resumes = load_run(cut, tables=()).events.query("type == 'resume'")
    assert resumes["step"].tolist() == [8]
    assert load_run(cut, tables=()).meta["world_size"] == 2
