"""The one claims system: adamspike.claims (schema), simulate.claims (arms, resumable) and the
`adamspike replicate` CLI on both shipped claim files (a small real toy run; the tiny-LLaMA
arms are stubbed here, the matched stage itself runs in tests/study)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from adamspike.claims import REPO, read_study, resolve
from adamspike.config import ConfigError
from analysis.claims import report_md
from simulate import claims as C
from study.cli import replicate_main

TOY, MATCHED = REPO / "configs" / "claims.toml", REPO / "configs" / "claims_matched.toml"


def _subset(path, ids):
    st = read_study(path)
    st.claims = [c for c in st.claims if c.id in ids]
    return st


def test_shipped_claim_files_parse_into_one_schema():
    toy, matched = read_study(TOY), read_study(MATCHED)
    assert len(toy.claims) >= 15 and len(matched.claims) >= 8 and toy.seeds == matched.seeds == 10
    assert {c.base for c in toy.claims} == {"mlp", "mlp_deep", "quadratic", "llama"}
    lower = next(c for c in matched.claims if c.id == "seed.lower_eps")
    assert lower.control == {} and lower.treatment_name == "eps_div1000"
    for c in toy.claims + matched.claims:
        assert all("." in k for k in {**c.treatment, **(c.control or {})}), c.id


def test_multiplier_values_scale_the_base():
    assert resolve({"optim.eps": 2e-3, "optim.b2": 0.95}, {"optim.eps": "*0.001", "optim.b2": 0.99}) \
        == {"optim.eps": pytest.approx(2e-6), "optim.b2": 0.99}
    with pytest.raises(ConfigError, match="optim.lr"):
        resolve({}, {"optim.lr": "*2"})


@pytest.mark.parametrize("text,needle", [
    ('[base.q]\nproblem = "quadratic"\n[[claim]]\nid = "a"\nsource = "s"\nclaim = "c"\nmetric = "num_spikes"\n'
     'rule = "removes"\ntreatment = {"optim.epsilon" = 1.0}\n', "optim.epsilon"),
    ('[base.q]\nproblem = "quadratic"\n[[claim]]\nid = "a"\nsource = "s"\nclaim = "c"\nmetric = "num_spikes"\n'
     'rule = "halves"\ntreatment = {}\n', "rule"),
    ('[base.q]\nproblem = "cnn"\n[[claim]]\nid = "a"\nsource = "s"\nclaim = "c"\nmetric = "num_spikes"\n'
     'rule = "removes"\ntreatment = {}\n', "problem"),
    ('[base.q]\nproblem = "quadratic"\n[[claim]]\nid = "a"\nsource = "s"\nclaim = "c"\nmetric = "num_spikes"\n'
     'rule = "removes"\ntreatment = "nope"\n', "unknown arm 'nope'"),
    ('[base.q]\nproblem = "quadratic"\nbogus = 1\n[[claim]]\nid = "a"\n', "unknown field 'bogus'"),
])
def test_claims_file_errors_name_the_claim_and_key(tmp_path, capsys, text, needle):
    p = tmp_path / "claims.toml"
    p.write_text(text)
    assert replicate_main(["--out", str(tmp_path / "o"), "--claims", str(p)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "o" / "cells").exists() or not any((tmp_path / "o" / "cells").rglob("*"))


def test_cli_bad_seeds(tmp_path, capsys):
    assert replicate_main(["--out", str(tmp_path), "--seeds", "1"]) == 2
    assert "--seeds" in capsys.readouterr().err
    assert replicate_main(["matched", "--out", str(tmp_path / "m")]) == 2   # --ladder required


def test_small_real_replication(tmp_path):
    """Two Bai claims on the real quadratic (10 paired seeds): rows, intervals, verdicts;
    resumable (arm cells reused); --only leaves the llama row "not run"."""
    st = _subset(TOY, ("bai.lower_b2", "bai.eps_star", "report.glm_shrink"))
    only = ["bai.lower_b2", "bai.eps_star"]
    C.run_study(st, tmp_path, only=only, progress=False)
    md, table = report_md(tmp_path)
    rows = table.set_index("id")
    b2 = rows.loc["bai.lower_b2"]
    assert b2.n_seeds == 10 and b2.ci_low <= b2.effect <= b2.ci_high
    # measured: b2 0.999 -> 0.95 lowers the spike height by ~4 decades in every seed
    assert b2.treatment_mean < b2.control_mean and b2.verdict == "supported"
    es = rows.loc["bai.eps_star"]
    assert es.control_mean > 0 and es.treatment_mean == 0 and es.verdict == "supported"
    assert rows.loc["report.glm_shrink"].verdict == "inconclusive"
    assert "not run" in rows.loc["report.glm_shrink"].note
    assert "bai.lower_b2" in md and "Holm-Bonferroni" in md
    from figures import fig_replication as F
    table.to_csv(tmp_path / "replication.csv", index=False)
    assert F.main(["--table", str(tmp_path), "--out", str(tmp_path / "fig")]) == 0
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cells").rglob("*")}
    assert len(stamps) >= 3
    C.run_study(st, tmp_path, only=only, progress=False)     # every arm on disk: nothing reruns
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cells").rglob("*")} == stamps
    pd.testing.assert_frame_equal(table, report_md(tmp_path)[1])


def test_full_replication_runs_the_llama_claims(tmp_path, monkeypatch):
    """Without --only the two llama claims have runnable cells that differ from their
    shared control only by the treatment; their rows come from the (stubbed) sweep table,
    with the also-metrics in the note."""
    import simulate.sweep as S
    st = _subset(TOY, ("report.batch_skip", "report.glm_shrink"))
    seen = {}

    from adamspike.cells import CellStore

    def fake_run_cells(problem, cell_list, seeds, out, progress=True, desc=None, cells_from=()):
        seen[problem.name] = (cell_list, list(seeds))
        frames = []
        for cell in cell_list:      # stored as the sweep stores its cells: the arms' tables
            spikes = 1 if cell["guard.enabled"] else (1 if cell["mitigation.embed_grad_shrink"] < 1 else 3)
            df = pd.DataFrame([{"cell_id": S.cell_id(problem.name, cell), "seed": s,
                                "num_spikes": spikes + (s % 2), "final_loss": 2.1,
                                "max_spike_height": 0.3, "guard_rollbacks": 2.0 * cell["guard.enabled"],
                                "guard_aborted": 0.0} for s in seeds])
            CellStore(Path(out) / "cells").put(S.store_cell(problem, cell, seeds, problem.spikes),
                                               {"rows": df})
            frames.append(df)
        return pd.concat(frames, ignore_index=True)

    monkeypatch.setattr(C, "run_cells", fake_run_cells)
    C.run_study(st, tmp_path, progress=False)
    cells, seeds = seen["llama"]
    assert len(cells) == 3 and seeds == list(range(10))   # control + two treatments, once each
    assert {k for k in cells[0] if cells[0][k] != cells[1][k]} <= {"guard.enabled", "mitigation.embed_grad_shrink"}
    assert all(c["train.num_steps"] == 1500 and c["optim.b2"] == 0.999 for c in cells)
    table = report_md(tmp_path)[1].set_index("id")
    skip, glm = table.loc["report.batch_skip"], table.loc["report.glm_shrink"]
    assert skip.n_seeds == 10 and skip.control_mean == 3.5 and skip.treatment_mean == 1.5
    assert skip.verdict == "not supported (spikes remain)"
    assert "guard_rollbacks: control 0, treatment 2" in skip.note and "by construction" in skip.note
    assert glm.ci_high < 0 and glm.verdict == "supported"
    # --skip-llama: the rows stay, not run
    t2 = report_md(C.run_study(st, tmp_path / "s", skip_llama=True, progress=False))[1]
    assert (t2["verdict"] == "inconclusive").all() and t2["note"].str.contains("skip-llama").all()


def test_matched_arms_scale_the_calibrated_eps(tmp_path, monkeypatch):
    """The matched file's arms: calibrated base (stubbed pilots), "*0.001" on the group eps,
    overrides; resolved configs land in replication.json's arm_configs (the spike-rate reader)."""
    (tmp_path / "ladder").mkdir()
    (tmp_path / "ladder" / "fit.json").write_text(json.dumps(
        {"llama2_70b": {"eps": 1e-5, "rho": {"embed": 1, "shallow": 1, "deep": 1, "head": 1}}}))
    eps = {"embed": 1e-3, "shallow": 2e-3, "deep": 4e-3, "head": 5e-4}
    monkeypatch.setattr(C, "calibrate", lambda *a, **k: {"targets": {}, "rounds": [], "eps": eps})
    monkeypatch.setattr(C, "run_arm", lambda cfg, seeds: (_ for _ in ()).throw(KeyboardInterrupt))
    st = _subset(MATCHED, ("seed.lower_eps", "seed.shallow_eps", "seed.eps_lower_b2"))
    with pytest.raises(KeyboardInterrupt):      # killed at the first arm: meta is on disk
        C.run_study(st, tmp_path / "o", ladder=tmp_path / "ladder", progress=False)
    meta = json.loads((tmp_path / "o" / "replication.json").read_text())
    label = {m["label"]: meta["arm_configs"][a] for a, m in meta["arms"].items()}
    assert set(label) == {"base", "eps_div1000", "shallow_eps_div1000", "b2_0.99"}
    s = label["shallow_eps_div1000"]
    assert s["mitigation.eps_embed"] == pytest.approx(1e-6)
    assert s["mitigation.eps_shallow"] == pytest.approx(2e-6) == s["optim.eps"]
    assert s["mitigation.eps_deep"] == pytest.approx(4e-3) and label["b2_0.99"]["optim.b2"] == 0.99
    assert label["base"]["train.num_steps"] == 300
    with pytest.raises(ConfigError, match="ladder"):
        C.run_study(st, tmp_path / "p", progress=False)


def test_ladder_targets_need_a_ladder_fit_at_eps_1e5(tmp_path):
    with pytest.raises(ConfigError, match="not a ladder fit"):
        C.ladder_targets(tmp_path)
    (tmp_path / "fit.json").write_text(json.dumps({"llama2_70b": {"eps": 1e-8, "rho": {"deep": 1}}}))
    with pytest.raises(ConfigError, match="expected 1e-5"):
        C.ladder_targets(tmp_path)


def test_calibration_secant_finds_eps_when_the_gradient_grows_as_eps_shrinks():
    # rho = c eps^-2: the rms-held-fixed step alone would overshoot by 4x; the secant lands
    c, target = 4e-6, 1.0
    rounds = [{"eps": {"embed": 1e-3}, "rho": {"embed": c / 1e-3 ** 2}}]
    for _ in range(3):
        e = C.next_eps("embed", rounds, target)
        rounds.append({"eps": {"embed": e}, "rho": {"embed": c / e ** 2}})
    assert rounds[1]["eps"]["embed"] == pytest.approx(4e-3)
    assert rounds[-1]["rho"]["embed"] == pytest.approx(target, rel=1e-6)
    flat = [{"eps": {"g": 1e-3}, "rho": {"g": 1e3}}, {"eps": {"g": 2e-3}, "rho": {"g": 1e3}}]
    assert C.next_eps("g", flat, 1.0) == pytest.approx(2e-3 * 10 ** 1.5)


@pytest.mark.parametrize("claims", ["claims_phase.toml", "claims_matched.toml"])
def test_the_standard_study_finds_every_claims_cell_in_the_shipped_store(tmp_path, monkeypatch, claims):
    """The standard study copies the claims replications' calibrations and arms from the
    cells shipped with the package (configs/study.toml: `cells-from`) instead of running
    ~30 min of them: with the shipped ladder refitted, as its `ladder` stage does, every
    cell key the current code resolves is there, so nothing is computed (a code or config
    change that moves a key fails here, not as a silently slow study: rerun the two stages
    at --full and ship their cells, `adamspike package-data --from STUDY`)."""
    from adamspike import package_data
    from simulate.ladder import main as ladder_main
    shipped = package_data.profile_dir("llama2-70b")
    assert ladder_main(["--out", str(tmp_path / "ladder"), "--cells-from", str(shipped / "ladder"),
                        "--no-progress"]) == 0

    def would_compute(*a, **k):
        raise AssertionError("a claims cell is not in the shipped store: it would be computed")
    monkeypatch.setattr(C, "calibrate", would_compute)
    monkeypatch.setattr(C, "run_arm", would_compute)
    out = C.run_study(read_study(REPO / "configs" / claims), tmp_path / "out",
                      ladder=tmp_path / "ladder", progress=False,
                      cells_from=[shipped / package_data.CLAIMS_CELLS])
    stored = sorted(p for p in (out / "cells").rglob("*.json") if not p.name.endswith(".prov.json"))
    assert stored and not list((out / "cells").rglob("*.prov.json"))      # copied, none ran
    md, table = report_md(out)
    assert table["verdict"].notna().all() and len(table) == len(read_study(REPO / "configs" / claims).claims)


def test_a_missing_cells_from_store_is_one_line(tmp_path, capsys):
    assert replicate_main(["--claims", str(TOY), "--out", str(tmp_path / "o"),
                           "--cells-from", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cells-from" in err[0] and "no such cell store" in err[0]
