"""Alarm rules: the vectorised evaluation equals adamspike.predictions.OnlineAlarms, and
precision / recall / lead time are scored as documented."""

import numpy as np
import pandas as pd

from adamspike.predictions import AlarmRule, OnlineAlarms
from adamspike.rundir import load_run
from analysis.alarms import fire_steps, online_alarms, score_alarms
from analysis.spikes import detect_spikes

RULES = [
    AlarmRule(id="rms_t_shallow", metric="rms_t", depths=(-1, 1), reduce="max", op=">",
              threshold=2.0, expected_lead_steps=(1, 8)),
    AlarmRule(id="bimodal_shallow", metric="bimodality", depths=(-1, 1), reduce="median",
              threshold=0.5, consecutive=2, expected_lead_steps=(1, 10)),
    AlarmRule(id="sat_wq", metric="sat_frac", kinds=("wq",), reduce="mean", threshold=0.1),
    AlarmRule(id="deep_noise", metric="update_rms", depths=(2, 100), reduce="max",
              threshold=0.262),
    AlarmRule(id="never", metric="rho", op="<", threshold=1e-6, reduce="min"),
    AlarmRule(id="rho_group", metric="rho", op=">", threshold=0.0, depths=(-1, 1),
              reduce="group_rho", consecutive=3),
]


def test_vectorised_equals_reference_evaluation(synthetic_run):
    layers = load_run(synthetic_run).layers
    online, rows = OnlineAlarms(RULES), []
    for step, g in layers.groupby("step", sort=True):
        cols = {c: g[c].to_numpy() for c in g.columns}
        cols["kind"] = g["kind"].astype(str).to_numpy()
        rows += [(f["rule"], f["step"]) for f in online.update(int(step), cols)]
    ref = pd.DataFrame(rows, columns=["rule", "step"]).sort_values(["rule", "step"])
    ref = ref.reset_index(drop=True)
    got = fire_steps(RULES, layers)[["rule", "step"]].sort_values(["rule", "step"])
    pd.testing.assert_frame_equal(got.reset_index(drop=True), ref, check_dtype=False)
    assert set(got["rule"]) >= {"rms_t_shallow", "bimodal_shallow", "sat_wq", "deep_noise"}


def test_group_rho_reduce_offline(synthetic_run):
    """The offline group_rho per step is the numel-weighted rms of the selected tensors."""
    from adamspike.depth_groups import group_rho
    from analysis.alarms import rule_values
    layers = load_run(synthetic_run).layers
    rule = RULES[-1]
    got = rule_values(rule, layers)
    sel = layers[(layers["depth"] >= -1) & (layers["depth"] <= 1)]
    want = {int(s): float(group_rho(g["rho"].to_numpy(float), g["numel"].to_numpy(float)))
            for s, g in sel.groupby("step")}
    assert np.isfinite(got).all()
    np.testing.assert_allclose([got[s] for s in want], list(want.values()), rtol=1e-12)


def test_scores_on_synthetic_run(synthetic_run):
    run = load_run(synthetic_run)
    spikes = detect_spikes(run.steps["loss"], run.steps["step"])
    sc = score_alarms(fire_steps(RULES, run.layers), spikes, RULES).set_index("rule")
    r = sc.loc["rms_t_shallow"]
    # the shallow rms_t ramp (1 + 3a over 10 steps) crosses 2 four steps in: 6-7 steps early
    assert r.precision == 1.0 and r.recall == 1.0 and 6 <= r.lead_median <= 7
    assert sc.loc["never", "num_alarms"] == 0 and np.isnan(sc.loc["never", "precision"])
    assert sc.loc["never", "recall"] == 0.0
    assert sc.loc["deep_noise", "precision"] < 0.5  # deep tensors carry no precursor
    assert "any" in sc.index


def test_scoring_by_hand():
    rules = [AlarmRule(id="a", metric="rms_t", expected_lead_steps=(1, 5))]
    alarms = pd.DataFrame({"rule": ["a"] * 4, "step": [10, 18, 40, 70]})
    spikes = pd.DataFrame({"start": [14, 20, 100]})
    sc = score_alarms(alarms, spikes, rules).iloc[0]
    # alarm 10 -> spike 14 (lead 4), 18 -> 20 (lead 2), 40 and 70 false; spike 100 missed
    assert (sc.num_alarms, sc.num_true_alarms, sc.num_detected) == (4, 2, 2)
    assert sc.precision == 0.5 and sc.recall == 2 / 3
    assert (sc.lead_min, sc.lead_max) == (2, 4)
    # a horizon override, and min_lead = 1 refusing a same-step alarm
    same = pd.DataFrame({"rule": ["a"], "step": [14]})
    assert score_alarms(same, spikes, rules, min_lead=0).iloc[0].num_true_alarms == 1
    assert score_alarms(same, spikes, rules, min_lead=1).iloc[0].num_true_alarms == 0
    assert score_alarms(alarms, spikes, rules, horizon=30).iloc[0].num_true_alarms == 3


def test_online_alarm_events():
    ev = pd.DataFrame([{"type": "checkpoint", "step": 5},
                       {"type": "alarm", "rule": "a", "step": 7, "value": 3.0}])
    assert online_alarms(ev).to_dict("records") == [{"rule": "a", "step": 7}]
    assert online_alarms(pd.DataFrame(columns=["time", "type", "step"])).empty
