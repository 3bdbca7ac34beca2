"""simulate.replication: verdict rules, bootstrap CIs, and table rows from a small real run."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from simulate import replication as R


@pytest.mark.parametrize("rule,lo,hi,arg,expected", [
    ("decrease", -3.0, -0.5, None, "supported"),
    ("decrease", -3.0, 0.5, None, "inconclusive"),
    ("decrease", 0.5, 2.0, None, "not supported"),
    ("increase", 0.1, 2.0, None, "supported"),
    ("increase", -2.0, -0.1, None, "not supported"),
    ("weak", -0.2, 0.3, None, "supported"),
    ("weak", -1.0, -0.6, None, "not supported"),
    ("weak", -0.8, 0.1, None, "inconclusive"),
    ("at_least", 0.6, 0.9, 0.5, "supported"),
    ("at_least", 0.1, 0.4, 0.5, "not supported"),
    ("within", 2.0, 5.0, (1, 8), "supported"),
    ("within", 9.0, 12.0, (1, 8), "not supported"),
    ("within", 6.0, 10.0, (1, 8), "inconclusive"),
    ("decrease", math.nan, math.nan, None, "inconclusive"),
])
def test_verdict_rules(rule, lo, hi, arg, expected):
    assert R.verdict(rule, lo, hi, arg) == expected


def test_bootstrap_ci_covers_the_difference():
    rng = np.random.default_rng(1)
    est, lo, hi = R.bootstrap_ci(np.array([1.0, 2, 3, 4, 5]), np.array([11.0, 12, 13, 14, 15]),
                                 "diff", rng)
    assert est == -10 and lo < -10 < hi and hi < -8
    est, lo, hi = R.bootstrap_ci(np.array([2.0, 2, 2]), None, "mean", rng)
    assert est == lo == hi == 2.0


def test_removes_rule():
    rng = np.random.default_rng(0)
    c = R.Claim("x", "s", "c", "quadratic", "num_spikes", "removes", {}, {})
    ctl = pd.DataFrame({"num_spikes": [4, 5, 6, 5, 4]})
    assert R.evaluate(c, pd.DataFrame({"num_spikes": [0] * 5}), ctl, rng)["verdict"] == "supported"
    fewer = R.evaluate(c, pd.DataFrame({"num_spikes": [1, 2, 1, 2, 1]}), ctl, rng)
    assert fewer["effect"] < 0 and fewer["verdict"] == "not supported"   # fewer, not removed


def test_evaluate_degenerate_arms_are_inconclusive():
    zeros = pd.DataFrame({"num_spikes": [0] * 5})
    c = R.Claim("x", "s", "c", "quadratic", "num_spikes", "decrease", {}, {})
    row = R.evaluate(c, zeros, zeros, np.random.default_rng(0))
    assert row["verdict"] == "inconclusive" and "every run" in row["note"]
    same = pd.DataFrame({"num_spikes": [3] * 5})
    assert R.evaluate(c, same, same, np.random.default_rng(0))["verdict"] == "not supported"


def test_small_real_replication(tmp_path):
    """Two Bai claims on the real quadratic (5 seeds): rows, CIs and verdicts; resumable.
    --quick (the quadratic is the same) leaves the llama row "not run"."""
    claims = [c for c in R.claims() if c.id in ("bai.lower_b2", "bai.eps_star", "report.glm_shrink")]
    table = R.replicate(tmp_path, quick=True, num_seeds=5, progress=False, claim_list=claims)
    assert list(table.columns) == R.COLUMNS and list(table.id) == [c.id for c in claims]
    rows = table.set_index("id")
    b2 = rows.loc["bai.lower_b2"]
    assert b2.n_seeds == 5 and b2.ci_low <= b2.effect <= b2.ci_high
    # measured: b2 0.999 -> 0.95 lowers the spike height by ~4 decades in every seed
    assert b2.treatment_mean < b2.control_mean and b2.verdict == "supported"
    es = rows.loc["bai.eps_star"]
    assert es.control_mean > 0 and es.treatment_mean == 0 and es.verdict == "supported"
    assert rows.loc["report.glm_shrink"].verdict == "inconclusive"
    assert "not run" in rows.loc["report.glm_shrink"].note
    md = R.to_markdown(table)
    assert "bai.lower_b2" in md and "supported" in md
    from figures import fig_replication as F
    table.to_csv(tmp_path / "replication.csv", index=False)
    assert F.main(["--table", str(tmp_path), "--out", str(tmp_path / "fig")]) == 0
    assert (tmp_path / "fig" / "replication.pdf").is_file()
    # a second call finds every cell on disk
    again = R.replicate(tmp_path, quick=True, num_seeds=5, progress=False, claim_list=claims)
    pd.testing.assert_frame_equal(table, again)


LLAMA_CLAIMS = ("report.batch_skip", "report.glm_shrink")


def test_full_replication_runs_the_llama_claims(tmp_path, monkeypatch):
    """Without --quick the two llama claims have runnable cells (valid trainer configs) that
    differ from their shared control only by the treatment, and reach run_cells; their rows
    come from the (here stubbed) sweep table, with the also-metrics in the note."""
    import simulate.sweep as S
    from simulate.sweep_problems import PROBLEMS, _llama_config

    claims = [c for c in R.claims() if c.id in LLAMA_CLAIMS]
    assert [c.problem for c in claims] == ["llama", "llama"]
    prob = PROBLEMS["llama"]
    base = R.base_cells(False)["llama"]
    assert "llama" not in R.base_cells(True)
    cells = {}
    for c in claims:
        tc, cc = R._full_cell(prob, {**base, **c.treatment}), R._full_cell(prob, {**base, **c.control})
        assert {k for k in tc if tc[k] != cc[k]} == set(c.treatment)
        cfg = _llama_config(tc, 0)
        assert cfg.train.num_steps == R.LLAMA_STEPS and cfg.optim.b2 == 0.999
        cells[c.id] = (tc, cc)
    assert cells["report.batch_skip"][1] == cells["report.glm_shrink"][1]   # one control
    guard_cfg = _llama_config(cells["report.batch_skip"][0], 3)
    assert guard_cfg.guard.enabled and guard_cfg.checkpoint.every == 25 and guard_cfg.train.seed == 3
    assert _llama_config(cells["report.glm_shrink"][0], 0).mitigation.embed_grad_shrink == 0.1

    seen = {}

    def fake_run_cells(problem, cell_list, seeds, out, progress=True, desc=None):
        seen[problem.name] = (cell_list, list(seeds))
        rows = []
        for cell in cell_list:
            spikes = 1 if cell["guard.enabled"] else (1 if cell["mitigation.embed_grad_shrink"] < 1 else 3)
            for s in seeds:
                rows.append({"cell_id": S.cell_id(problem.name, cell), "seed": s,
                             "num_spikes": spikes + (s % 2), "final_loss": 2.1, "max_spike_height": 0.3,
                             "online_spikes": 2.0, "guard_rollbacks": 2.0 * cell["guard.enabled"],
                             "guard_aborted": 0.0})
        return pd.DataFrame(rows)

    monkeypatch.setattr(R, "run_cells", fake_run_cells)
    table = R.replicate(tmp_path, num_seeds=5, progress=False, claim_list=claims).set_index("id")
    run, seeds = seen["llama"]
    assert len(run) == 3 and seeds == [0, 1, 2, 3, 4]   # control + two treatments, once each
    skip, glm = table.loc["report.batch_skip"], table.loc["report.glm_shrink"]
    assert skip.n_seeds == 5 and skip.control_mean == 3.4 and skip.treatment_mean == 1.4
    assert skip.verdict == "not supported"   # spikes remain in the treatment
    assert "guard_rollbacks: control 0, treatment 2" in skip.note and "by construction" in skip.note
    assert glm.treatment_mean == 1.4 and glm.ci_high < 0 and glm.verdict == "supported"
    assert "final_loss: control 2.1, treatment 2.1" in glm.note


def test_cli_bad_seeds(tmp_path, capsys):
    assert R.main(["--out", str(tmp_path), "--seeds", "1"]) == 2
    assert "--seeds" in capsys.readouterr().err


@pytest.mark.parametrize("text,needle", [
    ('[[claim]]\nid = "a"\nsource = "s"\nclaim = "c"\nproblem = "mlp"\nmetric = "num_spikes"\n'
     'rule = "removes"\ntreatment = {"optim.epsilon" = 1.0}\n', "optim.epsilon"),
    ('[[claim]]\nid = "a"\nsource = "s"\nclaim = "c"\nproblem = "mlp"\nmetric = "num_spikes"\n'
     'rule = "halves"\ntreatment = {}\n', "rule"),
    ('[[claim]]\nid = "a"\nsource = "s"\nclaim = "c"\nproblem = "cnn"\nmetric = "num_spikes"\n'
     'rule = "removes"\ntreatment = {}\n', "problem"),
])
def test_claims_file_errors_name_the_claim_and_key(tmp_path, capsys, text, needle):
    p = tmp_path / "claims.toml"
    p.write_text(text)
    assert R.main(["--out", str(tmp_path / "o"), "--claims", str(p)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_shipped_claims_are_dotted_overrides_the_problems_accept():
    for c in R.claims():
        for arm in (c.treatment, c.control or {}):
            assert all("." in k for k in arm), c.id
