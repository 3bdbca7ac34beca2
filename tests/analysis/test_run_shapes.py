"""Issue 39 item 8: one config path per toy, and `analyze` reads every run.json shape the
project writes. One run per writer of run directories (grep RunWriter / write_run: the
quadratic and MLP toys through the simulate CLI and the sweep's --save-runs, which share one
config and one writer; the JAX tiny-LLaMA trainer (`simulate llama`, the study's toy and
matched-toy stages); the torch trainer (`train`, the study's torch_run stage) and the
Megatron probe, in subprocesses (torch stays out of this process); analysis.synthetic; a
Megatron log import), and a run directory in the older sweep shape (dotted keys, `problem`
a bare name) that raised AttributeError: each analysed, with its optimizer settings found."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from adamspike.rundir import load_run, normalize_config
from analysis.report import analyze_run
from study.cli import main as cli
from tests.analysis.test_watch import core_line

ROOT = Path(__file__).resolve().parents[2]


def _check(run_dir, eps):
    ra = analyze_run(run_dir)
    cfg = load_run(run_dir, tables=("steps",)).config
    assert isinstance(cfg.get("problem", {}), dict)
    assert cfg["optim"]["eps"] == pytest.approx(eps)
    assert ra.num_steps > 0
    return ra


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


def _analyze(run_dir, tmp_path, eps, backend):
    """analyze_run and `adamspike analyze` on a run directory: no error, the config in the
    one shape (problem a table, optim.eps the run's), the backend stated."""
    ra = _check(run_dir, eps)
    meta = json.loads((Path(run_dir) / "run.json").read_text())
    assert meta["backend"] == backend and meta["schema_version"] >= 1
    out = tmp_path / f"an-{Path(run_dir).name}"
    assert cli(["analyze", str(run_dir), "--out", str(out), "--no-figures"]) == 0
    assert (out / "summary.json").is_file() or any(out.rglob("summary.json"))
    return ra


def test_one_config_per_toy_cli_and_sweep_write_the_same_run_json(tmp_path):
    """The simulate CLI's flags are the sweep's dotted keys: the same setting through
    `simulate quadratic|mlp` and through a sweep cell's --save-runs gives the same run.json
    config (one schema, one set of defaults, one writer) and the same loss trace."""
    from adamspike.rundir import load_run as lr
    for problem, flags, grid in [
        ("quadratic", ["--steps", "150", "--eps", "1e-6", "--noise", "1e-9"],
         "[fixed]\ntrain.num_steps = 150\nquadratic.noise = 1e-9\n[grid]\noptim.eps = [1e-6]\n"),
        ("mlp", ["--width", "8", "--num-points", "32", "--batch-size", "8", "--steps", "30",
                 "--eps", "1e-6"],
         "[fixed]\ntrain.num_steps = 30\nmlp.width = 8\nmlp.num_points = 32\nmlp.batch = 8\n"
         "[grid]\noptim.eps = [1e-6]\n"),
    ]:
        a = tmp_path / f"{problem}-cli"
        assert cli(["simulate", problem, *flags, "--out", str(a), "--no-progress"]) == 0
        g = tmp_path / f"{problem}.toml"
        g.write_text(f"[sweep]\nproblem = '{problem}'\nseeds = 1\n{grid}")
        assert cli(["sweep", "run", "--grid", str(g), "--out", str(tmp_path / f"{problem}-sw"),
                    "--save-runs", "1", "--no-progress"]) == 0
        (b,) = (tmp_path / f"{problem}-sw" / "runs").iterdir()
        ca, cb = (json.loads((d / "run.json").read_text())["config"] for d in (a, b))
        assert ca == cb, (problem, ca, cb)
        assert ca["problem"]["kind"] == problem and ca["train"]["seed"] == 0
        la, lb = (lr(d, tables=("steps",)).steps["loss"].to_numpy() for d in (a, b))
        assert (la == lb).all()
    assert "schedule" not in ca["optim"] or problem == "mlp"


@pytest.mark.slow
def test_every_run_directory_writer_is_analysed(tmp_path):
    """Every writer of run directories, on tiny settings, then `analyze` on each."""
    py = [sys.executable]
    runs = []      # (run dir, eps, backend)
    q = tmp_path / "quadratic"
    assert cli(["simulate", "quadratic", "--steps", "200", "--eps", "1e-4", "--out", str(q),
                "--no-progress"]) == 0
    runs.append((q, 1e-4, "jax"))
    m = tmp_path / "mlp"
    assert cli(["simulate", "mlp", "--steps", "40", "--width", "16", "--num-points", "32",
                "--eps", "1e-6", "--out", str(m), "--no-progress"]) == 0
    runs.append((m, 1e-6, "jax"))
    for problem, steps in (("quadratic", 200), ("mlp", 40)):
        g = tmp_path / f"g-{problem}.toml"
        g.write_text(f"[sweep]\nproblem = '{problem}'\nseeds = 1\n[fixed]\n"
                     f"train.num_steps = {steps}\n[grid]\noptim.eps = [1e-6]\n")
        assert cli(["sweep", "run", "--grid", str(g), "--out", str(tmp_path / f"sw-{problem}"),
                    "--save-runs", "1", "--no-progress"]) == 0
        (d,) = (tmp_path / f"sw-{problem}" / "runs").iterdir()
        runs.append((d, 1e-6, "jax"))
    ll = tmp_path / "llama"
    assert cli(["simulate", "llama", "--config", str(ROOT / "configs" / "tiny.toml"),
                "--train.num_steps", "6", "--telemetry.hist_every", "3", "--out", str(ll),
                "--no-progress"]) == 0
    runs.append((ll, 1e-8, "jax"))
    tt = tmp_path / "torch"
    env_cmd = [*py, "-m", "study", "train", "--config", str(ROOT / "configs" / "tiny.toml"),
               "--train.num_steps", "4", "--telemetry.hist_every", "2", "--out", str(tt)]
    r = subprocess.run(env_cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    runs.append((tt, 1e-8, "torch"))
    pr = tmp_path / "probe"
    r = subprocess.run([*py, str(ROOT / "tests" / "compat" / "probe_adamw.py"), str(pr),
                        "--steps", "4"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    runs.append((pr / "run", 1e-8, "megatron"))
    from analysis.synthetic import write_synthetic_run
    runs.append((write_synthetic_run(tmp_path / "synthetic", num_steps=120, spikes=(80,),
                                     lead=5, seed=0), None, "torch"))
    log = tmp_path / "m.log"
    log.write_text("\n".join(core_line(i, 3.0 - 0.001 * i) for i in range(1, 40)) + "\n")
    assert cli(["analyze", "--log", str(log), "--eps", "1e-8", "--out",
                str(tmp_path / "imp"), "--no-figures"]) == 0
    runs.append((tmp_path / "imp" / "m.log.run", 1e-8, "megatron"))
    for run_dir, eps, backend in runs:
        if eps is None:
            eps = load_run(run_dir, tables=("steps",)).config["optim"]["eps"]
        _analyze(run_dir, tmp_path, eps, backend)
