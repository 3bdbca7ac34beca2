"""Optional W&B: the trainer (`telemetry.wandb = true`) and the probe (ADAMSPIKE_WANDB=1)
write their per-group telemetry to a W&B run when wandb is installed (offline by default,
in RUN/wandb); asked for without wandb: one line (the trainer: exit 2 before any file; the
probe: said, and the job goes on); not asked for: wandb is never imported."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

from adamspike.metrics import METRIC_NAMES
from fullscale.probe.tensorboard import GroupScalars, group_medians
from tests.fullscale.test_bad_inputs import CONFIG


def _columns():
    cols = {"name": ["a", "b", "c"], "kind": ["wq", "wq", "w2"],
            **{m: np.array([1.0, 3.0, 5.0]) for m in METRIC_NAMES}}
    return cols


def _train(tmp_path, *extra):
    from fullscale.train import main
    cfg = tmp_path / "run.toml"
    cfg.write_text(CONFIG)
    out = tmp_path / "run"
    return main(["--config", str(cfg), "--out", str(out), "--telemetry.wandb", "true",
                 *extra]), out


def test_the_trainer_asking_without_wandb_is_one_line_and_writes_nothing(tmp_path, capsys,
                                                                          monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)            # import wandb -> ImportError
    rc, out = _train(tmp_path)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("adamspike train: error:"), err
    assert "telemetry.wandb = true asks for W&B but the wandb package is not installed" in err
    assert not out.exists()


def test_the_probe_asking_without_wandb_says_one_line_and_goes_on(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setenv("ADAMSPIKE_WANDB", "1")
    gs = GroupScalars(str(tmp_path), enabled=False)
    assert gs.wandb is None and "\n" not in gs.wandb_error
    assert gs.wandb_error.startswith("ADAMSPIKE_WANDB=1 asks for W&B but the wandb package "
                                     "is not installed")
    gs.log(1, _columns())                                      # no W&B, no crash
    gs.close()


def test_not_asked_wandb_is_not_imported(tmp_path, monkeypatch):
    monkeypatch.delenv("ADAMSPIKE_WANDB", raising=False)
    imported_before = "wandb" in sys.modules
    gs = GroupScalars(str(tmp_path), enabled=False)
    gs.log(1, _columns())
    gs.close()
    assert gs.wandb is None and gs.wandb_error == ""
    assert imported_before or "wandb" not in sys.modules


def _offline_runs(run_dir: Path):
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def _records_hold(run: Path, *keys: bytes, wait_s: float = 30.0) -> bool:
    """The offline run's records (protobuf: keys as text) hold every key; wandb-core may
    write them a moment after finish() returns."""
    t0 = time.monotonic()
    while True:
        data = b"".join(p.read_bytes() for p in run.glob("*.wandb"))
        if all(k in data for k in keys) or time.monotonic() - t0 > wait_s:
            return all(k in data for k in keys)
        time.sleep(0.2)


def test_probe_and_trainer_write_wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)           # offline is the default
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("ADAMSPIKE_WANDB", "1")
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    gs = GroupScalars(str(probe_dir), enabled=False)
    assert gs.wandb is not None and gs.wandb.mode == "offline", gs.wandb_error
    cols = _columns()
    gs.wandb.run.log({"probe_check": 1.0}, step=0)
    gs.log(3, cols)
    gs.close()
    (run,) = _offline_runs(probe_dir)
    assert group_medians(cols)["adamspike/wq/rho"] == 2.0
    assert _records_hold(run, b"adamspike/wq/rho", b"adamspike/w2/update_rms")
    monkeypatch.delenv("ADAMSPIKE_WANDB")
    rc, out = _train(tmp_path)
    assert rc == 0
    (run,) = _offline_runs(out)
    assert _records_hold(run, b"train/loss", b"adamspike/embed/rho")
    assert wandb.run is None                                   # finished


def test_the_probe_in_a_job_says_it_once_and_its_run_is_complete(tmp_path, monkeypatch,
                                                                  capsys):
    """The probe on a plain AdamW loop (tests/compat/probe_adamw.py) with ADAMSPIKE_WANDB=1
    and no wandb: one line on stdout, and telemetry on every step as without W&B."""
    from adamspike.rundir import load_run
    from tests.fullscale.test_megatron_probe_plain import _demo
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setenv("ADAMSPIKE_WANDB", "1")
    run_dir = _demo().run(str(tmp_path), steps=4, plain=True)
    said = [ln for ln in capsys.readouterr().out.splitlines() if "W&B" in ln]
    assert len(said) == 1 and said[0].startswith(
        "adamspike probe: ADAMSPIKE_WANDB=1 asks for W&B but the wandb package is not "
        "installed"), said
    assert sorted(set(load_run(run_dir).layers["step"])) == [1, 2, 3, 4]
