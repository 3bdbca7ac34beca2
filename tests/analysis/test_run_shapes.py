"""Issue 39 item 8: `analyze` reads every run.json shape the project writes. One run per
writer of the quadratic / MLP toys (the simulate CLI, the sweep's --save-runs), a Megatron
log import, and a run directory in the older sweep shape (dotted keys, `problem` a bare
name) that raised AttributeError: each analysed, with its optimizer settings found."""

from __future__ import annotations

import json

import pytest

from adamspike.rundir import load_run, normalize_config
from analysis.report import analyze_run
from study.cli import main as cli
from tests.analysis.test_watch import core_line


def _check(run_dir, eps):
    ra = analyze_run(run_dir)
    cfg = load_run(run_dir, tables=("steps",)).config
    assert isinstance(cfg.get("problem", {}), dict)
    assert cfg["optim"]["eps"] == pytest.approx(eps)
    assert ra.num_steps > 0
    return ra


def test_simulate_cli_quadratic(tmp_path):
    out = tmp_path / "q"
    assert cli(["simulate", "quadratic", "--optim.eps", "1e-4", "--steps", "200", "--out",
                str(out), "--no-progress"]) == 0
    _check(out, 1e-4)
    raw = json.loads((out / "run.json").read_text())["config"]
    assert raw["optim"]["eps"] == 1e-4 and raw["problem"]["kind"] == "quadratic"


@pytest.mark.parametrize("problem, extra", [
    ("quadratic", "[fixed]\ntrain.num_steps = 200\n"),
    ("mlp", "[fixed]\ntrain.num_steps = 40\n"),
])
def test_sweep_save_runs(tmp_path, problem, extra):
    g = tmp_path / "g.toml"
    g.write_text(f"[sweep]\nproblem = '{problem}'\nseeds = 1\n{extra}"
                 "[grid]\noptim.eps = [1e-6]\n")
    out = tmp_path / "o"
    assert cli(["sweep", "run", "--grid", str(g), "--out", str(out), "--save-runs", "1",
                "--no-progress"]) == 0
    (run_dir,) = (out / "runs").iterdir()
    _check(run_dir, 1e-6)
    raw = json.loads((run_dir / "run.json").read_text())["config"]
    assert raw["problem"]["kind"] == problem and raw["optim"]["eps"] == 1e-6   # one shape
    assert cli(["analyze", str(run_dir), "--out", str(tmp_path / "an")]) == 0


def test_older_sweep_shape_and_a_log_import(tmp_path):
    """A run.json written before the sweep wrote the nested shape (dotted keys, `problem`
    a bare name) is read in the one shape (normalize_config), so analyze does not raise."""
    g = tmp_path / "g.toml"
    g.write_text("[sweep]\nproblem = 'quadratic'\nseeds = 1\n[fixed]\ntrain.num_steps = 200\n"
                 "[grid]\noptim.eps = [1e-6]\n")
    assert cli(["sweep", "run", "--grid", str(g), "--out", str(tmp_path / "o"), "--save-runs",
                "1", "--no-progress"]) == 0
    (run_dir,) = (tmp_path / "o" / "runs").iterdir()
    meta = json.loads((run_dir / "run.json").read_text())
    meta["config"] = {"problem": "quadratic", "train.num_steps": 200, "optim.eps": 1e-6,
                      "optim.lr": 0.01, "optim.b1": 0.9, "optim.b2": 0.95, "seed": 0}
    (run_dir / "run.json").write_text(json.dumps(meta))
    _check(run_dir, 1e-6)
    assert normalize_config(meta["config"])["problem"] == {"kind": "quadratic"}
    log = tmp_path / "m.log"
    log.write_text("\n".join(core_line(i, 3.0 - 0.001 * i) for i in range(1, 40)) + "\n")
    assert cli(["analyze", "--log", str(log), "--eps", "1e-8", "--out",
                str(tmp_path / "an")]) == 0
    _check(tmp_path / "an" / "m.log.run", 1e-8)
