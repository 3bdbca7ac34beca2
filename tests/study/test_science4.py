"""`adamspike science4` from the shipped data: the plan's hash printed, the sharpness
readings before and after QC, the public record against a constant rate; bad input in one
line."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pandas as pd
import pytest

from adamspike import package_data
from study.cli import main as cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def s4(tmp_path_factory):
    out = tmp_path_factory.mktemp("s4") / "science4"
    assert cli(["science4", "--out", str(out), "--no-progress"]) == 0
    return out


def test_report_carries_the_plans_hash(s4):
    text = (s4 / "science4.md").read_text()
    for plan in sorted((REPO / "docs" / "plan").glob("science4_v*.toml")):   # every version
        assert hashlib.sha256(plan.read_bytes()).hexdigest() in text, plan.name
    assert "Reason:" in text          # a later version says why it changed
    assert json.loads((s4 / "science4.json").read_text())["plan_sha256"] in text


def test_the_law_predict_reads_is_rederived_and_the_v2_sections_are_there(s4):
    text = (s4 / "science4.md").read_text()
    assert "is re-derived here from the cells: the same coefficients" in text
    for section in ("## One S", "## A rate model that can say zero", "Verdict under the plan"):
        assert section in text
    # (the comparison is science4's own, rtol 1e-9: the shipped law was fitted on another
    # machine's BLAS, so bytes are not compared)


def test_sharpness_readings_before_and_after_qc(s4):
    v = pd.read_csv(s4 / "sharpness_versions.csv").set_index("reading")
    shipped = v.loc["v4 as shipped (no QC)"]
    assert shipped["lambda_inf"] == pytest.approx(4.03, abs=0.01)
    assert v.loc["v4, failed seed dropped", "S_after"] == pytest.approx(0.236, abs=2e-3)
    rows = pd.read_csv(s4 / "sharpness_rungseeds.csv")
    assert (~rows["pass"]).sum() >= 1


def test_public_record_meta_and_seed_get_one_rate_and_the_model_loses_to_a_constant(s4):
    r = pd.read_csv(s4 / "public_record.csv").set_index("run")
    meta, seed = r.loc["Meta LLaMA2-70B"], r.loc["seed report, LLaMA2-70B on 1024 x 910B (eps 1e-5)"]
    assert meta["S_after_v4"] == pytest.approx(seed["S_after_v4"])
    assert meta["expected_v4"] > 100 and meta["reported"] == 0      # hundreds vs none
    assert r["loglik_v4"].sum() < r["loglik_const"].sum()
    assert pd.isna(r.loc["PaLM 540B", "expected_v4"])              # Adafactor: no expectation
    # what predict prints beside the model's rates is this record, re-derived here
    shipped = package_data.public_record("llama2-70b")
    here = json.loads((s4 / "public_record.json").read_text())
    assert here["model_sha256"] == shipped["model_sha256"]
    assert here["runs_counted"] == shipped["runs_counted"]
    # rtol: the shipped file was computed on another machine's BLAS (the same program)
    assert here["reading"] == shipped["reading"] == "qc"
    for k in ("v4", "qc", "const"):
        assert here["loglik"][k] == pytest.approx(shipped["loglik"][k], rel=1e-6)
    assert here["meta_llama2_70b"]["expected"] == pytest.approx(
        shipped["meta_llama2_70b"]["expected"], rel=1e-6)


def test_bad_input_is_one_line(tmp_path, capsys):
    assert cli(["science4", "--out", str(tmp_path / "o"), "--map", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--map" in err[0] and "not a directory" in err[0]
    assert not (tmp_path / "o").exists()


def test_claims_under_the_plans_rule_on_a_synthetic_replication(tmp_path):
    """Paired seeds: the control arm has a visible spike in every seed, the treatment none
    -> supported (sign test 10/10, p 0.002); equal arms -> undetermined; each group's rho
    ratio is set against the 70B's eps change (x1000)."""
    import numpy as np
    from adamspike.plan import load_plan
    from study.science4 import claims_under_plan

    rng = np.random.default_rng(0)

    def arm(spike: bool, rho_scale: float) -> pd.DataFrame:
        rows = []
        for seed in range(10):
            loss = 4 + 2 * np.exp(-np.arange(400) / 80) + 0.02 * rng.standard_normal(400)
            if spike:
                loss[200 + seed:212 + seed] *= 2.0
            rows.append(pd.DataFrame({"seed": seed, "step": np.arange(1, 401), "loss": loss,
                                      "rho_embed": 0.7 * rho_scale, "rho_shallow": 0.9 * rho_scale,
                                      "rho_deep": 0.2 * rho_scale, "rho_head": 3.0 * rho_scale}))
        return pd.concat(rows, ignore_index=True)
    from tests.foundation.test_cells import store_table
    refs = {n: store_table(tmp_path / "cells", n, arm(spike, scale), "claims_arm")
            for n, spike, scale in (("c", True, 1.0), ("t", False, 500.0), ("c2", True, 1.0))}
    claims = [{"id": "lower", "claim": "x", "treatment": {"optim.eps": "*0.001"},
               "treatment_arm": "t", "control_arm": "c"},
              {"id": "same", "claim": "y", "treatment": {"optim.eps": "*0.1"},
               "treatment_arm": "c2", "control_arm": "c"}]
    (tmp_path / "replication.json").write_text(json.dumps(
        {"claims": claims, "arms": {a: {"label": a, "base": "b", "cell": refs[a]}
                                   for a in ("c", "t", "c2")}}))
    df = claims_under_plan(tmp_path, load_plan("science4")).set_index("id")
    assert df.loc["lower", "visible_control"] == 10 and df.loc["lower", "visible_treatment"] == 0
    assert df.loc["lower", "p_holm"] < 0.01 and df.loc["lower", "verdict"] == "supported"
    assert df.loc["same", "verdict"] == "undetermined"
    assert df.loc["lower", "rho_shallow_off"] == pytest.approx(0.5)    # 500x, not 1000x


def test_pooled_visible_rate_in_band_says_zero_with_its_exact_upper_bound():
    """0 visible spikes in 3,000 in-band lane-steps: rate 0, 95 % upper end
    chi2(0.975, 2) / 2 / 3 = 1.23 per 1k (Garwood); 3 in 2,000 out of band; the seed's own
    count is read from configs/public_record.toml."""
    from study.science4 import pooled_visible_md
    rows = pd.DataFrame({"source": ["a", "a", "b"], "lr_mult": [1, 64, 1024],
                         "spikes": [0, 0, 3], "steps": [1500, 1500, 2000],
                         "cell_in_band": [True, True, False]})
    text = "\n".join(pooled_visible_md(rows))
    assert "in the 70B's rho band, every map's lanes pooled: 0 in 3,000 lane-steps" in text
    assert "0 per 1k steps, 95 % [0, 1.23]" in text
    assert "out of band, every map's lanes pooled: 3 in 2,000 lane-steps" in text
    assert "The seed's 70B run: 1 visible spike(s) in 1,543 steps (at least" in text
    # one seed run: the plan's [match.test] names the same record entry
    from adamspike.plan import load_plan
    from study.science4 import SEED_RUN, record_run
    assert record_run(SEED_RUN) is not None and load_plan("science4")["match"]["test"]["seed_run"] == SEED_RUN


def test_seed_rate_test_is_the_exact_conditional_binomial():
    """Plan v3 [match.test]: 0 toy spikes in 32,000 lane-steps against the seed's 1 in 1543:
    P[K <= 0] = 1543 / 33543 = 0.046 < 0.05 -> lower; in 20,000 lane-steps 0.0716 -> not
    distinguishable (with k0 = 1 only a toy with none can separate the rates); 30 in
    1,000 against 1 in 1,543 -> higher."""
    from study.science4 import seed_rate_test
    t = seed_rate_test(0, 32000, 1, 1543, 0.05)
    assert t["p_lower"] == pytest.approx(1543 / 33543, rel=1e-12)
    assert t["verdict"] == "lower than the seed run's rate"
    assert seed_rate_test(0, 20000, 1, 1543, 0.05)["verdict"] == \
        "not distinguishable from the seed run's rate"
    assert seed_rate_test(30, 1000, 1, 1543, 0.05)["verdict"] == "higher than the seed run's rate"


def test_match_uses_the_70bs_estimator_where_one_s_measured_it():
    """Plan v3 [match] s_estimator S_70: a cell's S is the median of its One-S checkpoints
    after the first (the end of the warmup); a cell without One-S cells keeps the tracker S,
    marked; the tracker's ratio stays beside it and is not matched on."""
    from study.science4 import match_table, s70_after_warmup
    one = pd.DataFrame({"map": "m", "lr_mult": 1.0, "batch_mult": 1, "seed": [0, 0, 0, 1, 1, 1],
                        "step": [200, 400, 600] * 2, "S_70": [50.0, 0.5, 0.7, 50.0, 0.9, 1.1]})
    s70 = s70_after_warmup(one)
    assert s70["S_70"].tolist() == [pytest.approx(0.8)] and s70["S_70_checkpoints"].tolist() == [4]
    ref = {"lr": 1e-3, "weight_decay": 0.1, "rho_embed": 1.0, "rho_shallow": 1.0,
           "rho_deep": 1.0, "rho_head": 1.0, "S_median": 1.0, "theta_rms_init": 1.0,
           "update_rms": 1.0}
    cells = pd.DataFrame({"map": ["m", "m"], "lr_mult": [1.0, 4.0], "b2": 0.95, "batch_mult": 1,
                          "lr": [1e-3, 4e-3], "weight_decay": 0.1, "rho_embed": 1.0,
                          "rho_shallow": 1.0, "rho_deep": 1.0, "rho_head": 1.0,
                          "S_median": [0.05, 2.0], "theta_rms_init": 1.0, "update_rms": [1.0, 4.0]})
    m = match_table(cells, ref, 3.0, s70).set_index("lr_mult")
    assert m.loc[1.0, "S_estimator"] == "S_70" and m.loc[1.0, "S_ratio"] == pytest.approx(0.8)
    assert m.loc[1.0, "S_tracker_ratio"] == pytest.approx(0.05) and m.loc[1.0, "all_match"]
    assert m.loc[4.0, "S_estimator"] == "tracker" and m.loc[4.0, "S_ratio"] == pytest.approx(2.0)
    assert not m.loc[4.0, "all_match"] and "rel_update" not in m.loc[4.0, "matches"]


def test_pooled_in_band_rate_is_set_beside_the_seed_run_as_description():
    from study.science4 import pooled_visible_md
    rows = pd.DataFrame({"source": ["a"], "lr_mult": [1], "spikes": [0], "steps": [54800],
                         "cell_in_band": [True]})
    text = "\n".join(pooled_visible_md(rows))
    # 1543 / (54800 + 1543): the seed's share of the pooled steps
    assert f"descriptive, not a plan test" in text and f"P[K <= k] = {1543 / 56343:.3g}" in text


def test_v4_test_pools_only_its_own_maps_new_lanes_and_names_the_reading():
    """Plan v4 [match.test] maps: the all-matched cells of the test's maps are pooled and
    tested; an earlier version's matched cell (lanes already seen) is described with its own
    test beside, never pooled in. [match] s_reading picks the law reading by name."""
    from study.science4 import match_md, match_reading
    plan = {"plan": {"version": 4}, "match": {
        "factor": 3.0, "s_reading": "v5",
        "test": {"alpha": 0.05, "seed_run": "seed report, LLaMA2-70B on 1024 x 910B (eps 1e-5)",
                 "maps": ["configs/phase_map_science4_matched_v4.toml"]}}}
    match = pd.DataFrame({"map": ["map_matched", "map_matched_v4", "map_matched_v4"],
                          "lr_mult": [0.3, 0.3, 0.4], "batch_mult": 1, "S_ratio": [0.35, 0.4, 0.5],
                          "matches": "S", "all_match": [True, True, True],
                          "visible_spikes": [0, 0, 0], "steps": [16000, 32000, 32000]})
    text = "\n".join(match_md(match, plan, "v5", test_maps=["map_matched_v4"]))
    # the test: 64,000 new lane-steps, P[K <= 0] = 1543 / 65543; v3's cell alone: 1543 / 17543
    assert f"0 in 64,000 lane-steps" in text and f"P[K <= k] = {1543 / 65543:.3g}" in text
    assert "lower than the seed run's rate" in text
    assert f"P[K <= k] = {1543 / 17543:.3g}" in text and "not pooled" in text
    versions = pd.DataFrame({"reading": ["v4", "v5"], "S_after": [0.72, 0.37]})
    assert match_reading(versions, plan)["S_after"] == 0.37
    from adamspike.config import ConfigError
    with pytest.raises(ConfigError, match="s_reading"):
        match_reading(versions, {"match": {"s_reading": "v9"}})
