"""`adamspike figures`: every run figure written, missing modules reported, bad input exit 2."""

import pytest

from adamspike.rundir import RunWriter
from figures import fig_loss_spikes
from figures.cli import find_runs, generate, main, run_names


def test_generate_run_figures_and_report_missing(small_run, small_analysis, tmp_path):
    registry = [("figures.fig_loss_spikes", "run"), ("figures.fig_layer_grad_rms", "run"),
                ("figures.fig_does_not_exist", "theory"), ("figures.fig_phase_diagram", "sweep")]
    files, outcomes = generate([small_run], tmp_path / "figs", registry=registry,
                               analysis=small_analysis)
    status = {o.module: o.status for o in outcomes}
    assert status == {"figures.fig_loss_spikes": "ok", "figures.fig_layer_grad_rms": "ok",
                      "figures.fig_does_not_exist": "missing",
                      "figures.fig_phase_diagram": "skipped"}
    assert {f.name for f in files} == {"loss_spikes.png", "loss_spikes.pdf",
                                       "layer_grad_rms.png", "layer_grad_rms.pdf"}
    assert all(f.parent.name == "small" and f.stat().st_size > 1000 for f in files)


def test_main_from_study(small_run, small_analysis, tmp_path, capsys, monkeypatch):
    """--from-study: the runs of runs/, drawn from the tables of analysis/."""
    import figures.cli as cli
    monkeypatch.setattr(cli, "REGISTRY", [("figures.fig_r_heatmap", "run"),
                                          ("figures.fig_precursors", "run"),
                                          ("figures.fig_phase_diagram", "sweep")])
    study = tmp_path / "study" / "runs"
    study.mkdir(parents=True)
    (study / "small").symlink_to(small_run, target_is_directory=True)
    (tmp_path / "study" / "analysis").symlink_to(small_analysis, target_is_directory=True)
    rc = main(["--from-study", str(tmp_path / "study"), "--out", str(tmp_path / "o"),
               "--no-theory"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    written = out.split()
    for stem in ("r_heatmap", "precursors"):
        assert any(w.endswith(f"small/{stem}.pdf") for w in written)
    assert "skipped  figures.fig_phase_diagram" in err


def test_figure_main_bad_input(tmp_path, capsys):
    assert main([str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    assert "no run.json" in capsys.readouterr().err
    with RunWriter(tmp_path / "steps_only", backend="torch", config={}) as w:
        for s in range(1, 5):
            w.log_step(step=s, tokens=s, loss=1.0, lr=1e-3, grad_norm=1.0, clipped=False,
                       update_norm=0.1, step_time_s=0.1, skipped=False)
    from figures import fig_layer_grad_rms
    assert fig_layer_grad_rms.main([str(tmp_path / "steps_only"), "--out", str(tmp_path)]) == 2
    assert "no per-layer telemetry" in capsys.readouterr().err
    # drawn from `adamspike analyze`'s tables: without them, bad input that says so
    assert fig_loss_spikes.main([str(tmp_path / "steps_only"), "--out", str(tmp_path / "f")]) == 2
    assert "adamspike analyze" in capsys.readouterr().err


def test_find_runs_and_names(small_run, tmp_path):
    (tmp_path / "a" / "x").mkdir(parents=True)
    (tmp_path / "a" / "x" / "run.json").write_text("{}")
    (tmp_path / "b" / "x").mkdir(parents=True)
    (tmp_path / "b" / "x" / "run.json").write_text("{}")
    runs = find_runs(tmp_path)
    assert [r.parent.name for r in runs] == ["a", "b"]
    assert run_names(runs) == ["a_x", "b_x"]


def test_registry_calls_main_with_inputs(tmp_path, monkeypatch):
    # stand-ins for the theory / replication scripts: they record argv and write a file
    mod_dir = tmp_path / "mods"
    mod_dir.mkdir()
    (mod_dir / "fake_theory_fig.py").write_text(
        "import sys, pathlib\n"
        "def main(argv):\n"
        "    i = argv.index('--out'); d = pathlib.Path(argv[i + 1]); d.mkdir(parents=True)\n"
        "    (d / 'fake.png').write_text(' '.join(argv)); return 0  # accepts \"--set\"\n")
    (mod_dir / "fake_broken_fig.py").write_text(
        "def main(argv):\n    raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(mod_dir))
    table = tmp_path / "replication"
    table.mkdir()
    files, outcomes = generate([], tmp_path / "o", replication=table,
                               sets=["fake_theory_fig.draws=10", "fig_other.draws=5"],
                               registry=[("fake_theory_fig", "theory"),
                                         ("fake_broken_fig", "replication")])
    st = {o.module: (o.status, o.detail) for o in outcomes}
    assert st["fake_theory_fig"] == ("ok", "")
    assert st["fake_broken_fig"] == ("failed", "RuntimeError: boom")
    assert [f.name for f in files] == ["fake.png"]
    assert files[0].read_text().endswith("--set draws=10")        # its own sizes only


def test_calibration_figure_from_a_spike_rate_directory(tmp_path, capsys):
    """figures.fig_calibration on what `adamspike spike-rate` writes (a seeded sweep-like
    table), through the figures CLI's spike_rate kind; a missing directory is exit 2."""
    import numpy as np
    import pandas as pd

    from analysis.spike_rate import main as spike_rate
    from figures import fig_calibration
    rng = np.random.default_rng(1)
    rows = [{"problem": "mlp", "cell_id": f"c{w}{e}{b2}", "mlp.width": w, "optim.eps": e,
             "optim.b2": b2, "optim.lr": 1e-2, "train.num_steps": 2000, "seed": s,
             "median_rho": 1e-2 / e, "num_spikes": rng.poisson(2.0 * (e < 1e-4) + 0.1),
             "diverged": False}
            for w in (16, 32, 64) for e in (1e-8, 1e-4, 1e-2) for b2 in (0.95, 0.999)
            for s in range(3)]
    pd.DataFrame(rows).to_csv(tmp_path / "runs.csv", index=False)
    sr = tmp_path / "sr"
    assert spike_rate(["--sweep", str(tmp_path / "runs.csv"), "--out", str(sr),
                       "--n-boot", "10"]) == 0
    files, outcomes = generate([], tmp_path / "figs", spike_rate=sr, theory=False,
                               registry=[("figures.fig_calibration", "spike_rate")])
    assert [o.status for o in outcomes] == ["ok"]
    assert {f.name for f in files} == {"calibration.png", "calibration.pdf"}
    assert all(f.stat().st_size > 0 for f in files)
    assert fig_calibration.main(["--spike-rate", str(tmp_path / "none"), "--out",
                                 str(tmp_path / "x")]) == 2


def test_batch_sharpness_figure_from_its_directory(tmp_path):
    """figures.fig_batch_sharpness on the files simulate.batch_sharpness writes (its own
    summarize on known values, 5 rungs so the law and the 70B reading exist), through the
    figures CLI's batch_sharpness kind; a missing directory is exit 2."""
    import json

    import numpy as np

    from figures import fig_batch_sharpness
    from simulate import batch_sharpness as BS
    n = [512, 2048, 8192, 32768]
    cells = [{"dim": dim, "layers": L, "seed": 0, "lr": 1e-3, "final_loss": 1.0,
              "eval": [{"tokens": t, "lambda": 0.01 * dim ** 0.5 + 50.0 / t, "change": 0.0}
                       for t in n]}
             for dim, L in [(32, 4), (64, 4), (128, 4), (64, 2), (64, 8)]]
    long, summary = BS.summarize(cells)
    d = tmp_path / "bs"
    d.mkdir()
    long.to_csv(d / "batch_sharpness.csv", index=False)
    (d / "summary.json").write_text(json.dumps(summary))
    files, outcomes = generate([], tmp_path / "figs", batch_sharpness=d, theory=False,
                               registry=[("figures.fig_batch_sharpness", "batch_sharpness")])
    assert [o.status for o in outcomes] == ["ok"], [o.detail for o in outcomes]
    assert {f.name for f in files} == {"batch_sharpness.png", "batch_sharpness.pdf"}
    assert np.isclose(summary["law"]["dim"], 0.5, atol=0.05)    # what the figure draws
    assert fig_batch_sharpness.main(["--batch-sharpness", str(tmp_path / "none"), "--out",
                                     str(tmp_path / "x")]) == 2
