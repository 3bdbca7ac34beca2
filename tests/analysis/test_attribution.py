"""Spike attribution (analysis.attribution): one verdict per spike from small synthetic
tables of known cause, the confusion matrix on a fixed set, and the analyze / assess
outputs. Synthetic tables (seeded): known ground truth, not measurements."""
import math

import numpy as np
import pandas as pd
import pytest

from analysis.assess import assess
from analysis.attribution import RULES, VERDICTS, attribute, confusion
from study.cli import main as cli

N, ONSET = 80, 60
DEPTHS = {"tok_embeddings.weight": -1, "layers.0.w1.weight": 0, "layers.1.w1.weight": 1,
          "output.weight": 2}


def tables(seed=0, *, loss_jump=True, grad_jump_at=None, nan_grad_at=None, lr_rise=False,
           shallow_update_jump_at=None):
    rng = np.random.default_rng(seed)
    step = np.arange(1, N + 1)
    loss = 3.0 + 0.02 * rng.standard_normal(N)
    if loss_jump:
        loss[step == ONSET] = 5.0
    gn = 0.7 * np.exp(0.05 * rng.standard_normal(N))
    if grad_jump_at is not None:
        gn[step == grad_jump_at] = 4.0
    if nan_grad_at is not None:
        gn[step == nan_grad_at] = np.nan
    lr = np.full(N, 1e-3)
    if lr_rise:
        lr = 1e-3 * np.where(step > 30, 1 + (step - 30) / 20.0, 1.0)
    steps = pd.DataFrame({"step": step, "loss": loss, "grad_norm": gn, "lr": lr,
                          "update_norm": 0.1 * np.ones(N), "skipped": False})
    rows = []
    for s in step:
        for name, d in DEPTHS.items():
            u = 0.3 * math.exp(0.05 * rng.standard_normal())
            if shallow_update_jump_at == s and d in (-1, 0):
                u *= 20
            rho = 1e4 * math.exp(0.05 * rng.standard_normal())
            if nan_grad_at == s:
                rho = u = math.nan
            rows.append({"step": s, "name": name, "depth": d, "numel": 64, "rho": rho,
                         "update_rms": u})
    return steps, pd.DataFrame(rows)


def spike_at(onset=ONSET):
    return pd.DataFrame({"start": [onset], "peak_step": [onset], "height": [0.66]})


def one(**kw):
    steps, layers = tables(**kw)
    events = kw.pop("events", None) if "events" in kw else None
    return attribute(spike_at(), steps, layers, events=events).iloc[0]


def test_poisoned_batch_is_data():
    r = one(grad_jump_at=ONSET)
    assert r.verdict == "data or loading"
    assert r.first_mover == "grad_norm" and r.first_lead == 0
    assert "nothing moved before it" in r.evidence


def test_a_shallow_update_jump_before_onset_is_optimizer_b():
    r = one(shallow_update_jump_at=ONSET - 1, grad_jump_at=ONSET)
    assert r.verdict == "optimizer B"
    assert "update_rms:embed x" in r.evidence and "update_rms:shallow x" in r.evidence
    assert r.first_lead == 1 and "update_rms:deep" not in r.moved


def test_an_lr_rise_before_onset_is_optimizer_a():
    r = one(lr_rise=True)
    assert r.verdict == "optimizer A" and r.evidence.startswith("lr x")
    # the ramp: lr at onset - 1 is 1 + 29/20 = 2.45x, over a baseline median of ~1.0x
    assert float(r.evidence.split("x")[1].split()[0]) > RULES["rise_ratio"].value


def test_the_s_proxy_rising_is_optimizer_a():
    steps, layers = tables()
    cv = pd.DataFrame({"step": steps["step"], "group": "update", "lr": 1e-3,
                       "precond_curvature": np.where(steps["step"] >= ONSET - 5, 3e3, 1e3),
                       "raw_curvature": 1.0})
    r = attribute(spike_at(), steps, layers, cv).iloc[0]
    assert r.verdict == "optimizer A" and "S:update" in r.evidence


def test_a_nan_gradient_is_numerics_also_when_the_loss_was_never_logged():
    steps, layers = tables(loss_jump=False, nan_grad_at=ONSET - 1)
    steps, layers = steps[steps["step"] < ONSET], layers[layers["step"] < ONSET]
    events = pd.DataFrame([{"type": "nonfinite_loss", "step": ONSET, "retries": 0}])
    at = attribute(spike_at().iloc[:0], steps, layers, events=events)
    assert len(at) == 1
    r = at.iloc[0]
    assert r.verdict == "numerics" and r.source.startswith("nonfinite_loss event")
    assert f"non-finite at {ONSET - 1}: grad_norm" in r.evidence
    assert f"event nonfinite_loss at {ONSET}" in r.evidence


def test_nothing_moving_is_unknown_and_recurrence_comes_from_a_rollback():
    steps, layers = tables()
    events = pd.DataFrame([{"type": "spike", "step": ONSET, "retries": 0},
                           {"type": "rollback", "step": ONSET, "retries": 0},
                           {"type": "spike", "step": ONSET + 2, "retries": 1}])
    r = attribute(spike_at(), steps, layers, events=events).iloc[0]
    assert r.verdict == "unknown" and r.evidence == "no series moved in the window"
    assert r.recurred == "recurred"
    assert attribute(spike_at(), steps, layers).iloc[0].recurred == "not replayed"


def test_confusion_matrix_on_a_fixed_set():
    truth, cases = [], []
    for seed in range(3):
        for cause, kw in (("data or loading", {"grad_jump_at": ONSET}),
                          ("optimizer B", {"shallow_update_jump_at": ONSET - 1}),
                          ("optimizer A", {"lr_rise": True}),
                          ("numerics", {"nan_grad_at": ONSET - 2})):
            steps, layers = tables(seed, **kw)
            cases.append(attribute(spike_at(), steps, layers).iloc[0].verdict)
            truth.append(cause)
    m = confusion(truth, cases)
    assert list(m.columns) == list(VERDICTS)
    assert list(m.index) == ["data or loading", "optimizer B", "optimizer A", "numerics"]
    for cause in m.index:
        assert m.loc[cause, cause] == 3 and m.loc[cause].sum() == 3
    # the counting itself, on a hand-made list with off-diagonal cells
    d = "data or loading"
    m2 = confusion([d, d, "numerics"], [d, "unknown", d])
    assert m2.loc[d, d] == 1 and m2.loc[d, "unknown"] == 1
    assert m2.loc["numerics", d] == 1 and int(m2.to_numpy().sum()) == 3
    with pytest.raises(ValueError, match="unknown verdict"):
        confusion(["data"], ["weather"])
    with pytest.raises(ValueError, match="1 true causes but 2 verdicts"):
        confusion([d], [d, d])


def test_rules_carry_their_reasons():
    assert all(r.reason and r.value > 0 for r in RULES.values())


def test_analyze_writes_attribution_csv_and_assess_prints_verdicts(synthetic_run, tmp_path):
    assert cli(["analyze", str(synthetic_run), "--out", str(tmp_path / "a")]) == 0
    at = pd.read_csv(next((tmp_path / "a").rglob("attribution.csv")))
    assert list(at["start"]) == [300, 450] and set(at["verdict"]) <= set(VERDICTS)
    text = assess(synthetic_run)
    body = " ".join(text.split("SPIKES SO FAR")[1].split("NUMERICS HEALTH")[0].split())
    for r in at.itertuples():     # one verdict per spike: the attribution's, in SPIKES SO FAR
        assert f"- iteration {r.start}:" in body
        assert f"cause: {r.verdict.upper()}: {' '.join(r.evidence.split())}" in body
    assert "WHAT MOVED FIRST" not in text


def test_a_series_never_measured_is_not_numerics_evidence():
    """A log's or the probe's update norm is NaN on every row (not measured): no verdict
    from it; a NaN grad norm in a run that measures it is."""
    steps, layers = tables(grad_jump_at=ONSET)
    steps["update_norm"] = math.nan
    assert attribute(spike_at(), steps, layers).iloc[0].verdict == "data or loading"
    steps.loc[steps["step"] == ONSET - 3, "grad_norm"] = math.inf
    r = attribute(spike_at(), steps, layers).iloc[0]
    assert r.verdict == "numerics" and r.evidence == f"non-finite at {ONSET - 3}: grad_norm"


def test_windows_count_logged_lines_in_a_log_with_an_interval():
    """Every 10th iteration logged: the 10-line search window and 30-line baseline are
    100 and 300 iterations; with interval 1 the baseline (20..50) is too short to judge."""
    steps, layers = tables(shallow_update_jump_at=ONSET - 1)
    for t in (steps, layers):
        t["step"] = t["step"] * 10
    sp = spike_at(ONSET * 10)
    r = attribute(sp, steps, layers, interval=10).iloc[0]
    assert r.verdict == "optimizer B" and r.first_lead == 10
    assert attribute(sp, steps, layers).iloc[0].evidence == "no series moved in the window"


def test_one_rule_weighs_the_logs_facts_and_the_telemetry():
    """analysis.attribution.decide is the one spike-cause rule: the log's facts
    (analysis.diagnosis.spike_log_evidence) and the telemetry's movers go into the same decision;
    the telemetry's evidence where the run has group series, the log's otherwise."""
    steps, layers = tables(shallow_update_jump_at=ONSET - 1)
    facts = {"numerics": [], "data": [], "grad_note": "grad norm left its band at iteration "
             f"{ONSET - 2}, 2 iteration(s) before", "grad_lead": 2, "unknown": []}
    r = attribute(spike_at(), steps, layers, log_facts={ONSET: facts}).iloc[0]
    assert r.verdict == "optimizer B" and r.grad_note == facts["grad_note"]
    # a numerics event the log shows next to the spike wins over the telemetry
    cut = {**facts, "numerics": [f"loss scale 65536 -> 8192 (x0.125) at iteration {ONSET}"]}
    r = attribute(spike_at(), steps, layers, log_facts={ONSET: cut}).iloc[0]
    assert r.verdict == "numerics" and r.evidence.startswith("loss scale 65536 -> 8192")
    # a resume just before the onset: data or loading, before the optimizer rules
    res = {**facts, "data": [f"checkpoint loaded at iteration {ONSET - 1} (log line 70)"]}
    r = attribute(spike_at(), steps, layers, log_facts={ONSET: res}).iloc[0]
    assert r.verdict == "data or loading" and "checkpoint loaded" in r.evidence
    # the same lead without group series (a log): unknown with the lead, no guessed A / B
    steps, _ = tables(grad_jump_at=ONSET - 2)
    r = attribute(spike_at(), steps, None, log_facts={ONSET: facts}).iloc[0]
    assert r.verdict == "unknown"
    assert r.evidence.startswith(facts["grad_note"] + ": an optimizer spike's signature; "
                                 "telling mechanism A from B needs per-group telemetry")
    assert "none of the rules' patterns" not in r.evidence
    assert set(VERDICTS) == {"optimizer A", "optimizer B", "numerics", "data or loading",
                             "unknown"}


def test_the_report_and_attribution_csv_are_one_table(synthetic_run, tmp_path):
    from analysis.report import analyze_run
    ra = analyze_run(synthetic_run)
    assert ra.attribution is ra.diagnosis and list(ra.diagnosis["start"]) == [300, 450]
