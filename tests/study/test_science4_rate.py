"""science4's rate-model and One-S sections on synthetic map folders (no JAX): the plan's
maps found beside --map by name, in-band held-out cells only, the verdict and its files."""

import json

import numpy as np
import pandas as pd

from adamspike.cells import Cell, CellStore
from adamspike.plan import load_plan
from study.science4 import one_s_section, plan_maps, rate_model_section, rate_rows_from_maps

PLAN = load_plan("science4")
TARGETS = {"embed": 0.714, "shallow": 0.944, "deep": 0.166, "head": 2.817}


def write_map(d, cells, seed0=0, rng=None):
    """cells: (id, lr_mult, S, jump_lanes, rho_scale): 4 lanes x 600 steps; lanes in
    jump_lanes get a 2x loss jump for 6 steps at step 400."""
    rng = rng or np.random.default_rng(0)
    (d / "cells").mkdir(parents=True)
    meta = {"targets": TARGETS, "seeds": list(range(seed0, seed0 + 4)), "cells": []}
    steps = np.arange(1, 601)
    for cid, lr_mult, S, jumps, rs in cells:
        lanes = []
        for j in range(4):
            loss = 5.0 - 0.002 * steps + 0.01 * rng.standard_normal(600)
            if j in jumps:
                loss[399:405] *= 2.0
            lanes.append(pd.DataFrame({
                "seed": seed0 + j, "step": steps, "loss": loss,
                "S": np.where(steps % 20 == 0, S, np.nan),
                **{f"rho_{g}": t * rs for g, t in TARGETS.items()}}))
        # stored as the phase map stores a cell: one store, kind phase_map_cell, map.json
        # naming it (analysis.phase_map.read_cell)
        cell = Cell("phase_map_cell", "test", {"id": cid})
        CellStore(d / "cells").put(cell, {"rows": pd.concat(lanes, ignore_index=True)})
        meta["cells"].append({"id": cid, "cell": {"kind": cell.kind, "key": cell.key},
                              "lr_mult": lr_mult, "b2": 0.95, "batch_mult": 1,
                              "lr": 1e-3 * lr_mult, "eps": {g: 1e-3 for g in TARGETS},
                              "config": {"optim.warmup_steps": 200, "model.init_std": 0.02,
                                         "model.dim": 32, "model.num_layers": 4}})
    (d / "map.json").write_text(json.dumps(meta))


def test_the_plans_maps_are_found_by_name_and_judged(tmp_path):
    names = plan_maps(PLAN)
    assert names["training"][0] == "map" and "map_train" in names["training"]
    assert "map_heldout" in names["heldout"]
    assert plan_maps(PLAN, "phase_map_science4")["training"][1] == "phase_map_science4_train"
    write_map(tmp_path / "map", [("a", 1, 0.05, [], 1.0), ("b", 64, 0.3, [], 1.0)])
    write_map(tmp_path / "map_train", [("c", 512, 3.0, [0, 1], 1.0),
                                       ("d", 1024, 8.0, [0, 1, 2, 3], 1.0)])
    # held out: one in-band cell below every training spike, one out of band (rho 10x)
    write_map(tmp_path / "map_heldout", [("h", 64, 0.5, [], 1.0), ("x", 256, 0.9, [0], 10.0)],
              seed0=100)
    rows, missing = rate_rows_from_maps(tmp_path / "map", PLAN)
    # not written here: the other held-out maps and plan v3's matched map
    assert set(missing) == (set(names["heldout"]) | set(names["matched"])) - {"map_heldout"}
    assert names["matched"] == ["map_matched", "map_matched_v4"]     # plan v3 and v4 maps
    assert rows.loc[rows["source"] == "map_train", "spikes"].sum() == 6
    lines, r = rate_model_section(rows, missing, PLAN, {"reading": "test", "S": 0.3,
                                                        "lo": 0.05, "hi": 2.0}, tmp_path)
    text = "\n".join(lines)
    assert r["S_c"] == 3.0 and r["held_cells"] == 1          # the out-of-band cell is left out
    assert r["observed"] == 0 and r["total_expected"]["threshold"] == 0.0
    assert r["total_expected"]["constant"] > 0 and r["deviance"]["constant"] > 0
    assert r["verdict"] == "undetermined"
    assert "excluded as out of band" in text and "map_heldout lr x256" in text
    assert "entirely below S_c: the model says zero for the 70B" in text   # S_hi 2 < S_c 3
    assert (tmp_path / "rate_bins.csv").exists() and (tmp_path / "rate_model.json").exists()


def test_nothing_to_judge_without_the_held_out_map(tmp_path):
    lines, r = rate_model_section(None, ["map_heldout"], PLAN, None, tmp_path)
    assert r is None and "Not run" in lines[2] and "map_heldout" in lines[2]


def test_one_s_carries_the_70b_reading_onto_the_toys_scale(tmp_path):
    rows = []
    for lane in range(4):
        for step, k in ((200, 2.0), (400, 2.2), (600, 1.8)):
            rows.append({"map": "map", "lr_mult": 64, "batch_mult": 1, "seed": lane,
                         "step": step, "S_P": 0.5 * k, "S_70": 0.5, "lambda_full": 1.0,
                         "lambda_batch": 2.0})
    rows.append({"map": "map", "lr_mult": 64, "batch_mult": 1, "seed": 9, "step": 600,
                 "S_P": -1.0, "S_70": 0.5, "lambda_full": 1.0, "lambda_batch": 2.0})
    lines, cal = one_s_section(pd.DataFrame(rows), {"reading": "r", "S": 0.1, "lo": 0.01,
                                                    "hi": 1.0}, tmp_path)
    assert cal["S"] == 0.1 * 2.0
    assert cal["lo"] <= cal["S"] <= cal["hi"]
    text = "\n".join(lines)
    assert "median 2 [" in text and "1 left out" in text
    none, cal0 = one_s_section(None, None, tmp_path)
    assert cal0 is None and "Not measured" in none[2]


def test_one_s_cells_are_labelled_by_config_and_lane_seed(tmp_path):
    """Two maps may run the same cell config on other lanes (plan v4's new lanes of plan v3's
    toy): a One-S cell belongs to the map whose lanes include its seed, not to whichever map
    was read last."""
    import json
    from adamspike.cells import CellStore
    from analysis.one_s import read_table
    from simulate.one_s import cell
    config = {"optim.lr": 3e-4, "train.num_steps": 1600, "optim.warmup_steps": 200}
    for name, seeds in (("old", [200, 201]), ("new", [210, 211])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "map.json").write_text(json.dumps(
            {"seeds": seeds, "cells": [{"config": config, "lr_mult": 0.3, "batch_mult": 1}]}))
    store = CellStore(tmp_path / "cells")
    for seed in (200, 210):
        store.put(cell(config, seed, [200, 900, 1600]),
                  {"checkpoints": [{"step": 900, "S_70": float(seed)}]})
    tab = read_table(tmp_path / "cells", {n: tmp_path / n for n in ("old", "new")})
    assert dict(zip(tab["seed"], tab["map"])) == {200: "old", 210: "new"}
