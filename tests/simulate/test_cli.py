"""simulate.cli + simulate.runner: run directories load_run reads completely; bad input -> 2."""

import json

import numpy as np
import pytest

from adamspike.metrics import NUM_HIST_BINS
from adamspike.rundir import LAYER_COLUMNS, STEP_COLUMNS, load_run
from simulate.cli import simulate_main


def _cols_ok(run, num_steps, num_tensors):
    assert list(run.steps.columns[:len(STEP_COLUMNS)]) == list(STEP_COLUMNS)
    assert len(run.steps) == num_steps and (run.steps.step.to_numpy() == np.arange(1, num_steps + 1)).all()
    assert not run.steps.skipped.any()
    assert set(LAYER_COLUMNS) <= set(run.layers.columns)
    assert len(run.layers) == num_steps * num_tensors
    assert run.steps[["loss", "lr", "grad_norm", "update_norm"]].notna().all().all()
    assert list(run.events.type) == ["problem", "finished"]


def test_quadratic_run_directory(tmp_path, capsys):
    out = tmp_path / "q"
    rc = simulate_main(["quadratic", "--eps", "1e-4", "--steps", "2000", "--b2", "0.99",
                        "--out", str(out), "--no-progress"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["eps_star"] == pytest.approx(1e-2 * 0.1 / (2 * 1.9))
    run = load_run(out)
    _cols_ok(run, 2000, 1)
    assert {"log10_loss", "lam_hat_grad", "lam_hat_max", "threshold"} <= set(run.steps.columns)
    assert run.meta["backend"] == "jax" and run.config["optim"]["eps"] == 1e-4
    assert run.config["problem"] == {"kind": "quadratic", "seed": 0,
                                     "eps_star": pytest.approx(summary["eps_star"])}
    assert (run.steps.tokens == run.steps.step).all()
    assert run.layers.name.astype(str).unique().tolist() == ["theta"]
    np.testing.assert_allclose(run.layers.rho, run.layers.grad_rms / 1e-4, rtol=1e-6)


def test_mlp_run_directory(tmp_path, capsys):
    out = tmp_path / "m"
    rc = simulate_main(["mlp", "--kind", "deep", "--width", "8", "--depth", "2",
                        "--num-points", "32", "--batch-size", "8", "--steps", "60",
                        "--hist-every", "20", "--grad-clip", "0.1", "--lr", "1e-2", "--curvature",
                        "--out", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    run = load_run(out)
    _cols_ok(run, 60, 6)
    assert (run.steps.tokens == 8 * run.steps.step).all() and run.steps.clipped.any()
    assert sorted(run.hists.step.unique()) == [20, 40, 60] and len(run.hists) == 3 * 6
    counts = np.stack(run.hists.counts.to_numpy())
    assert counts.shape[1] == NUM_HIST_BINS
    numel = dict(zip(run.layers.name.astype(str), run.layers.numel))
    assert (counts.sum(1) == [numel[n] for n in run.hists.name.astype(str)]).all()
    assert set(run.layers.kind.astype(str)) == {"param", "output"}
    assert run.config["optim"]["grad_clip"] == 0.1
    assert np.isfinite(run.steps.lam_hat_grad).all()
    np.testing.assert_allclose(run.steps.threshold, 2 / run.steps.lr, rtol=1e-6)


def test_streams_json(tmp_path):
    out = tmp_path / "s.json"
    assert simulate_main(["streams", "--steps", "20", "--coords", "1024", "--phi", "0.5",
                          "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert 0.0 < res["stats"]["r_rms"] < 1.0 and res["config"]["phi"] == 0.5


@pytest.mark.parametrize("argv,needle", [
    (["quadratic", "--eps", "-1"], "optim.eps: must be >= 0"),
    (["quadratic", "--b2", "1.0"], "optim.b2: must be < 1"),
    (["quadratic", "--quadratic.dim", "0"], "quadratic.dim (--dim): must be >= 1"),
    (["quadratic", "--steps", "0"], "train.num_steps (--steps): must be >= 1"),
    (["quadratic", "--rotate=yes"], "--rotate"),
    (["quadratic", "--dtype", "float16"], "quadratic.dtype"),
    (["quadratic", "--stepz", "5"], "unknown config key: stepz"),
    (["quadratic", "--dim", "2", "--lam-min", "3"], "--lam-min"),
    (["mlp", "--kind", "cnn"], "--kind"),
    (["mlp", "--lr", "0"], "optim.lr: must be > 0"),
    (["mlp", "--schedule", "step"], "optim.schedule"),
    (["mlp", "--loss-scale", "0"], "train.loss_scale"),
    (["mlp", "--steps", "x"], "--steps"),
    (["mlp", "--batch-size", "-1"], "mlp.batch (--batch-size)"),
    (["mlp", "--mitigation.v_reset_steps", "5"], "mitigation.v_reset_steps"),
    (["streams", "--record", "some"], "--record"),
    (["nope"], "problem"),
])
def test_bad_arguments_exit_2_naming_the_parameter(tmp_path, capsys, argv, needle):
    out = tmp_path / "never"
    extra = [] if argv[0] in ("nope", "streams") else ["--out", str(out)]
    assert simulate_main(argv + extra) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not out.exists()


def test_existing_run_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert simulate_main(["quadratic", "--steps", "10", "--out", str(out)]) == 2
    assert "--out" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "precious" and len(list(out.iterdir())) == 1
    assert simulate_main(["quadratic", "--steps", "10"]) == 2  # --out is required
    assert "--out" in capsys.readouterr().err


def test_runner_rejects_bad_traces_before_writing(tmp_path):
    from simulate.runner import write_run
    n = 5
    base = {"loss": np.ones(n), "lr": np.ones(n), "grad_norm": np.ones(n),
            "clipped": np.zeros(n, bool), "update_norm": np.ones(n)}
    with pytest.raises(ValueError, match="update_norm"):
        write_run(tmp_path / "a", {k: v for k, v in base.items() if k != "update_norm"},
                  config={}, problem={}, progress=False)
    bad = {**base, "sums": np.zeros((n, 2, 3)), "names": ["a", "b"]}
    with pytest.raises(ValueError, match="sums"):
        write_run(tmp_path / "b", bad, config={}, problem={}, progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
