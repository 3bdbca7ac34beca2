"""Folders written before the one cell store (a phase map's cells/<id>.parquet and its
calibrations in map.json; a claims study's arms/<arm>.parquet) are adopted into the store
without computing anything: the readers read them, and the experiment run again on the
folder finds every cell."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from study import legacy_cells as L
from tests.simulate.test_cell_kinds import _arm_result, _calibrated


def _legacy_map(tmp_path, monkeypatch):
    """A map folder as the code before the store wrote it (run_map with the stubs of
    tests/simulate/test_cell_kinds, then its cells rewritten in the legacy layout)."""
    from simulate import claims as C
    from simulate import phase_map as PM
    monkeypatch.setattr(C, "calibrate", _calibrated)
    def cell(cfg, seeds, every, tokens):
        df = C.arm_table(_arm_result(cfg, seeds), seeds)
        return df.assign(S=np.where(df["step"] % every == 0, 0.5, np.nan), S_secant=np.nan)
    monkeypatch.setattr(PM, "run_cell", cell)
    monkeypatch.setattr("simulate.seeds.arm_tokens", lambda cfg, seeds: None)
    cfg = tmp_path / "map.toml"
    cfg.write_text("[map]\nbase = 'configs/matched_replication.toml'\nseeds = 2\n"
                   "lr_mult = [1, 4]\nb2 = [0.95]\nbatch_mult = [1]\ncurvature_every = 10\n"
                   "overrides = { train = { num_steps = 20 }, optim = { warmup_steps = 5 } }\n"
                   "calibrate = { rounds = 1, seeds = 2, steps = 20 }\n"
                   "[targets]\nembed = 0.7\nshallow = 0.9\ndeep = 0.2\nhead = 2.8\n")
    spec = PM.read_map(cfg)
    new = tmp_path / "new"
    PM.run_map(spec, new, progress=False)
    from analysis.phase_map import read_cell
    meta = json.loads((new / "map.json").read_text())
    old = tmp_path / "old"
    (old / "cells").mkdir(parents=True)
    tables = {}
    for c in meta["cells"]:
        tables[c["id"]] = read_cell(new, c)
        tables[c["id"]].to_parquet(old / "cells" / f"{c['id']}.parquet", index=False)
        del c["cell"]
    for key, have in meta["calibration"].items():     # the legacy map.json's calibration
        res = _calibrated(None, have["targets"], 1, 2)
        meta["calibration"][key] = {**have, "rounds_done": res["rounds"], "seconds": 1.0}
    meta.pop("sets")
    meta["quick"] = False
    (old / "map.json").write_text(json.dumps(meta))
    return spec, old, tables


def test_a_legacy_phase_map_is_adopted_and_not_recomputed(tmp_path, monkeypatch):
    from analysis.phase_map import analyze, read_cell
    from simulate import claims as C
    from simulate import phase_map as PM
    spec, old, tables = _legacy_map(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="study.legacy_cells"):
        analyze(old)
    assert L.main([str(old)]) == 0
    meta = json.loads((old / "map.json").read_text())
    for c in meta["cells"]:
        pd.testing.assert_frame_equal(read_cell(old, c), tables[c["id"]])
    assert len(list((old / "legacy" / "cells").glob("*.parquet"))) == len(tables)
    analyze(old)                                       # the reader reads it
    for name in ("calibrate", "run_cell"):             # run again: nothing is computed
        monkeypatch.setattr(C if name == "calibrate" else PM, name,
                            lambda *a, **k: pytest.fail("recomputed"))
    PM.run_map(spec, old, progress=False)
    assert L.adopt(old) == 0                           # adopting again: nothing left


def test_a_legacy_claims_study_is_adopted(tmp_path, monkeypatch):
    from adamspike.claims import read_study
    from analysis.claims import load
    from simulate import claims as C
    from tests.simulate.test_cell_kinds import REPO
    monkeypatch.setattr(C, "calibrate", _calibrated)
    monkeypatch.setattr(C, "run_arm", _arm_result)
    (tmp_path / "ladder").mkdir()
    (tmp_path / "ladder" / "fit.json").write_text(json.dumps(
        {"llama2_70b": {"eps": 1e-5, "rho": {"embed": 1, "shallow": 1, "deep": 1, "head": 1}}}))
    st = read_study(REPO / "configs" / "claims_matched.toml")
    st.claims = [c for c in st.claims if c.id in ("seed.lower_eps",)]
    new, old = tmp_path / "new", tmp_path / "old"
    C.run_study(st, new, ladder=tmp_path / "ladder", progress=False)
    meta, arms = load(new)
    (old / "arms").mkdir(parents=True)
    for a, m in meta["arms"].items():
        arms[a].to_parquet(old / "arms" / f"{a}.parquet", index=False)
        del m["cell"]
    for have in meta["calibration"].values():       # the legacy entry: key + calibrate()
        have.update(_calibrated(None, have["targets"], 1, 2), seconds=1.0)
    (old / "replication.json").write_text(json.dumps(meta))
    assert L.adopt(old) == len(arms)
    _, got = load(old)
    for a in arms:
        pd.testing.assert_frame_equal(got[a], arms[a])
    monkeypatch.setattr(C, "run_arm", lambda *a, **k: pytest.fail("recomputed"))
    monkeypatch.setattr(C, "calibrate", lambda *a, **k: pytest.fail("recomputed"))
    C.run_study(st, old, ladder=tmp_path / "ladder", progress=False)
    assert np.array_equal(sorted(load(old)[1]), sorted(arms))
