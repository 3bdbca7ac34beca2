"""bench/bench_probe_megatron.py --smoke (the one-node device smoke test) runs end to end:
here on CPU through the test harness's CUDA -> CPU redirection, tiny sizes, 5 steps, so
the script users run on a GPU / NPU does not rot."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smoke_script_measures_probe_on_and_off():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_probe_megatron.py"), "--smoke",
                        "--device", "cpu", "--hidden", "64", "--layers", "2", "--heads", "4",
                        "--vocab", "256", "--seq", "64", "--microbatches", "2", "--steps", "5"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = r.stdout.splitlines()
    assert out[0].startswith("one cpu:") and "median of 5 steps" in out[0]
    assert "probe off" in out[1] and "overhead" in out[1] and "DISABLED" not in out[1]
