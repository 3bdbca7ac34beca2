"""The mechanism spike-rate model end to end on a synthetic phase map: lane x phase rows
(analysis.spike_rate.map_rows) count the map rule's spikes per phase, the GLM finds the
stability number's effect the data were made with and is validated on the widest map, and
`predict` gives each 70B candidate a rate in warmup and after with its mechanism."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from adamspike import spike_rate as SR
from adamspike.config import ConfigError
from analysis.spike_rate import map_rows
from simulate import predict as P

MECH = ["log10_rho_shallow", "log10_rho_deep", "log10_one_minus_b2", "log10_tokens_per_step",
        "log10_stability", "log10_rho_min", "warmup"]
STEPS, WARMUP, SEEDS = 300, 100, 6


def _config(dim: int, lr: float, b2: float) -> dict:
    return {"model.preset": "tiny", "model.vocab_size": 64, "model.dim": dim,
            "model.num_layers": 2, "model.num_heads": 2, "model.num_kv_heads": 1,
            "model.max_seq_len": 16, "optim.lr": lr, "optim.min_lr": lr / 10,
            "optim.warmup_steps": WARMUP, "optim.b2": b2, "optim.eps": 1e-3,
            "train.num_steps": STEPS, "train.global_batch_size": 8, "train.seq_len": 16}


def _write_map(out, dim, rng, injected):
    """A map directory (map.json + cells) whose lanes spike at a rate that grows with S:
    rate per 1k = 1.5 S^2 (S the lane's stability level), single-step 60 % jumps."""
    from tests.foundation.test_cells import store_table
    cells = []
    for i, (lr_mult, b2) in enumerate([(1, 0.95), (8, 0.95), (32, 0.99), (64, 0.999)]):
        cid = f"w{dim}c{i}"
        level = 0.05 * lr_mult ** 0.9
        rows = []
        for seed in range(SEEDS):
            steps = np.arange(1, STEPS + 1)
            loss = 4.0 - 0.5 * steps / STEPS + 0.005 * rng.standard_normal(STEPS)
            hits = [t for t in np.nonzero(rng.random(STEPS) < 1.5e-3 * level ** 2)[0] + 1
                    if t > 30 and all(abs(t - u) > 30 for u in injected.get((cid, seed), []))]
            for t in hits:
                loss[t - 1] *= 1.6
            injected[(cid, seed)] = hits
            S = np.full(STEPS, np.nan)
            S[19::20] = level * np.exp(0.1 * rng.standard_normal(STEPS // 20))
            rho = {"embed": 0.7, "shallow": 0.9 * (1 + 0.1 * math.log(lr_mult)), "deep": 0.2 / lr_mult ** 0.3,
                   "head": 2.8}
            rows.append(pd.DataFrame({"seed": seed, "step": steps, "loss": loss, "grad_norm": 1.0,
                                      "update_norm": 1e-3, "S": S,
                                      **{f"rho_{g}": v * np.exp(0.05 * rng.standard_normal(STEPS))
                                         for g, v in rho.items()}}))
        cells.append({"id": cid, "lr_mult": lr_mult, "b2": b2, "batch_mult": 1,
                      "lr": 1e-3 * lr_mult, "global_batch_size": 8,
                      "config": _config(dim, 1e-3 * lr_mult, b2),
                      "cell": store_table(out / "cells", cid, pd.concat(rows), "phase_map_cell")})
    (out / "map.json").write_text(json.dumps({
        "title": f"synthetic {dim}", "quick": False, "seeds": list(range(SEEDS)),
        "curvature_every": 20, "targets": {"embed": 0.7, "shallow": 0.9, "deep": 0.2, "head": 2.8},
        "spikes": {"window": 20, "k": 4.0, "min_rel_jump": 0.1, "lead": 20, "dormant_steps": 10},
        "grid": {"lr_mult": [1, 8, 32, 64], "b2": [0.95, 0.99, 0.999], "batch_mult": [1]},
        "calibration": {}, "cells": cells, "cell_seconds": {}}))


@pytest.fixture(scope="module")
def maps(tmp_path_factory):
    rng = np.random.default_rng(0)
    injected: dict = {}
    root = tmp_path_factory.mktemp("maps")
    for dim in (16, 32):
        _write_map(root / f"map{dim}", dim, rng, injected)
    return root, injected


def test_lane_phase_rows_count_the_rules_spikes(maps):
    root, injected = maps
    rows = map_rows(root / "map16")
    assert len(rows) == 4 * SEEDS * 2 and set(rows["warmup"]) == {0.0, 1.0}
    assert (rows["width"] == 16).all() and (rows["source"] == "map").all()
    # every injected 60 % jump past the rule's history is found, in its phase
    want_w = sum(sum(1 for t in v if t <= WARMUP) for k, v in injected.items() if k[0].startswith("w16"))
    want_a = sum(sum(1 for t in v if t > WARMUP) for k, v in injected.items() if k[0].startswith("w16"))
    got = rows.groupby("warmup")["num_spikes"].sum()
    assert got[1.0] == want_w and got[0.0] == want_a and want_a > 5
    # exposure: the phase's steps after the rule's 10-step history
    assert set(rows.loc[rows["warmup"] == 1, "num_steps"]) == {WARMUP - 10}
    assert set(rows.loc[rows["warmup"] == 0, "num_steps"]) == {STEPS - WARMUP}
    assert np.isfinite(rows[MECH].to_numpy(float)).all()


def test_the_mechanism_model_finds_s_and_is_validated_on_the_wider_map(maps):
    root, _ = maps
    table, notes = SR.training_table([map_rows(root / "map16"), map_rows(root / "map32")])
    model = SR.fit(table, SR.select_features(table, MECH), n_boot=20)
    assert "log10_stability" in model.features
    val = SR.validate(table, n_boot=0, candidates=MECH)
    assert "width 32" in val["split"]
    assert val["model"]["log_loss"] < val["baseline"]["log_loss"]
    assert val["model"]["brier"] < val["baseline"]["brier"]
    # the data's law, rate = 1.5 S^2 per 1k, is a slope 2 ln 10 = 4.6 per decade of S; the
    # map's other groups move with S here (collinear), so S is checked alone (30 spikes:
    # a wide interval, measured 4.25)
    alone = SR.fit(table, ["log10_stability", "warmup"], n_boot=0)
    assert 2.5 < alone.coefficients()["log10_stability"]["coef"] < 7.0


def test_70b_candidates_get_phases_and_a_mechanism(maps):
    root, _ = maps
    table, _ = SR.training_table([map_rows(root / "map16"), map_rows(root / "map32")])
    model = SR.fit(table, SR.select_features(table, MECH), n_boot=10)
    profile = P.load_profile("llama2-70b")
    profile["ladder"]["llama2_70b"].pop("sharpness", None)     # a ladder without it
    with pytest.raises(ConfigError, match="sharpness"):
        P.predict(profile, P.default_candidates(profile), None, model=model)
    profile["ladder"]["llama2_70b"]["sharpness"] = {"lambda_max": 20.0, "lambda_max_lo": 10.0,
                                                    "lambda_max_hi": 40.0}
    pred = P.predict(profile, P.default_candidates(profile), None, model=model)
    assert len(pred.settings) == 24
    s = next(x for x in pred.settings if x["id"].startswith("eps1e-05-b2_0.95-lr0.00015"))
    ph = s["phases"]
    rho_min = min(profile["rho_by_depth"].values())
    # S = (lr_phase / eps) lambda / (38 (1 + rho_min))
    assert ph["warmup"]["stability"] == pytest.approx(0.5 * 1.5e-4 / 1e-5 * 20 / (38 * (1 + rho_min)))
    assert ph["after"]["stability"] == pytest.approx(0.55 * 1.5e-4 / 1e-5 * 20 / (38 * (1 + rho_min)))
    lo, hi = ph["after"]["stability_range"]
    assert lo < ph["after"]["stability"] < hi
    assert s["rate_per_1k"] == ph["after"]["rate_per_1k"]
    assert ph["warmup"]["rate_ci"][0] <= ph["warmup"]["rate_per_1k"] <= ph["warmup"]["rate_ci"][1]
    assert s["mechanism"] == P.mechanism(max(ph["warmup"]["stability"], ph["after"]["stability"]),
                                         ph["after"]["rho_min"],
                                         max(ph["warmup"]["stability_range"][1], hi),
                                         max(ph["warmup"]["stability_range"][0], lo))
    # out of the eps band S no longer grows as eps falls (Adam's own edge: lr lambda / 38 rms)
    s8 = next(x for x in pred.settings if x["id"].startswith("eps1e-08-b2_0.95-lr0.00015-b1_0.9-bs1024"))
    assert s8["phases"]["after"]["stability"] < ph["after"]["stability"] * 1000 / 100
    # the plan's labels (docs/plan/science4_v*.toml [labels]) from S and its interval
    assert P.mechanism(2.0, 0.5).startswith("A (S 2 [2, 2]: eps-band")
    assert P.mechanism(2.0, 0.5, 3.0, 1.2).startswith("A (")
    assert P.mechanism(0.1, 0.05).startswith("below the edge + B")
    assert P.mechanism(0.1, 0.5, 3.0, 0.05).startswith("undetermined (A)")
    assert P.mechanism(0.1, 0.5, 0.5, 0.05).startswith("below the edge (")
    assert P.mechanism(None, 0.05).startswith("B (dormant")


def test_the_full_data_reading_replaces_the_minibatch_bracket(tmp_path):
    """A batch-sharpness summary (simulate.batch_sharpness) gives the profile's sharpness a
    `full_data` reading, and S is computed from it (point and leave-one-rung-out range)."""
    from simulate import ladder as LD

    summary = {"eval_tokens": [512, 32768], "law": {"dim": 0.5, "layers": 0.3},
               "llama2_70b": {"lambda_inf": 9.0, "lambda_inf_leave_one_out": [1.0, 100.0]}}
    full = LD.full_data_sharpness(summary, 1e-5)
    assert (full["lambda_max"], full["lambda_max_lo"], full["lambda_max_hi"]) == (9.0, 1.0, 100.0)
    assert full["pi"]["peak"]["pi_eps"] == pytest.approx(1.5e-4 / 1e-5 * 9.0)
    assert LD.full_data_sharpness({"llama2_70b": None}, 1e-5) is None   # a quick run: no law
    (tmp_path / "bs").mkdir()
    (tmp_path / "bs" / "summary.json").write_text(json.dumps(summary))
    profile = P.load_profile("llama2-70b", batch_sharpness=str(tmp_path / "bs"))
    sh = profile["ladder"]["llama2_70b"]["sharpness"]
    assert sh["full_data"]["lambda_max"] == 9.0
    cand = next(c for c in P.default_candidates(profile)
                if c["optim.eps"] == 1e-5 and c["optim.lr"] == 1.5e-4)
    rho_min = min(profile["rho_by_depth"].values())
    got = P.mechanism_inputs(profile, cand, "after")
    assert got["stability"] == pytest.approx(0.55 * 15 * 9.0 / (38 * (1 + rho_min)))
    hi = P.mechanism_inputs(profile, cand, "after", "hi")["stability"]
    lo = P.mechanism_inputs(profile, cand, "after", "lo")["stability"]
    assert lo < got["stability"] < hi
    # with the law's lr term lambda moves with the candidate's lr: S ~ lr^(1 - 0.45)
    summary["law"]["lr"] = -0.45
    summary["llama2_70b"]["lr"] = 1.5e-4
    (tmp_path / "bs" / "summary.json").write_text(json.dumps(summary))
    profile = P.load_profile("llama2-70b", batch_sharpness=str(tmp_path / "bs"))
    c2 = next(c for c in P.default_candidates(profile)
              if c["optim.eps"] == 1e-5 and c["optim.lr"] == 3e-4)
    S1 = P.mechanism_inputs(profile, cand, "after")["stability"]
    S2 = P.mechanism_inputs(profile, c2, "after")["stability"]
    assert S2 / S1 == pytest.approx(2 ** 0.55)
    with pytest.raises(ConfigError, match="summary.json"):
        P.load_profile("llama2-70b", batch_sharpness=str(tmp_path / "nothing"))


def test_the_model_refits_from_its_own_training_table_bit_for_bit(maps, tmp_path, capsys):
    """`spike-rate --table DIR/table.csv`: the rows a fit wrote give the same model (every
    coefficient, interval and bootstrap draw equal as floats), so a shipped model is
    re-derived from its shipped table without the maps' cells; a file that is not such a
    table is one line and exit 2."""
    from analysis.spike_rate import main
    root, _ = maps
    args = ["--features", "log10_stability", "warmup", "--n-boot", "20"]
    assert main(["--map", str(root / "map16"), "--map", str(root / "map32"), *args,
                 "--out", str(tmp_path / "maps")]) == 0
    assert main(["--table", str(tmp_path / "maps" / "table.csv"), *args,
                 "--out", str(tmp_path / "table")]) == 0
    a, b = (json.loads((tmp_path / d / "model.json").read_text()) for d in ("maps", "table"))
    a.pop("notes", None), b.pop("notes", None)
    assert a == b and a["n_spikes"] > 0
    assert (tmp_path / "maps" / "table.csv").read_bytes() == (tmp_path / "table" / "table.csv").read_bytes()
    capsys.readouterr()
    (tmp_path / "bad.csv").write_text("source,run\nmap,x\n")
    assert main(["--table", str(tmp_path / "bad.csv"), *args, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.csv" in err[0] and "missing columns" in err[0]
    assert not (tmp_path / "o").exists()
