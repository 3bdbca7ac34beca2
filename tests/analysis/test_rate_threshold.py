"""The rate model that can say zero (analysis/rate_threshold.py) on synthetic rows and a
synthetic phase-map folder; the plan's held-out rules (docs/plan/science4_v2.toml)."""

import json
import math

import numpy as np
import pandas as pd
import pytest

from adamspike.plan import load_plan
from analysis.rate_threshold import deviance, fit_models, judge, map_rows, rates

PLAN = load_plan("science4")
BINS = PLAN["rate_model"]["s_bins"]


def rows(spec, seed=0):
    """spec: (cell, S, lanes, rate per 1k above 0) -> lane-phase rows with Poisson counts."""
    rng = np.random.default_rng(seed)
    out = []
    for cell, S, lanes, rate in spec:
        for lane in range(lanes):
            for w, n in ((1, 200), (0, 400)):
                out.append({"cell": cell, "S": S, "seed": lane, "warmup": w, "steps": n,
                            "lr": 1e-3 * S, "eps_median": 1e-3,
                            "spikes": int(rng.poisson(rate * n / 1000))})
    return pd.DataFrame(out)


def test_deviance_is_infinite_where_a_model_said_zero_and_a_spike_came():
    assert deviance([0, 1], [0.0, 1.0]) == 0.0
    assert math.isinf(deviance([1, 0], [0.0, 1.0]))
    assert deviance([2], [2.0]) == pytest.approx(0.0)
    assert deviance([0], [3.0]) == pytest.approx(6.0)       # 2 * mu when k = 0


def test_threshold_is_the_smallest_spiking_S_and_below_it_the_rate_is_zero():
    train = rows([("a", 0.1, 4, 0.0), ("b", 0.5, 4, 0.0), ("c", 2.0, 4, 20.0),
                  ("d", 4.0, 4, 60.0)])
    m = fit_models(train, BINS)
    spiking = train.loc[train["spikes"] > 0, "S"].min()
    assert m["threshold"]["S_c"] == spiking == 2.0
    r = rates(m, train)
    assert (r.loc[train["S"] < 2.0, "threshold"] == 0).all()
    assert (r.loc[train["S"] >= 2.0, "threshold"] > 0).all()
    # the constant cannot say zero
    assert (r["constant"] > 0).all()
    # no spike at all: S_c = inf, zero everywhere
    none = fit_models(rows([("a", 0.1, 2, 0.0), ("b", 3.0, 2, 0.0)]), BINS)
    assert math.isinf(none["threshold"]["S_c"])
    assert (rates(none, train)["threshold"] == 0).all()
    # ... and the lr/eps GLM has no finite maximum there: its limit, rate 0, said so
    assert none["lr_eps"]["beta"] is None and "no finite maximum" in none["lr_eps"]["no_finite_mle"]
    assert (rates(none, train)["lr_eps"] == 0).all()
    assert m["lr_eps"]["beta"] is not None and (rates(m, train)["lr_eps"] > 0).all()


def test_held_out_zeros_below_the_threshold_beat_the_competitors_but_stay_undetermined():
    train = rows([("a", 0.1, 4, 0.0), ("b", 0.5, 4, 0.0), ("c", 2.0, 4, 20.0),
                  ("d", 4.0, 4, 60.0)])
    held = rows([("h1", 0.3, 4, 0.0), ("h2", 0.8, 4, 0.0)], seed=1)
    r = judge(train, held, {**PLAN, "rate_model": {**PLAN["rate_model"], "bootstrap_draws": 50}})
    assert r["observed"] == 0
    assert r["deviance"]["threshold"] == 0.0
    assert r["deviance"]["constant"] > 0 and r["deviance"]["threshold"] < r["deviance"]["lr_eps"]
    # the S-bin lookup also says zero in bins without a training spike: a tie is not a win
    assert r["deviance"]["s_bins"] == 0.0 and not r["beats_competitors"]
    assert r["verdict"] == "undetermined"          # nothing expected: too little to judge
    # the bootstrap resamples cells: every finite S_c is the S of a spiking cell
    assert r["S_c_boot"]["p5"] >= 2.0 and r["S_c_boot"]["p95"] <= 4.0


def test_a_held_out_spike_below_the_threshold_fails_the_model():
    train = rows([("a", 0.5, 4, 0.0), ("c", 2.0, 4, 20.0), ("d", 4.0, 4, 60.0)])
    held = rows([("h1", 0.8, 4, 0.0)], seed=1)
    held.loc[0, "spikes"] = 1
    r = judge(train, held, {**PLAN, "rate_model": {**PLAN["rate_model"], "bootstrap_draws": 20}})
    assert math.isinf(r["deviance"]["threshold"])
    assert not r["beats_competitors"]


def test_held_out_rows_drawn_from_the_model_pass():
    train = rows([("a", 0.5, 6, 0.0), ("c", 2.0, 6, 20.0), ("d", 4.0, 6, 60.0),
                  ("e", 8.0, 6, 150.0)])
    held = rows([("h1", 0.5, 6, 0.0), ("h2", 4.0, 6, 60.0), ("h3", 8.0, 6, 150.0)], seed=2)
    r = judge(train, held, {**PLAN, "rate_model": {**PLAN["rate_model"], "bootstrap_draws": 50}})
    assert r["bins"]["judged"].any()
    assert r["verdict"] == "pass", r["why"]


def test_map_rows_count_a_visible_spike_in_its_phase_and_flag_the_band(tmp_path):
    rng = np.random.default_rng(0)
    steps = np.arange(1, 601)
    lanes = []
    for seed in range(2):
        loss = 5.0 - 0.002 * steps + 0.01 * rng.standard_normal(600)
        if seed == 1:
            loss[399:406] *= 2.0          # a 2x jump for 7 steps, after the warmup (200)
        S = np.where(steps % 20 == 0, 0.5 + 0.5 * (steps > 200), np.nan)
        lanes.append(pd.DataFrame({"seed": seed, "step": steps, "loss": loss, "S": S,
                                   "rho_embed": 0.7, "rho_shallow": 0.9, "rho_deep": 0.17,
                                   "rho_head": 2.8}))
    from tests.foundation.test_cells import store_table
    ref = store_table(tmp_path / "cells", "c1", pd.concat(lanes), "phase_map_cell")
    cfg = {"optim.warmup_steps": 200, "model.init_std": 0.02, "model.dim": 48,
           "model.num_layers": 6}
    meta = {"targets": {"embed": 0.714, "shallow": 0.944, "deep": 0.166, "head": 2.817},
            "cells": [{"id": "c1", "lr_mult": 64, "b2": 0.95, "batch_mult": 1, "lr": 0.064,
                       "eps": {"embed": 1e-3, "shallow": 2e-3, "deep": 1e-2, "head": 2e-4},
                       "config": cfg, "cell": ref}]}
    (tmp_path / "map.json").write_text(json.dumps(meta))
    r = map_rows(tmp_path, PLAN, "map_heldout").set_index(["seed", "phase"])
    assert r.loc[(1, "after"), "spikes"] == 1 and r["spikes"].sum() == 1
    assert r.loc[(1, "after"), "durations"] == "7"
    assert r.loc[(0, "warmup"), "steps"] == 200 and r.loc[(0, "after"), "steps"] == 400
    assert r.loc[(0, "after"), "S"] == pytest.approx(1.0)
    assert r.loc[(0, "warmup"), "S"] == pytest.approx(0.5)
    assert r["cell_in_band"].all()
    assert r["eps_median"].iloc[0] == pytest.approx(np.median([1e-3, 2e-3, 1e-2, 2e-4]))
