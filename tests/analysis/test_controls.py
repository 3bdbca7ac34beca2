"""analysis.controls: planted precursors against control windows, burn-in, alarm lift."""

import math

import numpy as np
import pandas as pd
import pytest

from adamspike.predictions import AlarmRule
from analysis import controls as C
from analysis.synthetic import write_synthetic_run

L = 4                      # blocks 0..3: shallow = block 0 (max(1, 4 // 10) = 1)
B2 = 0.95                  # burn-in ceil(3 / 0.05) = 60
TENSORS = [("embed", -1, "embed"), *[(f"layers.{i}.w1", i, "w1") for i in range(L)],
           ("output", L, "output")]


def _layers(num_steps: int, spikes, rng, *, lead: int = 40, transient: bool = True,
            planted: bool = True) -> pd.DataFrame:
    """Layers table: r ~ mixture (1 - w) N(0, u^2) + w (+-u), BC = 1 / (3 - 2w) (w = 0:
    Gaussian, 1/3). Away from spikes w ~ U(0, 0.3); in the `lead` steps before a spike the
    shallow block (and the embedding) have w = 0.9 (BC 0.83) and sat_frac 0.3. With
    `transient`, the first steps have r = sign(g) (BC = 1, sat_frac = 1) decaying to
    normal over 20 steps, as Adam's first steps do."""
    rows = []
    for t in range(1, num_steps + 1):
        pre = planted and any(s - lead <= t < s for s in spikes)
        for name, d, kind in TENSORS:
            w = 0.3 * rng.random()
            sat = 0.01 * rng.random()
            if pre and d <= 0:
                w, sat = 0.9, 0.3
            u = 0.1
            m1, m2, m3, m4 = 0.0, u * u, 0.0, u ** 4 * (3 * (1 - w) + w)
            if transient and t <= 20:
                a = math.exp(-(t - 1) / 3.0)     # step 1: r = sign(g), moments of +-1
                m2 = a + (1 - a) * m2
                m4 = a + (1 - a) * m4
                sat = a + (1 - a) * sat
            rows.append((t, name, d, kind, 1000, m1, m2, m3, m4, sat))
    return pd.DataFrame(rows, columns=["step", "name", "depth", "kind", "numel", "r_mean",
                                       "r_m2", "r_m3", "r_m4", "sat_frac"])


def _run(name, spikes, rng, **kw) -> C.StudyRun:
    lay = _layers(700, spikes, rng, **kw)
    bi = C.burn_in_steps(B2)
    sp = pd.DataFrame({"start": list(spikes), "end": [s + 2 for s in spikes]},
                      dtype="int64")
    return C.StudyRun(name=name, arm="a", seed=name, series=C.group_series(lay, L, bi),
                      spikes=sp, logged_steps=np.unique(lay["step"]), burn_in=bi,
                      num_layers=L, layers=lay)


@pytest.fixture(scope="module")
def study():
    rng = np.random.default_rng(0)
    spiking = [_run(f"s{k}", (250 + 40 * k, 520 + 40 * k), rng) for k in range(4)]
    quiet = [_run(f"q{k}", (), rng) for k in range(4)]
    return spiking + quiet


def test_burn_in_excludes_step_one():
    assert C.burn_in_steps(0.95) == 60 and C.burn_in_steps(0.999) == 3000
    assert C.burn_in_steps(0.9) == 30
    rng = np.random.default_rng(1)
    lay = _layers(120, (), rng)
    from adamspike.metrics import shape_stats
    first = lay[lay["step"] == 1]
    bc1 = shape_stats(first["r_mean"], first["r_m2"], first["r_m3"], first["r_m4"])
    assert np.allclose(bc1["bimodality"], 1.0)            # r = sign(g): BC = 1
    raw = C.group_series(lay, L, burn_in=0)
    assert raw.loc[raw["step"] == 1, "bimodality"].min() > 0.99
    ser = C.group_series(lay, L, C.burn_in_steps(B2))
    assert ser["step"].min() == 61
    assert ser["bimodality"].max() < 5 / 9 and ser["sat_frac"].max() < 0.02
    # a spike right after the burn-in: its window falls mostly in the transient -> skipped,
    # not reported as a BC = 1 precursor
    r = C.StudyRun("x", "a", 0, ser, pd.DataFrame({"start": [70], "end": [72]}),
                   np.unique(lay["step"]), 60, L)
    w = C.collect_windows([r], window=50)
    assert not (w["kind"] == "pre").any() or w.loc[w["kind"] == "pre", "value"].isna().all()


def test_planted_bc_rise_detected_against_matched_controls(study):
    tab = C.compare_windows(C.collect_windows(study, window=50))
    row = tab.set_index(["metric", "group"])
    sh = row.loc[("bimodality", "shallow")]
    assert sh["n_pre"] == 8 and sh["frac_pre"] == 1.0 and sh["frac_control"] == 0.0
    assert "matched" in sh["controls"] and "same-run" not in sh["controls"]
    assert sh["p_holm"] < 0.05 and sh["verdict"].startswith("precursor")
    assert row.loc[("sat_frac", "shallow"), "verdict"].startswith("precursor")
    assert row.loc[("bimodality", "embed"), "verdict"].startswith("precursor")
    # deep blocks and the head did not move: no precursor there
    for grp in ("deep", "head"):
        assert not row.loc[("bimodality", grp), "verdict"].startswith("precursor")
        assert row.loc[("bimodality", grp), "frac_pre"] == 0.0


def test_no_planted_precursor_is_not_detected():
    rng = np.random.default_rng(2)
    runs = [_run(f"s{k}", (250 + 40 * k, 520 + 40 * k), rng, planted=False)
            for k in range(4)] + [_run(f"q{k}", (), rng, planted=False) for k in range(4)]
    tab = C.compare_windows(C.collect_windows(runs, window=50))
    assert not tab["verdict"].str.startswith("precursor").any()
    # sat_frac threshold from the controls' 90th percentile
    assert (tab.loc[tab["metric"] == "sat_frac", "threshold_source"] == "control q90").all()


def test_same_run_fallback_when_every_run_spikes_there():
    rng = np.random.default_rng(3)
    runs = [_run("only", (300, 600), rng)]
    w = C.collect_windows(runs, window=50)
    ctl = w[w["kind"] == "control"]
    assert len(ctl) and (ctl["source"] == "same-run").all()
    # every same-run control window is >= 2W from both spikes
    for a, b in ctl[["a", "b"]].drop_duplicates().itertuples(index=False):
        assert b - 1 <= 300 - 100 or a >= 602 + 100 or (a >= 302 + 100 and b - 1 <= 500)
    tab = C.compare_windows(w)
    assert tab.set_index(["metric", "group"]).loc[("bimodality", "shallow"),
                                                  "controls"].startswith("same-run")


# ----------------------------------------------------------------------------- lift

def test_chance_rate_hand_value():
    assert C.chance_rate(range(1, 101), [50], horizon=10) == pytest.approx(0.10)  # 40..49
    # overlapping windows count once: 40..49 and 45..54 -> 40..54
    assert C.chance_rate(range(1, 101), [50, 55], horizon=10) == pytest.approx(0.15)
    assert C.chance_rate(range(1, 101), [50], horizon=10, min_lead=0) == pytest.approx(0.11)


def test_random_alarm_has_lift_one_and_is_uninformative():
    rng = np.random.default_rng(4)
    logged = np.arange(1, 20_001)
    starts = np.sort(rng.choice(np.arange(100, 20_000), 200, replace=False))
    fired = np.sort(rng.choice(logged, 2000, replace=False))
    rules = [AlarmRule(id="rand", metric="rms_t", expected_lead_steps=(1, 10)),
             AlarmRule(id="good", metric="rms_t", expected_lead_steps=(1, 10))]
    al = pd.DataFrame({"rule": ["rand"] * len(fired) + ["good"] * len(starts),
                       "step": np.r_[fired, starts - 5]})
    one = C.lift_table([(al, pd.DataFrame({"start": starts}), logged)], rules).set_index("rule")
    res = one.loc["rand"]
    assert res["chance_rate"] == pytest.approx(0.1, abs=0.01)
    assert res["lift"] == pytest.approx(1.0, abs=0.15)
    assert not res["informative"]
    good = one.loc["good"]
    assert good["precision"] == 1.0 and good["lift"] > 5 and good["informative"]
    # the same counts pooled over two "runs"
    half = 10_000
    runs = [(al[al["step"] <= half], pd.DataFrame({"start": starts[starts <= half + 10]}),
             logged[logged <= half]),
            (al[al["step"] > half], pd.DataFrame({"start": starts[starts > half]}),
             logged[logged > half])]
    lt = C.lift_table(runs, rules).set_index("rule")
    assert lt.loc["rand", "num_true_alarms"] == res["num_true_alarms"]
    assert lt.loc["rand", "lift"] == pytest.approx(res["lift"], rel=0.02)
    assert not lt.loc["rand", "informative"] and lt.loc["good", "informative"]
    pred = {"schema": "adamspike.predictions", "schema_version": 3,
            "alarm_rules": [{"id": "rand", "metric": "rms_t"}, {"id": "good", "metric": "rms_t"},
                            {"id": "unscored", "metric": "rms_t"}]}
    out = C.mark_uninformative(pred, lt.reset_index())
    by = {r["id"]: r for r in out["alarm_rules"]}
    assert by["rand"]["informative"] is False and "lift" in by["rand"]["informative_reason"]
    assert by["good"]["informative"] is True
    assert "informative" not in by["unscored"]
    assert "informative" not in pred["alarm_rules"][0]            # input untouched


def test_lift_edge_cases():
    assert C.lift_result(0, 0, 0.1)["reason"] == "never fired"
    r = C.lift_result(5, 0, 0.0)
    assert r["informative"] is False and "chance rate 0" in r["reason"]
    r = C.lift_result(10, 1, 0.2)                 # precision 0.1 < chance 0.2
    assert r["lift"] == pytest.approx(0.5) and "<= 1" in r["reason"]


# ----------------------------------------------------------------------------- run dirs

def test_report_section_on_run_directory(synthetic_run):
    pred = {"schema": "adamspike.predictions", "schema_version": 3,
            "alarm_rules": [{"id": "sat_shallow", "metric": "sat_frac", "depths": [-1, 0],
                             "reduce": "max", "op": ">", "threshold": 0.1,
                             "expected_lead_steps": [1, 10]}]}
    md = C.report_section([synthetic_run], predictions=pred, window=10)
    assert "Precursors against control windows (1 runs" in md
    assert "same-run" in md and "burn-in of ceil(3 / (1 - b2)) = 60" in md
    assert "| bimodality | shallow |" in md
    assert "### Alarm lift" in md and "| sat_shallow |" in md
    runs = C.load_study([synthetic_run])
    assert runs[0].burn_in == 60 and len(runs[0].spikes) == 2


def test_marked_rules_load_and_are_not_armed_online():
    from adamspike.predictions import OnlineAlarms, from_json
    lt = pd.DataFrame({"rule": ["bad"], "lift": [0.8], "informative": [False],
                       "reason": ["lift 0.8 <= 1"], "horizon": [8], "num_alarms": [10], "num_true_alarms": [1],
                       "precision": [0.1], "chance_rate": [0.125], "p": [0.7]})
    pred = {"schema": "adamspike.predictions", "schema_version": 3,
            "alarm_rules": [{"id": "bad", "metric": "rms_t", "threshold": 2.0},
                            {"id": "kept", "metric": "rms_t", "threshold": 2.0}]}
    marked = C.mark_uninformative(pred, lt)
    rules = from_json(marked).alarm_rules
    online = OnlineAlarms(rules)
    assert [r.id for r in online.rules] == ["kept"] and "bad" in online.disarmed
    cols = {"depth": np.array([0]), "kind": np.array(["wq"]), "rms_t": np.array([5.0])}
    assert [a["rule"] for a in online.update(1, cols)] == ["kept"]


def test_study_sections_group_runs_by_problem_and_skip_runs_without_telemetry(synthetic_run, tmp_path):
    other = write_synthetic_run(tmp_path / "other", num_steps=600, spikes=(), lead=10, seed=1)
    md = C.study_sections([synthetic_run, other, tmp_path / "not_a_run"])
    # the two synthetic runs are one problem: the second one's windows are matched controls
    assert md.count("### Precursors against control windows") == 1
    assert "(2 runs" in md and "matched" in md
    assert C.problem_key({"model": {"dim": 8}, "optim": {"eps": 1e-8}, "train": {"seed": 1}}) == \
        C.problem_key({"model": {"dim": 8}, "optim": {"eps": 1e-5}, "train": {"seed": 2}})
