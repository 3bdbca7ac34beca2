"""Precursor lead times recover the known lead of a synthetic run; no lead where none is."""

import numpy as np
import pandas as pd

from adamspike.rundir import load_run
from analysis.precursors import depth_group, lead_times, precursors, with_derived
from analysis.spikes import detect_spikes


def test_known_lead_recovered_shallow_only(synthetic_run):
    run = load_run(synthetic_run)
    spikes = detect_spikes(run.steps["loss"], run.steps["step"])
    assert list(spikes["start"]) == [300, 450]
    p = precursors(run.layers, spikes, window=50, baseline=200)
    lead = p.leads.set_index(["spike_id", "group", "metric"])["lead_sustained"]
    for sid in (0, 1):
        for m in ("rho", "rms_t", "update_rms", "sat_frac", "grad_mom_cos"):
            assert lead[(sid, "shallow", m)] == 10  # the ramp starts 10 steps before
        assert 8 <= lead[(sid, "shallow", "bimodality")] <= 10  # first ramp step is tiny
        deep = p.leads[(p.leads.spike_id == sid) & (p.leads.group == "deep")]
        assert deep["lead_sustained"].isna().all()
    s = p.summary.set_index(["group", "metric"])
    assert s.loc[("shallow", "rms_t"), "num_led"] == 2
    assert s.loc[("shallow", "rms_t"), "lead_median"] == 10
    assert s.loc[("deep", "rms_t"), "num_led"] == 0
    tl = p.tensor_leads[p.tensor_leads["metric"] == "rms_t"]
    shallow = depth_group(tl["depth"], int(run.layers["depth"].max())) == "shallow"
    assert shallow.any() and not shallow.all()
    assert (tl.loc[shallow, "lead"] == 10).all()   # every shallow tensor, each spike
    assert tl.loc[~shallow, "lead"].isna().all()
    assert len(tl) == 2 * run.layers["name"].nunique()
    tr = p.trajectories
    assert set(tr["group"]) == {"shallow", "deep"}
    assert tr["rel_step"].min() == -250 and tr["rel_step"].max() == 50


def test_lead_time_rules():
    st = np.arange(90, 100)
    v = np.array([0, 5, 0, 0, 0, 0, 5, 5, 5, 5], float)
    sus, first, onset = lead_times(st, v, 100, hi=1.0, lo=-1.0, two_sided=False)
    assert (sus, first, onset) == (4.0, 9.0, 96)
    v[-1] = 0  # back inside the band just before the spike: no sustained lead
    sus, first, _ = lead_times(st, v, 100, hi=1.0, lo=-1.0, two_sided=False)
    assert np.isnan(sus) and first == 9
    down = -v
    assert np.isnan(lead_times(st, down, 100, 1.0, -1.0, False)[1])
    assert lead_times(st, down, 100, 1.0, -1.0, True)[1] == 9


def test_depth_groups_and_bimodality():
    # adamspike.depth_groups: L = 80 (the head's depth) -> shallow = depths -1..7
    assert list(depth_group([-1, 0, 7, 8, 80])) == ["shallow"] * 3 + ["deep"] * 2
    assert list(depth_group([-1, 0, 1, 2], num_layers=2)) == ["shallow"] * 2 + ["deep"] * 2
    df = pd.DataFrame({"r_mean": [0.0, 0.0], "r_m2": [1.0, 1.0], "r_m3": [0.0, 0.0],
                       "r_m4": [3.0, 1.0]})
    bc = with_derived(df)["bimodality"].to_numpy()
    np.testing.assert_allclose(bc, [1 / 3, 1.0], rtol=1e-6)  # Gaussian, two-point


def test_no_spikes_gives_empty_tables(synthetic_run):
    run = load_run(synthetic_run)
    p = precursors(run.layers, detect_spikes([1.0] * 10))
    assert p.leads.empty and p.summary.empty and p.trajectories.empty
