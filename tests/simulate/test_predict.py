"""simulate.predict: predictions.json validates, ranks by the GLM's spike rate, is
pre-registered (hash, never overwritten), thresholds come from data."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from adamspike import package_data
from adamspike.predictions import load_predictions
from simulate import predict as P

PROFILE = {"name": "toy8", "num_layers": 8, "eps_ref": 1e-5,
           "rho_by_depth": {"-1": 0.5, "0": 2.0, "1": 20.0, "4": 50.0, "8": 50.0}, "phi": 0.0,
           "lr": 1e-3, "b1": 0.9, "global_batch_size": 64}


def _table(seed=0):
    """A sweep-like table: runs at low shallow rho spike (and carry high pre-spike rms_t)."""
    rng = np.random.default_rng(seed)
    rows = []
    for b2 in (0.95, 0.999):
        for rho in (0.3, 3.0, 300.0):
            for s in range(6):
                spiky = rho < 10
                rows.append({"optim.b2": b2, "median_rho": rho, "seed": s, "mitigation.update_clip": False,
                             "optim.eps": 1e-5, "optim.lr": 1e-3, "train.num_steps": 1000,
                             "num_spikes": int(spiky) * (1 + s % 2), "diverged": False,
                             "pre_rms_t": 3.0 + rng.random() if spiky else np.nan,
                             "max_rms_t": (3.0 + rng.random()) if spiky else 1.0 + 0.5 * rng.random(),
                             "lead_rms_t": float(rng.integers(2, 6)) if spiky else np.nan})
    return pd.DataFrame(rows)


CANDIDATES = "".join(
    f"[[candidate]]\noptim.b1 = 0.9\noptim.b2 = {b2}\noptim.eps = {eps}\noptim.lr = 1e-3\n"
    "train.global_batch_size = 64\n"
    for eps in (1e-5, 1e-8) for b2 in (0.95, 0.99))


@pytest.fixture
def cands(tmp_path):
    p = tmp_path / "cands.toml"
    p.write_text(CANDIDATES)
    return str(p)


@pytest.fixture
def profile_file(tmp_path):
    p = tmp_path / "profile.json"
    p.write_text(json.dumps(PROFILE))
    return p


def test_predictions_validate_and_rank_by_rate(tmp_path, profile_file, cands):
    table = _table()
    table.to_parquet(tmp_path / "runs.parquet")
    out = tmp_path / "pred.json"
    assert P.main(["--profile", str(profile_file), "--sweep", str(tmp_path / "runs.parquet"),
                   "--candidates", cands, "--out", str(out)]) == 0
    pred = load_predictions(out)
    assert pred.integrity["status"] == "ok"
    ranked = sorted(pred.settings, key=lambda s: s["rank"])
    rates = [s["rate_per_1k"] for s in ranked]
    assert rates == sorted(rates)
    for s in ranked:
        lo, hi = s["rate_ci"]
        assert lo <= s["rate_per_1k"] <= hi
        assert s["risk"] == s["p_spike"] and 0 <= s["p_spike_ci"][0] <= s["p_spike"] <= s["p_spike_ci"][1] <= 1
        assert s["p_spike"] == pytest.approx(1 - np.exp(-s["rate_per_1k"] * s["horizon_steps"] / 1000))
        assert set(s["extrapolation"]) == set(pred.rate_model["features"])
    assert pred.rate_model["features"] == ["log10_rho_shallow", "log10_one_minus_b2"]
    assert "validation" in pred.rate_model
    assert [s["rank"] for s in pred.settings] == list(range(1, len(pred.settings) + 1))
    assert pred.validate == [s["id"] for s in pred.settings[:3]]
    by_eps = {s["overrides"]["optim.eps"]: s for s in pred.settings
              if s["overrides"]["optim.b2"] == 0.95}
    # eps 1e-5 puts the shallow layers at rho ~ 2 (spiky in the table); eps 1e-8 at ~2000
    assert by_eps[1e-5]["risk"] > 0.6 and by_eps[1e-5]["risk_label"] == "high"
    assert by_eps[1e-8]["rate_per_1k"] < by_eps[1e-5]["rate_per_1k"] / 5
    assert by_eps[1e-8]["risk_label"] == "low"
    # rho ~ 2000 lies above the table's largest rho (300): flagged as an extrapolation
    assert by_eps[1e-8]["extrapolation"]["log10_rho_shallow"] == "above"
    assert set(by_eps[1e-5]["extrapolation"].values()) == {"inside"}
    assert not by_eps[1e-5]["support"]["outside_joint_support"]
    # the profile has a deep side the sweep table never measured: flagged, not silently used
    assert by_eps[1e-5]["extrapolated"] and by_eps[1e-5]["extrapolation_reasons"] == [
        "log10_rho_deep not in the training data"]
    # tokens per step: not in the sweep table, so not a model feature
    assert "model class and scale" in pred.rate_model["extrapolation_note"]
    rule = {r.id: r for r in pred.alarm_rules}["rms_t_shallow"]
    # the threshold separates the table's classes and says it came from the sweep
    assert 1.5 <= rule.threshold <= 3.0 and rule.source.startswith("sweep")
    assert rule.depths == (-1, 0) and 2 <= rule.expected_lead_steps[0] <= rule.expected_lead_steps[1] <= 5
    assert all(r.source for r in pred.alarm_rules)
    # profile as measured / assumed is carried into the file
    assert pred.profile["rho_by_depth"]["-1"] == 0.5 and pred.profile["shallow_depths"] == [-1, 0]


def test_without_sweep_uses_a_rate_model_and_alarms_fall_back_to_theory(
        tmp_path, profile_file, cands, capsys):
    out = tmp_path / "pred.json"
    # neither --rate-model nor --sweep: the spike-rate model shipped with the package
    assert P.main(["--profile", str(profile_file), "--candidates", cands, "--out", str(out)]) == 0
    shipped = load_predictions(out).rate_model
    assert shipped["model_file"].startswith("package data adamspike/data/llama2_70b/")
    assert shipped["shipped"].startswith("shipped fit v")
    out.unlink()
    model = tmp_path / "model.json"
    model.write_text(json.dumps(_rate_model(tmp_path).to_json()))
    assert P.main(["--profile", str(profile_file), "--candidates", cands, "--rate-model",
                   str(model), "--out", str(out)]) == 0
    pred = load_predictions(out)
    assert pred.rate_model["model_file"] == str(model)
    rules = {r.id: r for r in pred.alarm_rules}
    assert rules["rms_t_shallow"].source.startswith("literature")
    assert rules["grad_mom_cos_shallow"].source.startswith("theory")
    assert "sat_frac_shallow" not in rules         # no data, no invented threshold
    assert abs(rules["bimodality_shallow"].threshold - 5 / 9) < 1e-12


def _rate_model(tmp_path):
    from adamspike import spike_rate as SR
    return SR.fit(SR.sweep_rows(_table()), n_boot=20)


def test_preregistration_hash_and_refusal_to_overwrite(tmp_path, profile_file, cands, capsys):
    from adamspike.predictions import PredictionsError, content_hash, from_json
    table = tmp_path / "runs.parquet"
    _table().to_parquet(table)
    out = tmp_path / "pred.json"
    args = ["--profile", str(profile_file), "--sweep", str(table), "--candidates", cands,
            "--out", str(out)]
    assert P.main(args) == 0
    data = json.loads(out.read_text())
    assert data["schema_version"] == 3 and data["created"].endswith("Z")
    assert data["content_sha256"] == content_hash(data)
    before = out.read_bytes()
    capsys.readouterr()
    assert P.main(args) == 2                              # never overwritten
    assert "pre-registered" in capsys.readouterr().err and out.read_bytes() == before
    data["settings"][0]["rate_per_1k"] *= 0.5            # an edit after pre-registration
    assert from_json(data).integrity["status"] == "mismatch"
    del data["content_sha256"]
    assert from_json(data).integrity["status"] == "missing"
    with pytest.raises(PredictionsError, match="schema_version 2 .*regenerate"):
        from_json({**data, "schema_version": 2})


def test_profile_from_run_dir(tmp_path, cands):
    from adamspike.rundir import RunWriter
    from adamspike.metrics import METRIC_NAMES

    run = tmp_path / "run"
    cfg = {"model": {"preset": "tiny", "num_layers": 2}, "optim": {"eps": 1e-6, "lr": 1e-3, "b1": 0.9},
           "train": {"global_batch_size": 8}}
    with RunWriter(run, backend="jax", config=cfg) as w:
        for step in (1, 2, 3):
            rows = []
            for name, depth, g in (("embed", -1, 1e-7), ("layers.0.w1", 0, 4e-6), ("layers.1.w1", 1, 1e-4)):
                m = {k: 0.0 for k in METRIC_NAMES}
                m.update(grad_rms=g * step, rho=g * step / 1e-6, grad_mom_cos=0.05)
                rows.append({"name": name, "depth": depth, "kind": "w1", "numel": 4, **m})
            w.log_layers(step, rows=rows)
    prof = P.load_profile(str(run))
    assert prof["eps_ref"] == 1e-6 and prof["num_layers"] == 2
    np.testing.assert_allclose([prof["rho_by_depth"][d] for d in (-1, 0, 1)], [0.2, 8.0, 200.0], rtol=1e-5)
    assert all(0 <= v < 1 for v in prof["phi_by_depth"].values())
    out = tmp_path / "pred.json"
    model = tmp_path / "model.json"
    model.write_text(json.dumps(_rate_model(tmp_path).to_json()))
    assert P.main(["--profile", str(run), "--candidates", cands, "--rate-model", str(model),
                   "--out", str(out)]) == 0
    load_predictions(out)


def test_features_are_the_glms_group_rho(tmp_path):
    """The candidate's side rho is adamspike.depth_groups.group_rho over the side's depths,
    weighted by numel (the GLM's training statistic), not the median over depths; a run
    profile weights a depth's tensors by the layers table's numel."""
    from adamspike.depth_groups import group_rho
    from adamspike.metrics import METRIC_NAMES
    from adamspike.rundir import RunWriter
    numel = {"-1": 100, "0": 10, "1": 10, "4": 50, "8": 20}
    prof_file = tmp_path / "p.json"
    prof_file.write_text(json.dumps({**PROFILE, "numel_by_depth": numel}))
    prof = P.load_profile(str(prof_file))
    cand = {"optim.eps": 1e-6, "optim.b2": 0.95, "optim.lr": 1e-3, "optim.b1": 0.9,
            "train.global_batch_size": 64}
    f = P.candidate_features(prof, cand)["mid"]
    rho = {int(d): v * 10 for d, v in PROFILE["rho_by_depth"].items()}   # eps_ref / eps = 10
    sh, dp = [-1, 0], [1, 4, 8]
    assert 10 ** f["log10_rho_shallow"] == pytest.approx(
        group_rho([rho[d] for d in sh], [numel[str(d)] for d in sh]))
    assert 10 ** f["log10_rho_deep"] == pytest.approx(
        group_rho([rho[d] for d in dp], [numel[str(d)] for d in dp]))
    # without numel_by_depth (and no preset of that name): equal numel per depth, said so
    (tmp_path / "q.json").write_text(json.dumps(PROFILE))
    prof_eq = P.load_profile(str(tmp_path / "q.json"))
    assert prof_eq["numel_source"].startswith("none given")
    assert 10 ** P.candidate_features(prof_eq, cand)["mid"]["log10_rho_shallow"] == \
        pytest.approx(np.sqrt((5.0 ** 2 + 20.0 ** 2) / 2))
    # a run: depth 0 holds two tensors of different numel; rho per depth = median over steps
    # of their numel-weighted rms
    run = tmp_path / "run"
    cfg = {"model": {"preset": "tiny", "num_layers": 2}, "optim": {"eps": 1e-6, "lr": 1e-3, "b1": 0.9},
           "train": {"global_batch_size": 8}}
    tensors = (("embed", -1, 1e-7, 40), ("layers.0.w1", 0, 4e-6, 4), ("layers.0.wq", 0, 1e-6, 12),
               ("layers.1.w1", 1, 1e-4, 4))
    with RunWriter(run, backend="jax", config=cfg) as w:
        for step in (1, 2, 3):
            rows = []
            for name, depth, g, n in tensors:
                m = {k: 0.0 for k in METRIC_NAMES}
                m.update(grad_rms=g * step, rho=g * step / 1e-6, grad_mom_cos=0.05)
                rows.append({"name": name, "depth": depth, "kind": "w1", "numel": n, **m})
            w.log_layers(step, rows=rows)
    rp = P.load_profile(str(run))
    assert rp["numel_by_depth"] == {-1: 40, 0: 16, 1: 4}
    r0 = 2 * group_rho([4.0, 1.0], [4, 12])   # median step 2
    assert rp["rho_by_depth"][0] == pytest.approx(r0)
    fr = P.candidate_features(rp, {**cand, "train.global_batch_size": 8})["mid"]
    assert 10 ** fr["log10_rho_shallow"] == pytest.approx(group_rho([0.2, r0], [40, 16]))


@pytest.mark.parametrize("args,needle", [
    (["--profile", "nope-70b"], "--profile"),
    (["--profile", "llama2-70b", "--sweep", "missing.parquet"], "sweep table not found"),
    (["--profile", "llama2-70b", "--ladder", "no-such-dir"], "not a directory"),
])
def test_bad_inputs_exit_2(tmp_path, capsys, args, needle):
    assert P.main([*args, "--out", str(tmp_path / "p.json")]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_bad_candidates_and_existing_out(tmp_path, profile_file, capsys):
    c = tmp_path / "c.toml"
    c.write_text("[[candidate]]\noptim.b1 = 0.9\noptim.b2 = 1.5\noptim.eps = 1e-8\n")
    assert P.main(["--profile", str(profile_file), "--candidates", str(c),
                   "--out", str(tmp_path / "p.json")]) == 2
    assert "candidate[0].optim.b2: must be < 1.0" in capsys.readouterr().err
    existing = tmp_path / "old.json"
    existing.write_text("keep me")
    assert P.main(["--profile", str(profile_file), "--out", str(existing)]) == 2
    assert existing.read_text() == "keep me"


# ---- a fresh install: the shipped ladder + spike-rate model (adamspike.package_data) ----

def test_fresh_install_predicts_llama2_70b_from_the_shipped_fit(tmp_path):
    """`predict --profile llama2-70b` without --ladder / --rate-model / --sweep answers from
    the package data, as it does from the same files given explicitly; `validate` holds
    three settings the model can tell apart, and twins (batch only) name each other."""
    from adamspike import package_data
    from adamspike.predictions import model_key

    out = tmp_path / "p.json"
    assert P.main(["--profile", "llama2-70b", "--out", str(out)]) == 0
    pred = load_predictions(out)
    assert len(pred.settings) == 24 and pred.profile["source"].startswith("shipped fit v")
    assert pred.rate_model["model_file"].startswith("package data adamspike/data/llama2_70b/")
    keys = [model_key(pred.setting(i)) for i in pred.validate]
    assert len(pred.validate) == 3 and len(set(keys)) == 3
    # the shipped model (S and the warmup; S from eps, lr and the sharpness) cannot tell b2
    # or the batch apart: the settings with the same eps and lr name each other
    twin = {s["id"]: s.get("same_prediction_as") for s in pred.settings}
    assert set(twin["eps1e-05-b2_0.95-lr0.0003-b1_0.9-bs1024"]) == {
        "eps1e-05-b2_0.95-lr0.0003-b1_0.9-bs2048", "eps1e-05-b2_0.99-lr0.0003-b1_0.9-bs1024",
        "eps1e-05-b2_0.99-lr0.0003-b1_0.9-bs2048"}
    explicit = tmp_path / "e.json"
    assert P.main(["--profile", "llama2-70b", "--ladder", str(package_data.ladder_dir()),
                   "--rate-model", str(package_data.rate_model_path()), "--out",
                   str(explicit)]) == 0
    e = load_predictions(explicit)
    assert [(s["id"], s["rate_per_1k"], s["rate_ci"]) for s in e.settings] == \
        [(s["id"], s["rate_per_1k"], s["rate_ci"]) for s in pred.settings]


def _study_from_shipped(tmp_path):
    """A study folder holding the shipped files where the stages write them."""
    from adamspike import package_data as PD

    study = tmp_path / "study"
    shutil.copytree(PD.ladder_dir(), study / "ladder")
    for sub, mech in (("spike_rate_mechanism", True), ("spike_rate", False)):
        (study / sub).mkdir()
        shutil.copyfile(PD.rate_model_path(mechanism=mech), study / sub / "model.json")
    if (PD.profile_dir() / PD.MODEL_ROWS_FILE).is_file():   # the model's training rows
        shutil.copyfile(PD.profile_dir() / PD.MODEL_ROWS_FILE,
                        study / "spike_rate_mechanism" / "table.csv")
    if (study / PD.BATCH_SHARPNESS_FILE).is_file():   # shipped in the ladder folder
        (study / "batch_sharpness").mkdir()
        (study / PD.BATCH_SHARPNESS_FILE).rename(study / "batch_sharpness" / "summary.json")
    if (PD.profile_dir() / PD.SCIENCE4).is_dir():     # Science 4's cells and tables
        shutil.copytree(PD.profile_dir() / PD.SCIENCE4, study / "science4")
    # the claims replications' cells, in the stores of the two stages that write them
    for f in PD.store_files(PD.profile_dir() / PD.CLAIMS_CELLS):
        stage = PD.CLAIMS_STAGES[int(f.name[0], 16) % 2]   # a cell and its tables: one key
        dest = study / stage / "cells" / f.relative_to(PD.profile_dir() / PD.CLAIMS_CELLS)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dest)
    # the full phase maps, in the folders of the stages that write them
    for rel, stage in PD.PHASE_MAPS.items():
        for f in PD.map_files(PD.profile_dir() / rel):
            dest = study / stage / f.relative_to(PD.profile_dir() / rel)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest)
    # the batch-sharpness stage's rung-seed cells, in its store
    for f in PD.store_files(PD.profile_dir() / PD.BATCH_SHARPNESS_CELLS):
        dest = study / "batch_sharpness" / "cells" / f.relative_to(
            PD.profile_dir() / PD.BATCH_SHARPNESS_CELLS)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dest)
    return study


def test_package_data_round_trip_and_tamper_check(tmp_path):
    """Writing the package data from a study folder that holds the shipped files gives the
    same files (the manifest's hashes); a changed byte is refused."""
    from adamspike import package_data as PD

    study = _study_from_shipped(tmp_path)
    root = tmp_path / "data"
    m = PD.write(study, root=root)   # no predictor given: no predictions.json
    shipped = {k: v for k, v in PD.manifest()["files"].items() if k != "predictions.json"}
    assert m["files"] == shipped and m["version"] == 1
    # and says which stage made each (predictions.json: only with a predictor)
    assert set(m["produced_by"]) == set(PD.manifest()["produced_by"]) - {"predictions.json"}
    assert PD.manifest(root=root)["files"] == m["files"]
    cell = next((PD.profile_dir(root=root) / "ladder" / "cells" / "ladder_rung").glob("*.parquet"))
    cell.write_bytes(cell.read_bytes() + b"\0")
    with pytest.raises(PD.PackageDataError, match="sha256 differs"):
        PD.ladder_dir(root=root)


def test_the_mechanism_models_rows_travel_with_it(tmp_path):
    """The rows the mechanism model was fitted on (its stage's table.csv) ship beside it; a
    study that kept the shipped model keeps them; a study with another model and no rows
    ships none (a model and its rows are never mixed)."""
    import json

    from adamspike import package_data as PD

    study = _study_from_shipped(tmp_path)
    rows = b"cell,spikes\n1,0\n"
    (study / "spike_rate_mechanism" / "table.csv").write_bytes(rows)
    root = tmp_path / "data"
    PD.write(study, root=root)
    d = PD.profile_dir(root=root)
    assert (d / PD.MODEL_ROWS_FILE).read_bytes() == rows
    assert PD.MODEL_ROWS_FILE in PD.manifest(root=root)["produced_by"]
    (study / "spike_rate_mechanism" / "table.csv").unlink()
    PD.write(study, root=root)                      # the same model, no rows: kept
    assert (d / PD.MODEL_ROWS_FILE).read_bytes() == rows
    model = json.loads((study / "spike_rate_mechanism" / "model.json").read_text())
    model["refitted"] = True
    (study / "spike_rate_mechanism" / "model.json").write_text(json.dumps(model))
    m = PD.write(study, root=root)                  # another model without rows: none
    assert not (d / PD.MODEL_ROWS_FILE).exists() and PD.MODEL_ROWS_FILE not in m["files"]


def _map_folder(folder, sets=(), stored=2):
    """A phase-map folder as `adamspike phase-map` leaves it: map.json for a 2-cell grid
    (lr x2) and `stored` of its cells in the one store, with provenance files."""
    import json

    import pandas as pd

    from adamspike.cells import Cell, CellStore

    store, cells = CellStore(folder / "cells"), []
    for lr_mult in (1, 64):
        cell = Cell("phase_map_cell", "test", {"lr_mult": lr_mult, "folder": folder.name})
        if len(cells) < stored:
            store.put(cell, {"rows": pd.DataFrame({"loss": [3.0, 2.5 * lr_mult]})})
        cells.append({"lr_mult": lr_mult, "b2": 0.95, "batch_mult": 1,
                      "cell": {"kind": cell.kind, "key": cell.key}})
    (folder / "map.json").write_text(json.dumps(
        {"sets": list(sets), "grid": {"lr_mult": [1, 64], "b2": [0.95], "batch_mult": [1]},
         "cells": cells}))
    (folder / "stability_check.csv").write_text("lr_mult,S_power\n1,0.5\n")
    return folder


def test_only_full_phase_maps_ship_and_replace_the_shipped_ones(tmp_path):
    """A study's phase maps ship when they were run as their file is written with every cell
    stored (map.json, the tracker check, the cells without provenance); a reduced map (the
    standard study's `--set`) or an unfinished one keeps the shipped map, byte for byte."""
    from adamspike import package_data as PD

    study = _study_from_shipped(tmp_path)
    for stage in PD.PHASE_MAPS.values():
        shutil.rmtree(study / stage, ignore_errors=True)
    full = _map_folder(study / "phase_map")
    root = tmp_path / "data"
    m = PD.write(study, root=root)
    w32 = PD.profile_dir(root=root) / "phase_maps" / "w32"
    shipped = sorted(p.relative_to(w32).as_posix() for p in w32.rglob("*") if p.is_file())
    assert shipped == sorted(p.relative_to(full).as_posix() for p in PD.map_files(full))
    assert len(shipped) == 2 + 2 * 2 and not any(".prov." in p for p in shipped)
    assert all(f"phase_maps/w32/{p}" in m["files"] for p in shipped)
    assert m["produced_by"]["phase_maps/w32/"].startswith("stage `phase_map` of")
    assert PD.manifest(root=root)["files"] == m["files"]           # the hashes check
    before = {p: p.read_bytes() for p in w32.rglob("*") if p.is_file()}
    for other in (_map_folder(tmp_path / "reduced" / "phase_map", sets=["map.seeds=4"]),
                  _map_folder(tmp_path / "unfinished" / "phase_map", stored=1)):
        shutil.rmtree(study / "phase_map")
        shutil.copytree(other, study / "phase_map")
        assert not PD.full_map(study / "phase_map")
        m = PD.write(study, root=root)
        assert {p: p.read_bytes() for p in w32.rglob("*") if p.is_file()} == before
    assert "phase_maps/w64/" not in m["produced_by"]               # none shipped, none made
    # a file added later (a refit) with the stage that made it; the others still checked
    extra = PD.profile_dir(root=root) / "extra.csv"
    extra.write_text("a\n1\n")
    m2 = PD.add_files("llama2-70b", [extra], "a refit", root=root,
                      produced_by={"extra.csv": "stage `x`"})
    assert m2["version"] == m["version"] + 1 and m2["produced_by"]["extra.csv"] == "stage `x`"
    assert PD.manifest(root=root)["files"]["extra.csv"] == m2["files"]["extra.csv"]


def test_the_shipped_mechanism_model_is_the_one_its_shipped_maps_give(tmp_path):
    """What the standard study's spike_rate_mechanism stage does: `spike-rate --map` on the
    full maps shipped with the package gives the shipped model and its shipped rows. Rows and
    spike counts exactly; coefficients and scores within 1e-9 relative (the same program on
    the same inputs here; the tolerance is for another CPU's summation order in the fit)."""
    from analysis import spike_rate as ASR

    maps = [package_data.profile_dir() / rel for rel in package_data.PHASE_MAPS]
    if not all(package_data.full_map(m) for m in maps):
        pytest.skip("this package data ships no full phase maps (phase_maps/w32, w64)")
    out = tmp_path / "mech"
    assert ASR.main(["--map", str(maps[0]), "--map", str(maps[1]), "--features",
                     "log10_stability", "warmup", "--out", str(out)]) == 0
    shipped = package_data.profile_dir()
    new = json.loads((out / "model.json").read_text())
    old = json.loads((shipped / package_data.MODEL_FILE).read_text())
    assert (new["features"], new["n_runs"], new["n_spikes"], new["total_steps"]) == \
        (old["features"], old["n_runs"], old["n_spikes"], old["total_steps"])
    for name, c in old["coefficients"].items():
        assert new["coefficients"][name]["coef"] == pytest.approx(c["coef"], rel=1e-9), name
    for key in ("heldout_spikes", "n_train", "n_heldout"):
        assert new["validation"][key] == old["validation"][key], key
    pd.testing.assert_frame_equal(pd.read_csv(out / "table.csv"),
                                  pd.read_csv(shipped / package_data.MODEL_ROWS_FILE))


@pytest.mark.skipif(not __import__("os").environ.get("ADAMSPIKE_STUDY_DIR"),
                    reason="set ADAMSPIKE_STUDY_DIR to a finished `adamspike reproduce` folder")
def test_shipped_fit_matches_a_study_run(tmp_path):
    """The shipped prediction against a fresh study's (ADAMSPIKE_STUDY_DIR): every setting's
    rate inside the other's interval (the fits' reproducibility: the ladder and the GLM are
    refitted on other toy runs)."""
    import os

    study = Path(os.environ["ADAMSPIKE_STUDY_DIR"])
    if not (study / "spike_rate_mechanism" / "model.json").is_file():
        pytest.skip(f"{study}: no spike_rate_mechanism/model.json (a standard-scale study reads "
                    "the shipped model: compare a `reproduce --full` folder)")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert P.main(["--profile", "llama2-70b", "--out", str(a)]) == 0
    assert P.main(["--profile", "llama2-70b", "--ladder", str(study / "ladder"), "--rate-model",
                   str(study / "spike_rate_mechanism" / "model.json"), "--out", str(b)]) == 0
    sa = {s["id"]: s for s in load_predictions(a).settings}
    for s in load_predictions(b).settings:
        lo, hi = sa[s["id"]]["rate_ci"]
        assert lo <= s["rate_per_1k"] <= hi, s["id"]


def test_setting_answers_in_seconds_without_writing(tmp_path, capsys, monkeypatch):
    """`predict --profile llama2-70b --setting ...` (the shipped fit) prints each setting's
    rate and says which ones the model cannot tell apart; nothing is written; a bad value
    names the key."""
    monkeypatch.chdir(tmp_path)
    assert P.main(["--profile", "llama2-70b", "--setting", "optim.eps=1e-6,optim.b2=0.95",
                   "--setting", "optim.eps=1e-6,optim.b2=0.95,train.global_batch_size=2048"]) == 0
    out = capsys.readouterr().out
    assert "eps1e-06-b2_0.95-lr0.00015-b1_0.9-bs1024: " in out
    assert "the model predicts the same for eps1e-06-b2_0.95-lr0.00015-b1_0.9-bs2048" in out
    assert "not pre-registered" in out and not list(tmp_path.iterdir())
    assert P.main(["--profile", "llama2-70b", "--setting", "optim.b2=2"]) == 2
    assert "optim.b2" in capsys.readouterr().err
    assert P.main(["--profile", "llama2-70b"]) == 2
    assert "--out: required" in capsys.readouterr().err


def test_profile_from_log_uses_the_logged_models_size(tmp_path, capsys):
    """--profile-from-log with --num-params: rho_bar = min(gn, clip) / (sqrt(N) eps) with the
    logged model's N (a clipped log sits at the bound, which N sets), named in the source."""
    log = tmp_path / "m.log"
    log.write_text("".join(
        f" iteration {i:8d}/   10000 | consumed samples: {i * 1024:12d} | elapsed time per "
        f"iteration (ms): 1000.0 | learning rate: 1.500E-04 | global batch size:  1024 | "
        f"lm loss: 2.300000E+00 | loss scale: 1.0 | grad norm: 5.000 | number of skipped "
        f"iterations:   0 | number of nan iterations:   0 |\n" for i in range(1, 21)))
    got = {}
    for n in (None, "176e9"):
        out = tmp_path / f"p{n}.json"
        argv = ["--profile-from-log", str(log), "--out", str(out)]
        assert P.main(argv + (["--num-params", n] if n else [])) == 0
        got[n] = load_predictions(out).profile
    n70 = P.num_params(P.preset("llama2-70b"))
    assert got[None]["rho_bar"] == pytest.approx(1 / (n70 ** 0.5 * 1e-5))
    assert got["176e9"]["rho_bar"] == pytest.approx(1 / (176e9 ** 0.5 * 1e-5))
    assert "N 176000000000 (--num-params, the logged model)" in got["176e9"]["source"]
    assert P.main(["--profile-from-log", str(log), "--num-params", "1.5", "--out",
                   str(tmp_path / "x.json")]) == 2


def test_setting_takes_readmes_short_keys_and_the_baseline(capsys):
    """One --setting parser (adamspike.config.parse_setting_text): `eps=1e-6,b2=0.95` is
    `optim.eps=1e-6,optim.b2=0.95` (README: the last part of a key suffices); a key left
    out is the profile's baseline; a misspelt key names the closest one (issue 39, item 5)."""
    assert P.main(["--profile", "llama2-70b", "--setting", "eps=1e-6,b2=0.95"]) == 0
    short = capsys.readouterr().out
    assert P.main(["--profile", "llama2-70b", "--setting", "optim.eps=1e-6,optim.b2=0.95"]) == 0
    dotted = capsys.readouterr().out
    line = [x for x in short.splitlines() if x.startswith("eps1e-06")]
    assert line and line == [x for x in dotted.splitlines() if x.startswith("eps1e-06")]
    assert P.main(["--profile", "llama2-70b", "--setting", "optim.eps=1e-6"]) == 0
    assert "eps1e-06-b2_0.95-lr0.00015-b1_0.9-bs1024" in capsys.readouterr().out
    assert P.main(["--profile", "llama2-70b", "--setting", "epss=1e-6"]) == 2
    assert "did you mean eps?" in capsys.readouterr().err
    assert P.main(["--profile", "llama2-70b", "--setting", "eps=inf"]) == 2
    assert "must be finite" in capsys.readouterr().err


@pytest.mark.parametrize("setting, needle", [
    ("optim.eps=1e-5,optim.b2=0.95,optim.b1=0.999999", "optim.b1: must be in [0, 0.9999]"),
    ("optim.eps=1e-5,optim.b2=0.999999999999", "optim.b2: must be in [0, 0.9999]"),
    ("optim.eps=1e300,optim.b2=0.95", "outside the range the theory"),
    ("optim.eps=1e-300,optim.b2=0.95", "outside the range the theory"),
])
def test_predict_refuses_what_its_theory_cannot_compute(capsys, setting, needle):
    """b close to 1 (the theory's windows hold ~39/(1-b) floats: b1=0.999999 needed > 5 GB),
    a huge or tiny eps (rho decades outside the closed forms): one line, exit 2, instead of
    a traceback or an allocation (issue 40, defect 6). The guard is on memory, not time (a
    wall-clock bound fails on a loaded machine): numpy's allocations are traced, and the
    refused setting must not allocate the windows (peak well under 1 GB; the defect's was
    > 5 GB)."""
    import tracemalloc
    tracemalloc.start()
    try:
        assert P.main(["--profile", "llama2-70b", "--setting", setting]) == 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert peak < 1 << 30, f"peak traced allocation {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("flags, needle", [
    (["--eps-ref", "inf"], "--eps-ref: must be a finite number > 0"),
    (["--eps-ref", "nan"], "--eps-ref: must be a finite number > 0"),
    (["--clip", "-1"], "--clip: must be a finite number > 0"),
    (["--eps-ref", "1e-300"], "outside the range the theory"),
    (["--clip", "1e308", "--eps-ref", "1e-320"], "outside the range the theory"),
])
def test_profile_from_log_refuses_extreme_inputs(tmp_path, capsys, flags, needle):
    log = tmp_path / "m.log"
    log.write_text("".join(
        f" iteration {i:8d}/   10000 | consumed samples: {i * 1024:12d} | elapsed time per "
        f"iteration (ms): 1000.0 | learning rate: 1.500E-04 | global batch size:  1024 | "
        f"lm loss: 2.300000E+00 | loss scale: 1.0 | grad norm: 0.500 | number of skipped "
        f"iterations:   0 | number of nan iterations:   0 |\n" for i in range(1, 21)))
    assert P.main(["--profile-from-log", str(log), *flags, "--setting", "eps=1e-5"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_truncated_manifest_is_one_line_not_a_traceback(tmp_path, capsys):
    """A truncated MANIFEST.json of the package data: PackageDataError naming the file, and
    `package-data` exits 2 in one line; `assess` falls back to "no shipped fit" (issue 40,
    defect 6)."""
    from adamspike import package_data as PD

    root = tmp_path / "data"
    shutil.copytree(PD.profile_dir(), PD.profile_dir(root=root))
    mpath = PD.profile_dir(root=root) / "MANIFEST.json"
    mpath.write_bytes(mpath.read_bytes()[:40])
    with pytest.raises(PD.PackageDataError, match="MANIFEST.json: unreadable package-data"):
        PD.manifest(root=root)
    mpath.write_text("[1, 2]")
    with pytest.raises(PD.PackageDataError, match="not a package-data manifest"):
        PD.manifest(root=root)
    mpath.write_bytes(b'{"schema": 1, "files": {')
    # the CLI reads the default root: point its manifest() at the damaged copy
    import pytest as _pt
    mp = _pt.MonkeyPatch()
    mp.setattr(PD.manifest, "__defaults__", ("llama2-70b", root, frozenset()))
    try:
        assert PD.main([]) == 2
    finally:
        mp.undo()
    err = capsys.readouterr().err
    assert "unreadable package-data manifest" in err and "Traceback" not in err


def test_one_predictor_from_the_shipped_profile_and_from_a_log(tmp_path, capsys):
    """Issue 39 item 1: `predict --profile llama2-70b` and `predict --profile-from-log LOG`
    on the same setting name the same model (the mechanism model, whatever the profile
    source) and give the same number where the inputs agree (a clipped 70B log sits at the
    ladder's clipped level), with a line naming the inputs that differ; every input says
    where it came from (flag / assumed / measured / extrapolated); b2 and the batch are
    "not in the model" instead of a number that reads as measured."""
    log = tmp_path / "m.log"
    log.write_text("".join(
        f" iteration {i:8d}/   10000 | consumed samples: {i * 1024:12d} | elapsed time per "
        f"iteration (ms): 1000.0 | learning rate: 1.500E-04 | global batch size:  1024 | "
        f"lm loss: 2.300000E+00 | loss scale: 1.0 | grad norm: 5.000 | number of skipped "
        f"iterations:   0 | number of nan iterations:   0 |\n" for i in range(1, 41)))
    assert P.main(["--profile", "llama2-70b", "--setting", "eps=1e-5,b2=0.95",
                   "--setting", "eps=1e-5,b2=0.99"]) == 0
    shipped = capsys.readouterr().out.splitlines()
    assert P.main(["--profile-from-log", str(log), "--setting", "eps=1e-5,b2=0.95"]) == 0
    fromlog = capsys.readouterr().out.splitlines()
    model = [x for x in shipped if x.startswith("model: ")]
    assert model and model == [x for x in fromlog if x.startswith("model: ")]
    assert model[0].startswith("model: mechanism model (log10_stability")
    rate = [x.split(": ", 1)[1].split(" spikes")[0] for x in shipped + fromlog
            if x.startswith("eps1e-05-b2_0.95-")]
    assert len(rate) == 2 and rate[0] == rate[1], rate
    text = "\n".join(fromlog)
    assert "eps_ref 1e-05 (assumed: the 70B run's (--eps-ref not given, the log states none))" in text
    assert "N 68,976,648,192 (assumed: the llama2-70b preset's" in text
    assert "rho_bar 0.3808 (measured: median over the last 20 logged grad norms" in text
    # a log clipped at every step sits at the ladder's level, without its spread: named
    assert ("inputs that differ from --profile llama2-70b (the same model and the same "
            "computation): rho_bar_interval [0.3808, 0.3808] here vs [0.3654, 0.3808]") in text
    sh = "\n".join(shipped)
    assert "rho_bar 0.3808 (extrapolated: the ladder's fit" in sh
    assert "not in the model: optim.b2, optim.b1, train.global_batch_size" in sh
    assert "eps1e-05-b2_0.95-lr0.00015-b1_0.9-bs1024 [baseline]" in sh
    assert ("eps1e-05-b2_0.99-lr0.00015-b1_0.9-bs1024 [differs from the baseline only in "
            "optim.b2: not in the model") in sh
    # another log model: the same model still, and the line names N, eps_ref, rho_bar
    assert P.main(["--profile-from-log", str(log), "--num-params", "176e9", "--eps-ref",
                   "1e-8", "--setting", "eps=1e-5"]) == 0
    other = capsys.readouterr().out
    assert model[0] in other
    assert "eps_ref 1e-08 here vs 1e-05 (the 70B run's)" in other
    assert "N 176,000,000,000 here vs 68,976,648,192 (the llama2-70b preset)" in other


def test_rates_come_with_the_models_public_record_and_the_mechanism_label(capsys):
    """Issue 36: the shipped rate model's numbers are printed beside its record on the public
    runs (science4's public_record.json: its log-likelihood against a constant rate, what it
    expects over Meta's LLaMA2-70B run) and each setting's mechanism label from the plan's
    labels; the record is read from the package data, not restated."""
    rec = package_data.public_record("llama2-70b")
    assert rec is not None and rec["model_sha256"] == hashlib.sha256(
        package_data.rate_model_path("llama2-70b").read_bytes()).hexdigest()
    assert P.main(["--profile", "llama2-70b", "--setting", "eps=1e-5,b2=0.95"]) == 0
    text = capsys.readouterr().out
    line = [x for x in text.splitlines() if x.startswith("record on public runs")]
    assert len(line) == 1, text
    tag = rec["reading"]      # the reading predict uses: the shipped plan-QC law
    assert tag == "qc" and package_data.sharpness_law("llama2-70b") is not None
    assert (f"log-likelihood {rec['loglik'][tag]:.1f} for this model with the shipped sharpness "
            f"law vs {rec['loglik']['const']:.1f}") in line[0]
    assert f"it expects {rec['meta_llama2_70b']['expected']:.0f} [" in line[0]
    assert "not visible spikes" in line[0]
    mech = [x for x in text.splitlines() if x.startswith("  mechanism after the warmup: ")]
    assert len(mech) == 1 and mech[0].split(": ", 1)[1].startswith(("A", "undetermined", "below")), mech


def test_a_llama2_70b_profile_json_runs_the_same_mechanism_model(tmp_path, capsys):
    """A profile JSON named llama2-70b (80 layers) gets the ladder's 70B sharpness, so the
    mechanism model answers for it too: with the shipped profile's rho, the same number."""
    out = tmp_path / "p.json"
    assert P.main(["--profile", "llama2-70b", "--setting", "eps=1e-5", "--out", str(out)]) == 0
    capsys.readouterr()
    p = load_predictions(out)
    prof = tmp_path / "prof.json"
    prof.write_text(json.dumps({"name": "llama2-70b", "num_layers": p.profile["num_layers"],
                                "eps_ref": p.profile["eps_ref"],
                                "rho_by_depth": p.profile["rho_by_depth"]}))
    assert P.main(["--profile", str(prof), "--setting", "eps=1e-5"]) == 0
    text = capsys.readouterr().out
    assert "model: mechanism model (log10_stability" in text
    line = [x for x in text.splitlines() if x.startswith("eps1e-05-b2_0.95-")][0]
    assert line.split(": ", 1)[1].startswith(f"{p.settings[0]['rate_per_1k']:.3g} spikes")


def _bloom_style_log(path, grad_norms, lead=None, header=()):
    """A synthetic log in the BigScience Megatron-DeepSpeed line format of the real logs
    (`[default7]: iteration N/ T | consumed samples ... | grad norm: X | num zeros ...`),
    with the grad norms given (more digits than the real logs print: the same grammar);
    `lead` grad norms come first (predict reads the second half); `header` lines (an
    argument dump, a parameter count) before them."""
    gns = list(lead if lead is not None else [2.0] * len(grad_norms)) + list(grad_norms)
    path.write_text("".join(f"{h}\n" for h in header) + "".join(
        f"[default7]: iteration {i:8d}/  115311 | consumed samples: {i * 2048:12d} | consumed "
        f"tokens: {i * 2048 * 2048:12d} | elapsed time per iteration (s): 106.46 | learning "
        f"rate: 1.500E-04 | global batch size:  1024 | lm loss: 2.198845E+00 | grad norm: "
        f"{g!r} | num zeros: 0.0 | number of skipped iterations:   0 | number of nan "
        f"iterations:   0 | samples per second: 19.238 | TFLOPs: 147.29 |\n"
        for i, g in enumerate(gns, start=1)))
    return path


def test_a_log_with_the_shipped_profiles_inputs_gives_its_numbers(tmp_path, capsys):
    """Issue 39 item 1 (must show): `predict --profile llama2-70b` and `predict
    --profile-from-log LOG` go through one computation (rho_from_level): a log whose inputs
    equal the shipped profile's (eps 1e-5, clip 1, the 70B's N, grad norms whose level
    matches the ladder's level draw for draw) gives the same model, the same rate and the
    same interval, and says that no input differs; a log that differs in its level only
    gets a line naming exactly that."""
    from adamspike import package_data
    from simulate import ladder as LD
    fit, ext = LD.ladder_70b(package_data.ladder_dir("llama2-70b"), eps=1e-5, clip=1.0)
    n70 = P.num_params(P.preset("llama2-70b"))
    level = P.ladder_level_draws(ext)
    bound = 1.0 / (n70 ** 0.5 * 1e-5)
    # a draw at the clip bound is a clipped step (any grad norm above 1); the others the
    # grad norm that gives the draw's level
    gns = [1.7 if v >= bound * (1 - 1e-12) else float(v * n70 ** 0.5 * 1e-5) for v in level]
    assert 0 < sum(g < 1 for g in gns) < len(gns)
    # the log states the shipped profile's inputs: Megatron-DeepSpeed's argument dump (rank
    # tag as in the real logs) and the builder's per-rank parameter count
    header = ["[default0]: ------------------------ arguments ------------------------",
              "[default0]:   adam_beta1 ...................................... 0.9",
              "[default0]:   adam_beta2 ...................................... 0.95",
              "[default0]:   adam_eps ........................................ 1e-05",
              "[default0]:   clip_grad ....................................... 1.0",
              "[default0]: -------------------- end of arguments ---------------------",
              f"[default0]:  > number of parameters on (tensor, pipeline) model parallel rank "
              f"(0, 0): {n70}"]
    log = _bloom_style_log(tmp_path / "same.log", gns, header=header)
    flags = []
    setting = ["--setting", "eps=1e-5,b2=0.95", "--setting", "eps=1e-6,b2=0.95"]
    out = {}
    for name, src in (("shipped", ["--profile", "llama2-70b"]),
                      ("log", ["--profile-from-log", str(log), *flags])):
        assert P.main([*src, *setting]) == 0
        out[name] = capsys.readouterr().out.splitlines()
        assert P.main([*src, *setting, "--out", str(tmp_path / f"{name}.json")]) == 0
        capsys.readouterr()
    model = [x for x in out["shipped"] if x.startswith("model: ")]
    assert model == [x for x in out["log"] if x.startswith("model: ")]
    rates = {k: [x.split(": ", 1)[1] for x in v if x.startswith("eps1e-0")]
             for k, v in out.items()}
    assert len(rates["log"]) == 2 and rates["log"] == rates["shipped"], rates
    a, b = (load_predictions(tmp_path / f"{k}.json") for k in ("shipped", "log"))
    for sa, sb in zip(a.settings, b.settings):
        assert sb["rate_per_1k"] == pytest.approx(sa["rate_per_1k"], rel=1e-9)
        assert sb["rate_ci"] == pytest.approx(sa["rate_ci"], rel=1e-9)
    assert b.profile["rho_bar_interval"] == pytest.approx(
        a.profile["inputs"]["rho_bar_interval"]["value"], rel=1e-12)
    text = "\n".join(out["log"])
    assert ("inputs that differ from --profile llama2-70b (the same model and the same "
            "computation): none, so the same numbers") in text
    assert "eps_ref 1e-05 (read from the log: line 4, adam_eps)" in text
    assert "clip 1 (read from the log: line 5, clip_grad)" in text
    assert "N 68,976,648,192 (read from the log: log line 7" in text
    # one input differs (the level: every step at grad norm 0.2, under the clip)
    low = _bloom_style_log(tmp_path / "low.log", [0.2] * 50, header=header)
    assert P.main(["--profile-from-log", str(low), *flags, *setting]) == 0
    diff = [x for x in capsys.readouterr().out.splitlines()
            if x.startswith("inputs that differ")]
    assert len(diff) == 1
    assert f"rho_bar {0.2 * bound:.4g} here vs 0.3808" in diff[0]
    named = [item.split(" ", 1)[0] for item in diff[0].split(": ", 1)[1].split("; ")]
    assert named == ["rho_bar", "rho_bar_interval"], diff[0]
