"""A stored reference loss trace of the JAX tiny LLaMA (torchtitan's golden-loss habit).

The trace (golden/tiny_llama_loss.json) is 60 steps of simulate.llama_train on the settings
below, written by `ADAMSPIKE_WRITE_GOLDEN=1 pytest tests/simulate/test_golden.py`. It
catches any change of the model, data, init, optimizer or step program that moves the
loss. Tolerance: a CPU with another vector ISA compiles other fp32 roundings (XLA's CPU
codegen picks the ISA). Measured against the stored trace (written on an AVX-512 machine):
XLA_FLAGS=--xla_cpu_max_isa=AVX2 0 (identical), --xla_cpu_max_isa=SSE4_2 2.2e-7 relative
at worst over the 60 steps. The bound, 2e-5, is 100x that and still far below what a real
change of the program moves (a 1 % lr change: 2.0e-3 relative at worst, 1.4e-3 at the last
step, measured)."""

import json
import os
from pathlib import Path

import numpy as np

from adamspike.rundir import load_run
from adamspike.train_config import RunConfig
from simulate.llama_train import train

GOLDEN = Path(__file__).parent / "golden" / "tiny_llama_loss.json"
SETTINGS = {"model.preset": "tiny", "data.task": "markov", "train.num_steps": 60,
            "train.global_batch_size": 8, "train.seq_len": 32, "optim.lr": 3e-3,
            "optim.warmup_steps": 5, "optim.schedule": "cosine", "optim.b2": 0.95,
            "optim.eps": 1e-8, "optim.grad_clip": 1.0, "optim.weight_decay": 0.1,
            "telemetry.enabled": False}
RTOL = 2e-5


def _trace(tmp_path, **over):
    run = load_run(train(RunConfig.from_dict({**SETTINGS, **over}), tmp_path / "run",
                         progress=False), tables=("steps",))
    return run.steps.sort_values("step")["loss"].to_numpy(np.float64)


def test_tiny_llama_loss_matches_the_stored_trace(tmp_path):
    loss = _trace(tmp_path)
    if os.environ.get("ADAMSPIKE_WRITE_GOLDEN"):
        GOLDEN.write_text(json.dumps({"settings": SETTINGS, "loss": loss.tolist()}, indent=1))
    want = json.loads(GOLDEN.read_text())
    assert want["settings"] == SETTINGS
    np.testing.assert_allclose(loss, want["loss"], rtol=RTOL)
    assert loss[-1] < loss[0] - 0.5          # and it learns
