"""`adamspike assess` (analysis.assess): one screen on a log or a run directory, from the
analysis `analyze` runs; the predicted rate from a predictions.json (or a plain 'none
available'), and the lower-rate settings grouped where the model cannot tell them apart."""

import json
import math

import pytest

from analysis.assess import assess
from analysis.report import analyze_run
from study.cli import main as cli
from tests.analysis.test_megatron_log import REAL_ONSETS, REALLOGS
from tests.analysis.test_watch import synthetic_log

FEATS = ("log10_rho_shallow", "log10_one_minus_b2", "log10_lr_over_eps")
COEFS = {"intercept": -5.0, "log10_rho_shallow": 0.33, "log10_one_minus_b2": -2.08,
         "log10_lr_over_eps": -0.13}


def _setting(sid, eps, bs, rate, ci):
    lr, b2 = 1.5e-4, 0.95
    f = {"log10_rho_shallow": math.log10(1e-5 / eps), "log10_one_minus_b2": math.log10(1 - b2),
         "log10_lr_over_eps": math.log10(lr / eps), "log10_tokens_per_step": math.log10(bs * 4096)}
    return {"id": sid, "overrides": {"optim.b1": 0.9, "optim.b2": b2, "optim.eps": eps,
                                     "optim.lr": lr, "train.global_batch_size": bs},
            "rate_per_1k": rate, "rate_ci": ci, "horizon_steps": 2000, "p_spike": 0.1,
            "features": f, "model_features": list(FEATS), "extrapolated": False}


def predictions_file(path):
    """A small schema-3 predictions file (not pre-registered: no hash): the log's setting
    (eps 1e-8), the same at batch 2048 (the model has no batch feature), eps 1e-6 (lower
    rate, overlapping interval), eps 1e-5 (lower, clear)."""
    data = {"schema": "adamspike.predictions", "schema_version": 3,
            "created": "2026-12-04T00:00:00Z", "source": {"test": True},
            "rate_model": {"features": list(FEATS),
                           "coefficients": {k: {"coef": v, "ci": [v - 0.1, v + 0.1]}
                                            for k, v in COEFS.items()}},
            "profile": {"name": "test-profile"},
            "settings": [_setting("e8", 1e-8, 1024, 0.30, [0.20, 0.40]),
                         _setting("e8-bs2048", 1e-8, 2048, 0.30, [0.20, 0.40]),
                         _setting("e6", 1e-6, 1024, 0.25, [0.15, 0.35]),
                         _setting("e5", 1e-5, 1024, 0.10, [0.05, 0.15])],
            "alarm_rules": [], "validate": ["e5"]}
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def log(tmp_path):
    p = tmp_path / "train.log"
    p.write_text("\n".join(synthetic_log()) + "\n")
    return p


def test_assess_a_log_with_predictions(log, tmp_path):
    text = assess(log, predictions=str(predictions_file(tmp_path / "p.json")),
                  optim={"eps": 1e-8, "b2": 0.95}, clip=1.0, num_params=7_000_000_000,
                  num_params_source="test", out=tmp_path / "out")
    print(text)
    ra = analyze_run(tmp_path / "out" / "train.log.run")
    body = " ".join(text.split())                              # unwrapped
    for head in ("REGIME", "SPIKES SO FAR", "NUMERICS HEALTH",
                 "PREDICTED SPIKE RATE FOR THIS SETTING", "SETTINGS THAT WOULD LOWER IT"):
        assert head in text
    assert f"{len(ra.spikes)} loss spike(s)" in body and "- iteration 120:" in body
    assert "cause: UNKNOWN: grad norm left its band at iteration 117" in body   # -> 120 (a lead
    # alone: no A / B without per-group telemetry)
    assert "3 iteration(s) before" in body
    assert "rho_bar = min(gn, clip) / (sqrt(N) eps) at eps 1e-08" in body
    assert "loss scale cut x3" in body and "grad norm printed as 0.000 on 1 line" in body
    assert "this setting: e8 (exact match" in body
    assert "predicted 0.3 spikes per 1000 optimizer steps, 90% interval [0.2, 0.4]" in body
    assert "not in the model: train.global_batch_size (a setting that differs only" in body
    lower = " ".join(text.split("SETTINGS THAT WOULD LOWER IT")[1].split())
    assert lower.index("optim.eps=1e-05 (now 1e-08)") < lower.index("optim.eps=1e-06 (now 1e-08)")
    assert "(interval below this setting's)" in lower and "overlaps this setting's" in lower
    assert "log10_rho_shallow 3 -> 0: rate x1.39 per decade" in " ".join(lower.split())
    assert (tmp_path / "out" / "report" / "report.md").is_file()
    assert max(len(ln) for ln in text.splitlines() if str(tmp_path) not in ln) <= 100


def test_assess_says_when_no_prediction_is_available(log, tmp_path, capsys):
    assert cli(["assess", str(log), "--no-shipped"]) == 0
    text = capsys.readouterr().out
    assert "NONE AVAILABLE: no predictions.json" in text
    assert "no model available, so no ranked alternatives" in text
    assert "no rho_bar" not in text or "parameter count unknown" in text
    assert cli(["assess", str(tmp_path / "missing.log")]) == 2


def test_assess_a_run_directory(synthetic_run):
    """A run with per-layer telemetry: its group rhos, and, given no predictions, the
    shipped spike-rate model on the run's own features."""
    text = assess(synthetic_run)
    assert "embed" in text and "shallow" in text and "deep" in text
    assert "2 loss spike(s)" in text and "- iteration 300:" in text
    body = " ".join(text.split())
    assert "using the shipped fit v" in body and "from the spike-rate model" in body
    assert "spikes per 1000 steps, interval [" in body and "one knob at a time" in body


def test_assess_on_a_fresh_install_uses_the_shipped_predictions(log):
    """A log and no predictions: the llama2-70b predictions shipped with the package, the
    log's setting matched among them, and it says whose predictions they are."""
    body = " ".join(assess(log, optim={"eps": 1e-8, "b2": 0.95}).split())
    assert "using the shipped fit v" in body and "(profile llama2-70b" in body
    assert "this setting: eps1e-08-b2_0.95-lr0.00015-b1_0.9-bs1024 (exact match" in body
    assert "the predictions are for the llama2-70b profile" in body
    assert "not in the model: optim.b2, train.global_batch_size" in body


@pytest.mark.skipif(not REALLOGS.is_dir(), reason="../shared/reallogs not present")
@pytest.mark.parametrize("name", sorted(REAL_ONSETS))
def test_assess_the_real_logs(name, tmp_path):
    text = assess(REALLOGS / name, clip=1.0, optim={"eps": 1e-8, "b2": 0.95})
    want = REAL_ONSETS[name]
    if want is None:
        assert "0 loss spike(s)" in text
    else:
        assert f"- iteration {want}:" in text
    body = " ".join(text.split())
    assert "none given (--predictions, --rate-model): using the shipped fit v" in body
    assert "predicted " in body and "SETTINGS THAT WOULD LOWER IT" in body
    if name.startswith("02_"):
        assert "cause: NUMERICS: loss scale 65536 -> 8192" in " ".join(text.split())
        assert "8 logged line(s) x log interval 10 = 80 optimizer steps" in body
        assert "too few steps for a rate" in body and "p_above" not in body
    # issue 39: units, sources and a cause per spike on every real log
    assert "optimizer steps" in body and "optim.eps 1e-08: flag --eps" in body
    assert body.count("cause: ") == (0 if want is None else body.count("- iteration "))
    if name.startswith("01_"):
        # the lead, without per-group telemetry: the one rule does not guess A or B
        assert ("cause: UNKNOWN: grad norm left its band at iteration 31215 (log line 2), 4 "
                "iteration(s) before: an optimizer spike's signature") in body


def _toy_model(path):
    """A spike-rate GLM fitted on a made-up table: the rate rises with shallow rho and
    falls with 1 - b2 (known coefficients, Poisson counts)."""
    import numpy as np
    import pandas as pd

    from adamspike import spike_rate as SR

    rng = np.random.default_rng(0)
    rows = []
    for rho in (-1.5, -1.0, -0.5, 0.0, 0.5):
        for omb2 in (-2.0, -1.3, -1.0):
            for lre in (1.0, 2.0, 3.0):
                mu = math.exp(-1.0 + 0.5 * rho - 1.0 * omb2 - 0.2 * lre) * 5.0
                rows.append({"source": "toy", "num_spikes": float(rng.poisson(mu)),
                             "num_steps": 5000.0, "log10_rho_shallow": rho,
                             "log10_one_minus_b2": omb2, "log10_lr_over_eps": lre})
    model = SR.fit(pd.DataFrame(rows), list(FEATS), n_boot=20)
    path.write_text(json.dumps(model.to_json()))
    return path


def test_assess_with_a_rate_model_only(synthetic_run, log, tmp_path):
    """A spike-rate model without a predictions file: the run directory's own features give
    the rate, one knob at a time the alternatives; a log (no per-layer rho) gets a plain
    'not available'."""
    model = _toy_model(tmp_path / "model.json")
    text = " ".join(assess(synthetic_run, rate_model=str(model)).split())
    assert "predicted " in text and "spikes per 1000 steps, interval [" in text
    assert "one knob at a time" in text
    assert "- b2 with 1 - b2 x2 (e.g. 0.95 -> 0.90):" in text   # the fitted slope on 1 - b2 < 0
    lower = text.split("LOWER IT")[1]
    assert "- eps x10:" in lower and "- eps / 10:" not in lower   # rho 1/eps dominates
    text = " ".join(assess(log, rate_model=str(model)).split())
    assert "NOT AVAILABLE for a log: the model needs log10_rho_shallow" in text
