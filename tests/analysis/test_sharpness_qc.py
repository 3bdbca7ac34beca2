"""The plan's convergence QC and the sharpness law's 70B reading (analysis.sharpness) on
the shipped batch-sharpness rung-seeds: the one that did not converge is caught, and the
readings the issue checked by hand come out of the code."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from adamspike import package_data
from adamspike.plan import load_plan
from analysis import sharpness as SH

PLAN = load_plan("science4")
SUMMARY = json.loads((package_data.ladder_dir("llama2-70b") / "batch_sharpness.json").read_text())
RHO_MIN = 10 ** -0.7807712512057026     # the shipped profile's most dormant group at eps 1e-5


def reading(rows, min_seeds):
    return SH.reading_70b(SH.fit_law(SH.rung_table(rows, min_seeds)), PLAN, RHO_MIN)


def test_the_plain_check_fails_exactly_the_unconverged_rung_seed():
    rows = SH.shipped_rows(SUMMARY, PLAN)
    bad = rows[~rows["pass"]]
    assert bad[["dim", "layers", "seed"]].values.tolist() == [[64, 8, 1]]
    assert "change 0.33" in bad["why"].iloc[0] and "-1.61" in bad["why"].iloc[0]


def test_readings_before_and_after_qc():
    rows = SH.shipped_rows(SUMMARY, PLAN)
    shipped = reading(rows.assign(**{"pass": True}), 1)
    # the shipped fit v4 (package data): lambda_70B 4.03, S 0.75, depth exponent 0.33
    assert shipped["lambda_inf"] == pytest.approx(SUMMARY["llama2_70b"]["lambda_inf"], rel=1e-9)
    assert shipped["S_after"] == pytest.approx(0.751, abs=2e-3)
    assert shipped["depth_exponent"] == pytest.approx(0.327, abs=1e-3)
    dropped = reading(rows, 1)
    assert dropped["depth_exponent"] == pytest.approx(-0.035, abs=1e-3)
    assert dropped["lambda_inf"] == pytest.approx(1.267, abs=1e-3)
    assert dropped["S_after"] == pytest.approx(0.236, abs=1e-3)
    # the regression prediction interval, not a leave-one-out spread: S 0.05-12.5
    assert shipped["S_lo"] == pytest.approx(0.045, abs=2e-3)
    assert shipped["S_hi"] == pytest.approx(12.5, rel=0.01)
    for r in (shipped, dropped):       # the plan's label: the interval straddles 1
        assert r["label"] == "undetermined (A)"
    qc = SH.rung_table(rows, PLAN["sharpness"]["qc"]["min_seeds"])
    assert not qc.loc[(qc["layers"] == 8), "enters"].any()     # one passing seed < 2


def test_the_plans_written_predictions_are_the_codes():
    rows = SH.shipped_rows(SUMMARY, PLAN)
    laws = {"law_v4": SH.fit_law(SH.rung_table(rows.assign(**{"pass": True}), 1)),
            "law_v4_qc": SH.fit_law(SH.rung_table(rows, 1))}
    for r in PLAN["sharpness"]["rungs"]:
        for name, law in laws.items():
            # the plan writes 3 significant digits: half a unit of the third is <= 0.5 %
            assert SH.law_at(law, r["dim"], r["layers"], r["lr"]) == pytest.approx(r[name], rel=5e-3)


def payload(thetas, residual=1e-4, tmin=-0.1):
    return {"eval": [{"tokens": n, "theta_1": t, "theta_2": t / 2, "theta_min": tmin,
                      "residual": residual} for n, t in zip((512, 2048, 8192), thetas)]}


def test_qc_of_a_lanczos_rung_seed():
    assert SH.qc_cell(payload([1.0, 0.5, 0.4]), PLAN)["pass"]
    assert "residual" in SH.qc_cell(payload([1.0, 0.5, 0.4], residual=0.05), PLAN)["why"]
    assert "theta_1 <= 0" in SH.qc_cell(payload([-1.0, 0.5, 0.4]), PLAN)["why"]
    assert "a =" in SH.qc_cell(payload([0.3, 0.5, 0.6]), PLAN)["why"]     # rises with n


def test_a_rerun_supersedes_its_first_pass_and_hits_are_judged_on_the_written_interval():
    cfg = {"dim": 64, "layers": 16, "lr": 3e-3, "eps": 1e-8, "steps": 150, "iters": 30, "start": 0}
    pairs = [({**cfg, "seed": 0}, payload([1.0, 0.5, 0.45], residual=0.2)),
             ({**cfg, "seed": 0, "start": 1, "iters": 60}, payload([1.0, 0.5, 0.45])),
             ({**cfg, "seed": 1}, payload([1.1, 0.55, 0.5])),
             ({**cfg, "seed": 2}, payload([0.9, 0.45, 0.4]))]
    rows = SH.cell_rows(pairs, PLAN)
    assert rows["superseded"].tolist() == [True, False, False, False]
    rungs = SH.rung_table(rows, 2)
    assert rungs["seeds"].tolist() == [3] and rungs["enters"].all()
    h = SH.hits(PLAN, rungs).set_index("layers")
    lam = float(rungs["lambda_inf"].iloc[0])
    lo, hi = PLAN["sharpness"]["rungs"][0]["law_v4"][1:]
    assert h.loc[16, "law_v4_hit"] == ("hit" if lo <= lam <= hi else "miss")
    assert h.loc[8, "law_v4_hit"] == "not measured"
