"""analysis.claims: the one verdict function, the claims table and report from arms'
files (synthetic per-step and per-seed arms)."""

import json

import numpy as np
import pandas as pd
import pytest

from tests.foundation.test_cells import store_table
from analysis.claims import arms_table, claims_table, load, report_md, verdict
from analysis.spike_rate import group_numel, matched_rows

NUM_SEEDS, NUM_STEPS = 10, 400


def _arm(rng, spikes_per_seed, rho_shallow):
    rows = []
    for seed in range(NUM_SEEDS):
        loss = 3.0 * np.exp(-np.arange(NUM_STEPS) / 300) + 1.0 + 0.01 * rng.standard_normal(NUM_STEPS)
        for j in range(spikes_per_seed):
            t = 120 + 90 * j + seed
            loss[t:t + 3] *= 1.8          # a +80 % jump for 3 steps
        rows.append(pd.DataFrame({"seed": seed, "step": np.arange(1, NUM_STEPS + 1), "loss": loss,
                                  "grad_norm": 1.0, "update_norm": 0.1,
                                  "rho_embed": 0.7, "rho_shallow": rho_shallow * (1 + 0.01 * seed),
                                  "rho_deep": 0.2, "rho_head": 3.0}))
    return pd.concat(rows, ignore_index=True)


@pytest.fixture
def study(tmp_path):
    rng = np.random.default_rng(0)
    arms = {"base": _arm(rng, 1, 0.9), "more": _arm(rng, 3, 900.0), "quiet": _arm(rng, 0, 0.5),
            "same": _arm(rng, 1, 0.9)}
    refs = {name: store_table(tmp_path / "cells", name, df, "claims_arm")
            for name, df in arms.items()}

    def claim(id, control, treatment, rule, **kw):
        return {"id": id, "source": "s", "claim": id, "base": "matched", "metric": "num_spikes",
                "rule": rule, "rule_text": rule, "arg": None, "experiment": "", "note": "",
                "only_spiking": False, "also": [], "not_run": "", "control_arm": control,
                "treatment_arm": treatment, **kw}
    claims = [claim("up", "base", "more", "increase"), claim("down", "base", "quiet", "decrease"),
              claim("wrong", "base", "more", "decrease"), claim("weak", "base", "same", "weak"),
              claim("none", "quiet", "quiet", "decrease"),
              claim("toy", "tc", "tt", "removes", metric="num_spikes"),
              claim("skipped", None, None, "decrease", not_run="not run at this size")]
    for name, n in (("tc", 4.0), ("tt", 0.0)):
        refs[name] = store_table(tmp_path / "cells", name,
                                 pd.DataFrame({"seed": range(NUM_SEEDS), "num_spikes": n}), "sweep_cell")
    meta = {"title": "T", "description": "D", "seeds": list(range(NUM_SEEDS)),
            "arms": {n: {"base": "matched", "label": n, "cell": refs[n]} for n in [*arms, "tc", "tt"]},
            "claims": claims,
            "calibration": {"matched": {"targets": {"shallow": 0.94}, "eps": {"shallow": 1e-3},
                                        "rounds": [{"rho": {"shallow": 0.9}}]}}}
    meta["arm_configs"] = {n: {"optim.b2": 0.95, "optim.lr": 1e-3, "optim.eps": 1e-3,
                               "train.global_batch_size": 8, "train.seq_len": 32, "model.dim": 32}
                           for n in arms}
    (tmp_path / "replication.json").write_text(json.dumps(meta))
    return tmp_path


def test_spike_rate_rows_one_per_arm_and_seed(study):
    rows = matched_rows(study).set_index("run")
    assert len(rows) == 4 * NUM_SEEDS and (rows["source"] == "matched").all()
    assert rows.loc[f"{study.name}/more/s0", "num_spikes"] == 3
    # the side's group_rho: the groups' rho_<g> weighted by their numel (dim 32 tiny: embed
    # 2048, shallow 21568 parameters), not their plain mean
    numel = group_numel(json.loads((study / "replication.json").read_text())["arm_configs"]["more"])
    assert (numel["embed"], numel["shallow"]) == (2048, 21568)
    want = np.sqrt((2048 * 0.7 ** 2 + 21568 * 900.0 ** 2) / (2048 + 21568))
    assert rows.loc[f"{study.name}/more/s0", "log10_rho_shallow"] == pytest.approx(np.log10(want))
    assert rows.loc[f"{study.name}/more/s0", "log10_rho_deep"] == pytest.approx(
        np.log10(np.sqrt((21568 * 0.2 ** 2 + 2080 * 3.0 ** 2) / (21568 + 2080))))
    assert rows.loc[f"{study.name}/base/s0", "log10_lr_over_eps"] == pytest.approx(0.0)
    assert rows.loc[f"{study.name}/base/s0", "log10_tokens_per_step"] == pytest.approx(np.log10(256))


def test_verdicts_follow_the_paired_tests(study):
    meta, arms = load(study)
    t = claims_table(meta, arms).set_index("id")
    assert (t.drop(index="skipped")["n_seeds"] == NUM_SEEDS).all()
    assert t.loc["up", "verdict"] == "supported"
    assert t.loc["up", "effect"] == pytest.approx(2.0)
    assert t.loc["down", "verdict"] == "supported"
    assert t.loc["wrong", "verdict"].startswith("not supported")
    assert t.loc["weak", "verdict"] == "supported"          # identical spike counts: d = 0
    assert t.loc["none", "verdict"] == "inconclusive: metric 0 in every run of both arms"
    assert t.loc["toy", "verdict"] == "supported"           # per-seed rows: every run at 0
    assert t.loc["skipped", "verdict"] == "inconclusive" and "not run" in t.loc["skipped", "note"]
    # Holm over the tested rows: adjusted p >= raw p; 10 equal differences: exact p = 2/2^10
    assert (t["p_holm"].dropna() >= t["p"].dropna() - 1e-12).all()
    assert t.loc["up", "p"] == pytest.approx(2 / 2 ** NUM_SEEDS)
    assert np.isnan(t.loc["none", "p"]) and np.isnan(t.loc["weak", "p"])
    assert "equal progress" in t.loc["down", "equal_progress"] or t.loc["down", "equal_progress"]


@pytest.mark.parametrize("rule,arg,r,trt,ctl,expected", [
    ("decrease", None, (-3, -1, 0.01), [1] * 10, [3] * 10, "supported"),
    ("decrease", None, (-3, -1, 0.2), [1] * 10, [3] * 10, "inconclusive"),       # Holm p too big
    ("decrease", None, (1, 3, 0.01), [3] * 10, [1] * 10, "not supported (opposite direction)"),
    ("increase", None, (0, 0, 1.0), [3] * 10, [3] * 10, "not supported: no change in any seed"),
    ("removes", None, (-5, -3, 0.01), [1] * 10, [5] * 10, "not supported (spikes remain)"),
    ("weak", None, (-0.2, 0.3, 1.0), [2] * 10, [2] * 10, "supported"),
    ("weak", None, (-3, -1.5, 1.0), [0] * 10, [2] * 10, "not supported"),
    ("at_least", 0.5, (0.6, 0.9, 0.01), [0.7] * 10, None, "supported"),
    ("at_least", 0.5, (0.1, 0.4, 0.01), [0.3] * 10, None, "not supported"),
    ("within", (1, 8), (2, 5, np.nan), [3] * 10, None, "supported"),
    ("within", (1, 8), (9, 12, np.nan), [10] * 10, None, "not supported"),
    ("within", (1, 8), (6, 10, np.nan), [8] * 10, None, "inconclusive"),
])
def test_one_verdict_function(rule, arg, r, trt, ctl, expected):
    row = {"ci_low": r[0], "ci_high": r[1], "p_holm": r[2], "treatment_ci_low": min(trt)}
    assert verdict(rule, arg, row, np.asarray(trt, float),
                   None if ctl is None else np.asarray(ctl, float)) == expected


def test_arms_table_and_markdown(study):
    meta, arms = load(study)
    mech = arms_table(meta, arms).set_index("arm")
    assert mech.loc["more", "rho_shallow"] > 100 * mech.loc["base", "rho_shallow"]
    assert mech.loc["more", "num_spikes"] == 3
    md, _ = report_md(study)
    assert "| up |" in md and "Holm-Bonferroni" in md and "calibrated" in md


def test_an_unfinished_study_names_the_missing_arm(study):
    ref = json.loads((study / "replication.json").read_text())["arms"]["quiet"]["cell"]
    (study / "cells" / ref["kind"] / f"{ref['key']}.json").unlink()
    with pytest.raises(ValueError, match=f"{ref['key']}.json: missing cell.*arm quiet"):
        load(study)
