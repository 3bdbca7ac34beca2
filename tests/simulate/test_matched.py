"""simulate.matched: group rho / dormancy / wake-up bookkeeping and the report on a run
directory with known numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from adamspike.metrics import METRIC_NAMES
from adamspike.rundir import RunWriter
from simulate import matched as M


@pytest.fixture
def run(tmp_path):
    """L = 2 (shallow block 0, deep block 1); eps 1e-6. The embedding is dormant
    (eps_frac 0.9) on steps 10..60 and wakes at 70; a loss spike at step 150."""
    path = tmp_path / "matched_70b"
    cfg = {"model": {"num_layers": 2}, "optim": {"eps": 1e-6, "b2": 0.95}}
    with RunWriter(path, backend="jax", config=cfg) as w:
        w.event("start", step=0, entropy_rate=1.5)
        for step in range(1, 201):
            loss = 2.0 + 0.01 * np.sin(step) + (1.0 if step == 150 else 0.0)
            w.log_step(step=step, tokens=step * 8, loss=loss, lr=1e-3, grad_norm=0.5,
                       clipped=False, update_norm=0.1, step_time_s=0.01, skipped=False)
            if step % 10:
                continue
            rows = []
            for name, depth, numel, g, ef in (("tok", -1, 100, 2e-6, 0.9 if step <= 60 else 0.1),
                                              ("b0a", 0, 100, 1e-6, 0.0), ("b0b", 0, 300, 3e-6, 0.2),
                                              ("b1", 1, 100, 5e-6, 0.0), ("out", 2, 100, 1e-5, 0.0)):
                m = {k: 0.0 for k in METRIC_NAMES}
                m.update(grad_rms=g, rho=g / 1e-6, eps_frac=ef)   # rho: each tensor's own eps
                rows.append({"name": name, "depth": depth, "kind": "w1", "numel": numel, **m})
            w.log_layers(step, rows=rows)
            if step % 50 == 0:
                w.log_curvature(step, "shallow", precond_curvature=3000.0 if step == 150 else 10.0,
                                raw_curvature=1.0, lr=1e-3)
    return path


def test_trajectories_and_wakeups(run):
    from adamspike.rundir import load_run
    r = load_run(run, tables=("steps", "layers"))
    t = M.trajectories(r)
    sh = t[t["group"] == "shallow"].iloc[0]
    # numel-weighted: sqrt((100 * 1e-12 + 300 * 9e-12) / 400) / 1e-6
    assert sh["rho"] == pytest.approx(np.sqrt((100 * 1 + 300 * 9) / 400))
    assert sh["eps_frac"] == pytest.approx(0.15)
    emb = t[t["group"] == "embed"]
    assert emb["dormant"].sum() == 6
    w = M.wakeups(t)
    assert w.to_dict("records") == [{"group": "embed", "step": 70, "dormant_logged_steps": 6}]


def test_report(run, tmp_path):
    pred = tmp_path / "p.json"
    pred.write_text(json.dumps({"profile": {"eps_ref": 1e-5, "source": "ladder fit (test)",
                                            "by_depth": [{"depth": -1, "group": "embed", "rho": 0.1},
                                                         {"depth": 0, "group": "shallow", "rho": 1.0}]}}))
    out = tmp_path / "matched"
    assert M.main(["--runs", str(run), "--predictions", str(pred), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "| matched_70b | 1e-06 | 0.95 | fp32 | 200 | " in text
    assert "1: 150 (+" in text                       # the spike, >= 10 % rule
    assert "shallow max 1.5" in text                 # 3000 * 1e-3 / 2
    assert "(1 of 4 evaluations > 1)" in text
    assert "spike at 150: embed woke at 70" in text  # within the 100 steps before
    assert (out / "trajectories.csv").stat().st_size > 0
    assert M.main(["--runs", str(tmp_path / "nope"), "--predictions", str(pred),
                   "--out", str(out)]) == 2


def test_group_eps_label_and_rho_from_each_tensors_eps():
    assert M._eps_label(1e-5, {"embed": None, "shallow": None, "deep": None, "head": None}) == "1e-05"
    lab = M._eps_label(1e-5, {"embed": 1e-3, "shallow": None, "deep": 2e-3, "head": None})
    assert lab == "embed 0.001 / shallow 1e-05 / deep 0.002 / head 0.002"   # head: eps_deep
