"""`adamspike analyze --predictions`: a toy run directory and a Megatron-format log scored
end to end against a pre-registered predictions.json (rate interval, hash, alarm lift)."""

import json

import numpy as np
import pytest

from adamspike.predictions import AlarmRule, Predictions, save_predictions
from analysis.cli import main as analyze
from analysis.synthetic import write_synthetic_run


def _setting(sid, eps, b2, lr, bs, rate, lo, hi):
    return {"id": sid, "overrides": {"optim.b1": 0.9, "optim.b2": b2, "optim.eps": eps,
                                     "optim.lr": lr, "train.global_batch_size": bs},
            "rate_per_1k": rate, "rate_ci": [lo, hi], "p_spike": 0.5, "risk": 0.5,
            "risk_label": "medium", "extrapolated": True, "rank": 1}


def _megatron_log(path, spikes=(150, 260), n=400, seed=0):
    rng = np.random.default_rng(seed)
    lines = []
    for it in range(1, n + 1):
        loss = 2.5 + 0.01 * rng.standard_normal() + (4.0 if it in spikes else 0.0)
        lines.append(f" [2024-06-01 12:00:01] iteration {it:8d}/{n:8d} | consumed samples: "
                     f"{it * 1024:12d} | elapsed time per iteration (ms): 15000.0 | learning "
                     f"rate: 1.500000E-04 | global batch size:  1024 | lm loss: {loss:.6E} | "
                     f"loss scale: 1.0 | grad norm: {0.5 + 0.01 * rng.random():.3f} | number of "
                     "skipped iterations:   0 | number of nan iterations:   0 |")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    d = tmp_path_factory.mktemp("score")
    run = write_synthetic_run(d / "toy", num_steps=600, spikes=(300, 450), lead=10, seed=0)
    log = _megatron_log(d / "megatron.log")
    settings = [
        # the toy run's config: eps 1e-5, b2 0.95, lr 1e-3, batch 16 -> 2 spikes / 600 steps
        _setting("toy", 1e-5, 0.95, 1e-3, 16, 2.0, 0.5, 2.5),
        # the log's: eps 1e-5 (--eps), b2 0.95 (--b2), lr 1.5e-4 and batch 1024 from the log;
        # 2 spikes / 400 steps = 5 per 1k: above this interval
        _setting("log", 1e-5, 0.95, 1.5e-4, 1024, 0.3, 0.1, 0.5),
        _setting("other", 1e-8, 0.99, 3e-4, 2048, 0.1, 0.01, 0.3),
    ]
    rules = [AlarmRule(id="rms_t_shallow", metric="rms_t", threshold=1.5, depths=(-1, 0),
                       expected_lead_steps=(1, 12)),
             # holds from the first logged step on: fires once, far from any spike
             AlarmRule(id="always", metric="rho", op=">", threshold=0.0, expected_lead_steps=(1, 12))]
    pred = d / "pred.json"
    save_predictions(Predictions(settings=settings, alarm_rules=rules, validate=["toy"]), pred)
    return d, run, log, pred


def test_run_and_megatron_log_scored_end_to_end(study, capsys):
    d, run, log, pred = study
    out = d / "report"
    assert analyze([str(run), "--log", str(log), "--b2", "0.95", "--eps", "1e-5",
                    "--predictions", str(pred), "--out", str(out)]) == 0
    scores = json.loads((out / "prediction_scores.json").read_text())
    assert scores["integrity"]["status"] == "ok"
    by = {r["setting"]: r for r in scores["rates"]}
    toy, lg = by["toy"], by["log"]
    assert toy["num_spikes"] == 2 and toy["observed_rate_per_1k"] == pytest.approx(2000 / 600)
    assert toy["verdict"] == "above" and toy["match"].startswith("exact match")
    assert lg["backend"] == "megatron" and lg["num_spikes"] == 2 and lg["num_steps"] == 400
    assert lg["observed_rate_per_1k"] == pytest.approx(5.0) and lg["verdict"] == "above"
    assert lg["match"].startswith("exact match") and "global batch from the log" in lg["value_notes"]
    assert lg["p_above"] < 0.05 and not lg["count_consistent"]
    alarms = {a["rule"]: a for a in scores["alarms"]}
    assert alarms["rms_t_shallow"]["lift"] > 1 and alarms["rms_t_shallow"]["lead_min"] >= 1
    assert alarms["always"]["lift"] <= 1 and not alarms["always"]["informative"]
    scored = json.loads((out / "predictions.scored.json").read_text())
    flags = {r["id"]: r.get("informative") for r in scored["alarm_rules"]}
    assert flags["always"] is False
    assert "content_sha256" not in scored and scored["scored_from"]["integrity"] == "ok"
    report = (out / "report.md").read_text()
    assert "## Scores against the predictions" in report and "Uninformative: " in report


def test_nearest_setting_when_none_matches(study):
    d, run, _, pred = study
    data = json.loads(pred.read_text())
    from adamspike.predictions import content_hash
    for s in data["settings"]:
        if s["id"] == "toy":
            s["overrides"]["optim.lr"] = 2e-3
    data["content_sha256"] = content_hash(data)
    p2 = d / "pred_nearest.json"
    p2.write_text(json.dumps(data))
    out = d / "report_nearest"
    assert analyze([str(run), "--predictions", str(p2), "--out", str(out)]) == 0
    r = json.loads((out / "prediction_scores.json").read_text())["rates"][0]
    assert r["setting"] == "toy" and r["match"].startswith("no setting matches")
    assert "optim.lr" in r["match"]


def test_tampered_file_is_refused_and_unhashed_file_warns(study, capsys):
    d, run, _, pred = study
    data = json.loads(pred.read_text())
    data["settings"][0]["rate_ci"] = [0.0, 100.0]          # edited after pre-registration
    bad = d / "tampered.json"
    bad.write_text(json.dumps(data))
    assert analyze([str(run), "--predictions", str(bad), "--out", str(d / "r1")]) == 2
    assert "content hash mismatch" in capsys.readouterr().err
    assert not (d / "r1" / "report.md").exists()
    del data["content_sha256"]
    unhashed = d / "unhashed.json"
    unhashed.write_text(json.dumps(data))
    assert analyze([str(run), "--predictions", str(unhashed), "--out", str(d / "r2")]) == 0
    assert "not pre-registered" in capsys.readouterr().err
    assert "not pre-registered" in (d / "r2" / "report.md").read_text()


def test_megatron_log_export_round_trips_the_steps(study, tmp_path, capsys):
    from study.cli import main as adamspike
    from adamspike.rundir import load_run
    from analysis.megatron_log import read_megatron_log
    _, run, _, _ = study
    log = tmp_path / "toy.log"
    assert adamspike(["megatron-log", str(run), "--out", str(log)]) == 0
    parsed = read_megatron_log(log)
    steps = load_run(run, tables=("steps",)).steps
    assert parsed.stats["num_malformed"] == 0 and len(parsed.steps) == len(steps)
    np.testing.assert_allclose(parsed.steps["loss"], steps["loss"], rtol=1e-6)
    np.testing.assert_allclose(parsed.steps["grad_norm"], steps["grad_norm"], rtol=1e-6)
    assert (parsed.steps["global_batch_size"] == 16).all()
    assert adamspike(["megatron-log", str(run), "--out", str(log)]) == 2   # never overwritten


def test_spike_rate_cli_fits_validates_and_refuses_to_overwrite(study, tmp_path, capsys):
    import pandas as pd
    from analysis.spike_rate import main as spike_rate
    _, run, _, _ = study
    rng = np.random.default_rng(0)
    rows = [{"problem": "mlp", "cell_id": f"c{w}{e}{b2}", "mlp.width": w, "optim.eps": e,
             "optim.b2": b2, "optim.lr": 1e-2, "train.num_steps": 2000, "seed": s,
             "median_rho": 1e-2 / e * (1 + 0.1 * s),
             "num_spikes": rng.poisson(2.0 * (1e-2 / e < 10) + 0.1), "diverged": False,
             "mlp.num_points": 256, "mlp.batch": 0}
            for w in (16, 32, 64) for e in (1e-8, 1e-4, 1e-2) for b2 in (0.95, 0.999)
            for s in range(3)]
    table = tmp_path / "runs.csv"
    pd.DataFrame(rows).to_csv(table, index=False)
    out = tmp_path / "sr"
    assert spike_rate(["--sweep", str(table), "--runs", str(run), str(tmp_path / "absent"),
                       "--out", str(out), "--n-boot", "20"]) == 0
    model = json.loads((out / "model.json").read_text())
    assert model["n_runs"] == 55 and "log10_rho_shallow" in model["features"]
    val = model["validation"]
    assert "width 64" in val["split"] and val["n_heldout"] == 18
    for k in ("log_loss", "brier"):
        assert np.isfinite(val["model"][k]) and np.isfinite(val["baseline"][k])
    assert any("absent" in n for n in model["notes"])
    cal = pd.read_csv(out / "calibration.csv")
    assert cal["n_runs"].sum() == 18
    report = (out / "report.md").read_text()
    assert "Held-out validation" in report and "constant rate" in report
    assert spike_rate(["--sweep", str(table), "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err
