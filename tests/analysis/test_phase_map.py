"""analysis.phase_map on a map directory written here (no JAX): rates with exact Poisson
intervals, onsets against time-matched controls, the attribution and the boundary."""

import json

import numpy as np
import pandas as pd
import pytest

from analysis.phase_map import analyze, attribution, poisson_interval, wakeups, write_report


def test_poisson_interval_is_garwoods():
    # tabulated exact 95 % limits: k = 0 -> [0, 3.689], k = 5 -> [1.6235, 11.668]
    assert poisson_interval(0, 1.0) == pytest.approx((0.0, 3.6889), abs=1e-4)
    assert poisson_interval(5, 2.0) == pytest.approx((1.6235 / 2, 11.668 / 2), abs=1e-3)


def test_wakeups_need_a_dormant_run():
    rho = np.array([[0.5]] * 25 + [[1.5]] + [[0.5]] * 3 + [[1.2]])
    w = wakeups(rho, dormant_steps=20)
    assert np.flatnonzero(w).tolist() == [25]      # the second rise had only 3 steps below 1


def test_attribution_reads_the_pairs():
    # (wake at onset, wake at control, crossed at onset, crossed at control, S before both)
    b = attribution([(1, 0, 0, 0, .5, .5)] * 8 + [(1, 1, 0, 0, .5, .5)] * 2 + [(0, 0, 0, 0, .5, .5)] * 2, 12)
    assert b["mechanism"] == "B" and b["wake_lift"] == pytest.approx(10 / 12 / (2 / 12))
    a = attribution([(0, 0, 1, 0, 2, .5)] * 6 + [(0, 0, 0, 0, .5, .5)] * 2, 8)
    assert a["mechanism"] == "A" and a["frac_crossed_onset"] == 0.75 and a["S_before_onset"] == 2
    assert attribution([], 0)["mechanism"] == "no spikes"


def _lane(seed, T, spike_at=None, cross_before=False, wake_before=False):
    rng = np.random.default_rng(seed)
    loss = 3.0 + 0.01 * rng.standard_normal(T)
    S = np.full(T, np.nan)
    S[9::10] = 0.3
    rho = np.full(T, 0.5)
    if spike_at:
        loss[spike_at - 1:spike_at + 2] = 4.8          # +60 %
        if cross_before:
            S[spike_at - 12] = 2.0
        if wake_before:
            rho[spike_at - 5] = 1.5
    return pd.DataFrame({"seed": seed, "step": np.arange(1, T + 1), "loss": loss,
                         "grad_norm": 1.0, "update_norm": 0.1, "rho_shallow": rho,
                         "rho_deep": 0.2, "S": S})


def test_a_map_directory_read_back(tmp_path):
    T = 300
    cells = []
    # cell a: 5 of 7 lanes spike at different steps after S crossed 1; cell b: quiet
    a = pd.concat([_lane(s, T, spike_at=100 + 30 * s, cross_before=True) if s < 5 else _lane(s, T)
                   for s in range(7)])
    b = pd.concat([_lane(s, T) for s in range(7)])
    from tests.foundation.test_cells import store_table
    for cid, df, lr in (("a", a, 64), ("b", b, 1)):
        cells.append({"id": cid, "lr_mult": lr, "b2": 0.95, "batch_mult": 1, "lr": 1e-3 * lr,
                      "global_batch_size": 8,
                      "cell": store_table(tmp_path / "cells", cid, df, "phase_map_cell")})
    (tmp_path / "map.json").write_text(json.dumps({
        "title": "t", "config_file": "x.toml", "quick": False, "seeds": list(range(7)),
        "curvature_every": 10, "targets": {"shallow": 0.9}, "grid": {"lr_mult": [1, 64],
        "b2": [0.95], "batch_mult": [1]}, "spikes": {"window": 20, "lead": 20}, "cells": cells}))
    table, onsets, summary = analyze(tmp_path)
    t = table.set_index("id")
    assert t.loc["a", "spikes_10"] == 5 and t.loc["a", "spikes_50"] == 5 and t.loc["a", "spikes_100"] == 0
    assert t.loc["b", "spikes_10"] == 0
    expo = 7 * (T - 10) / 1000     # the rule judges from min_history = 10 (window 20)
    assert t.loc["a", "rate_10"] == pytest.approx(5 / expo)
    assert t.loc["a", "rate_10_lo"] < t.loc["a", "rate_10"] < t.loc["a", "rate_10_hi"]
    assert t.loc["a", "mechanism"] == "A" and t.loc["b", "mechanism"] == "no spikes"
    assert sorted(onsets["start"]) == [100, 130, 160, 190, 220]
    assert onsets["crossed"].all() and not onsets["control_crossed"].any()
    assert onsets["control_seed"].notna().all()
    summary = write_report(tmp_path)
    md = (tmp_path / "phase_map.md").read_text()
    assert "5 spike(s)" in md and "| 64 |" in md
    assert summary["boundary"][0]["num_spiked"] == 5
    few = attribution([(1, 0, 0, 0, .5, .5)], 1)          # one pair: an infinite lift, no verdict
    assert few["mechanism"].startswith("too few onsets")
