"""analysis.matched_replication: the claims table from arms' files (synthetic arms)."""

import json

import numpy as np
import pandas as pd
import pytest

from analysis.matched_replication import claims_table, load, mechanism_table, report_md
from analysis.spike_rate import matched_rows

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
    (tmp_path / "arms").mkdir()
    for name, df in arms.items():
        df.to_parquet(tmp_path / "arms" / f"{name}.parquet")
    claims = [
        {"id": "up", "source": "s", "claim": "more spikes", "control": "base", "treatment": "more", "rule": "increase"},
        {"id": "down", "source": "s", "claim": "fewer spikes", "control": "base", "treatment": "quiet", "rule": "decrease"},
        {"id": "wrong", "source": "s", "claim": "fewer spikes", "control": "base", "treatment": "more", "rule": "decrease"},
        {"id": "weak", "source": "s", "claim": "weak effect", "control": "base", "treatment": "same", "rule": "weak"},
        {"id": "none", "source": "s", "claim": "fewer", "control": "quiet", "treatment": "quiet", "rule": "decrease"},
    ]
    meta = {"spec": {"num_steps": NUM_STEPS, "seeds": NUM_SEEDS},
            "arms": [{"name": n} for n in arms], "claims": claims,
            "calibration": {"targets": {"shallow": 0.94}, "eps": {"shallow": 1e-3}},
            "base": {"model.dim": 32, "model.num_layers": 4, "model.vocab_size": 4096,
                     "data.zipf_exponent": 1.1, "train.global_batch_size": 8, "train.seq_len": 32,
                     "optim.b1": 0.9, "optim.b2": 0.95, "optim.weight_decay": 0.1,
                     "optim.grad_clip": 1.0, "optim.lr": 1e-3, "optim.warmup_steps": 10,
                     "optim.schedule": "cosine", "train.dtype": "fp32"}}
    meta["arm_configs"] = {n: {"optim.b2": 0.95, "optim.lr": 1e-3, "optim.eps": 1e-3,
                               "train.global_batch_size": 8, "train.seq_len": 32, "model.dim": 32}
                           for n in arms}
    (tmp_path / "replication.json").write_text(json.dumps(meta))
    return tmp_path


def test_spike_rate_rows_one_per_arm_and_seed(study):
    rows = matched_rows(study).set_index("run")
    assert len(rows) == 4 * NUM_SEEDS and (rows["source"] == "matched").all()
    assert rows.loc[f"{study.name}/more/s0", "num_spikes"] == 3
    assert rows.loc[f"{study.name}/more/s0", "log10_rho_shallow"] == pytest.approx(np.log10((0.7 + 900) / 2))
    assert rows.loc[f"{study.name}/base/s0", "log10_lr_over_eps"] == pytest.approx(0.0)
    assert rows.loc[f"{study.name}/base/s0", "log10_tokens_per_step"] == pytest.approx(np.log10(256))


def test_verdicts_follow_the_paired_tests(study):
    meta, arms = load(study)
    t = claims_table(meta, arms).set_index("id")
    assert (t["n_seeds"] == NUM_SEEDS).all()
    assert t.loc["up", "verdict"] == "supported"
    assert t.loc["up", "mean_diff"] == pytest.approx(2.0)
    assert t.loc["down", "verdict"] == "supported"
    assert t.loc["wrong", "verdict"].startswith("not supported")
    assert t.loc["weak", "verdict"] == "supported"          # identical spike counts: d = 0
    assert t.loc["none", "verdict"] == "inconclusive: no spikes in either arm"
    # Holm: adjusted p >= raw p, and the exact permutation p of 10 equal differences is 2/2^10
    assert (t["p_holm"].dropna() >= t["p"].dropna() - 1e-12).all()
    assert t.loc["up", "p"] == pytest.approx(2 / 2 ** NUM_SEEDS)
    assert "matched" in t.loc["up", "regime"]


def test_mechanism_rows_and_markdown(study):
    meta, arms = load(study)
    mech = mechanism_table(meta, arms).set_index("arm")
    assert mech.loc["more", "log10_rho_shallow_vs_base"].startswith("+3")
    md, _ = report_md(study)
    assert "| up |" in md and "Holm" in md


def test_an_unfinished_study_names_the_missing_arm(study):
    (study / "arms" / "quiet.parquet").unlink()
    with pytest.raises(ValueError, match="quiet.parquet: missing"):
        load(study)
