"""`adamspike reproduce --quick` end to end: every stage runs, every figure exists."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_reproduce_quick(tmp_path):
    out = tmp_path / "study"
    res = subprocess.run([sys.executable, "-m", "study", "reproduce", "--quick", "--out",
                          str(out)], capture_output=True, text=True, timeout=900)
    stages = json.loads((out / "stages.json").read_text())
    bad = {s["name"]: s["status"] for s in stages if s["status"] != "ok"}
    logs = {n: (out / "logs" / f"{n}.log").read_text()[-2000:] for n in bad}
    assert res.returncode == 0 and not bad, (bad, logs, res.stderr[-3000:])
    figures = sorted((out / "figures").rglob("*.png"))
    assert len(figures) >= 10
    names = {p.stem for p in figures}
    assert {"phase_diagram", "replication", "fig_galton", "fig_update_rms_vs_rho",
            "loss_spikes", "grad_norm", "layer_grad_rms", "r_heatmap", "precursors",
            "theory_fit", "regime_map"} <= names, names
    for png in figures:   # --quick: PNG only
        assert png.stat().st_size > 0 and not png.with_suffix(".pdf").exists(), png
    report = (out / "STUDY.md").read_text()
    assert "Replication table" in report and "| ok |" in report.replace(" ok ", " ok ")
    for section in ("## Regime map", "## Regime overview", "update_rms fit per regime band",
                    "## Regime card"):
        assert section in report, section
    pred = json.loads((out / "predictions.json").read_text())
    assert pred["schema"] == "adamspike.predictions" and pred["validate"]
    assert (out / "analysis" / "report.md").stat().st_size > 0
    # issue 13: the ladder's 70B profile, its figure, the rho-matched toy's section
    assert "ladder" in names
    p70 = json.loads((out / "predictions_70b.json").read_text())["profile"]
    assert p70["source"].startswith("ladder fit") and len(p70["by_depth"]) == 82
    assert "Width/depth ladder" in report and "Rho-matched toy" in report
    # issue 14: the spike-rate GLM, its calibration figure, the pre-registered 70B table
    assert "calibration" in names
    for section in ("## Spike-rate model and the pre-registered 70B predictions",
                    "#### Held-out validation", "### predictions_70b.json",
                    "Scores against the predictions"):
        assert section in report, section
    d70 = json.loads((out / "predictions_70b.json").read_text())
    assert d70["schema_version"] == 3 and len(d70["settings"]) >= 12 and d70["content_sha256"]
    # issue 14: the matched-regime replication (10 paired seeds), the causal replay, controls
    for section in ("## Replication table, matched regime", "Holm-Bonferroni",
                    "## Replication table, toy regime", "## Causal replay of spikes",
                    "## Precursors against controls, alarm lift"):
        assert section in report, section
    rep = (out / "replication_matched" / "replication.csv").read_text()
    assert "seed.lower_eps" in rep and ",10," in rep
    # issue 24: the phase map in the 70B's rho band, its figure and section
    assert "phase_map" in names and "## Phase map: spikes in the 70B's rho band" in report
    assert len((out / "phase_map" / "phase_map.csv").read_text().splitlines()) == 1 + 4


def test_reproduce_refuses_nonempty_out(tmp_path):
    (tmp_path / "keep.txt").write_text("precious")
    res = subprocess.run([sys.executable, "-m", "study", "reproduce", "--quick", "--out",
                          str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 2 and "not empty" in res.stderr
    assert (tmp_path / "keep.txt").read_text() == "precious"


def test_resume_keeps_the_study_folders_scale(tmp_path, capsys):
    """A folder made at one scale is not resumed at another (its finished stages, a reduced
    map or a refitted ladder, would count as the other scale's): exit 2, nothing touched."""
    from study.reproduce import main
    (tmp_path / ".stages").mkdir()
    (tmp_path / ".stages" / "scale").write_text("quick\n")
    (tmp_path / "keep.txt").write_text("precious")
    assert main(["--resume", "--out", str(tmp_path)]) == 2
    assert "holds a study at scale 'quick'" in capsys.readouterr().err
    assert (tmp_path / ".stages" / "scale").read_text() == "quick\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".stages", "keep.txt"]


def test_rerun_sets_an_interrupted_stage_output_aside(tmp_path):
    """A stage whose earlier attempt died mid-way (no .stages mark) left a non-empty
    analysis/ that `analyze --out` would refuse: the rerun moves it to .stale/, keeps it."""
    from study.reproduce import Stage, _set_aside
    (tmp_path / "analysis" / "run").mkdir(parents=True)
    (tmp_path / "analysis" / "run" / "report.md").write_text("half\n")
    st = Stage("analyze", "t", [], fresh=["analysis"])
    _set_aside(st, tmp_path)
    assert not (tmp_path / "analysis").exists()
    assert (tmp_path / ".stale" / "analyze-0" / "analysis" / "run" / "report.md").read_text() == "half\n"
    (tmp_path / "analysis").mkdir()
    _set_aside(st, tmp_path)
    assert (tmp_path / ".stale" / "analyze-1" / "analysis").is_dir()
    _set_aside(st, tmp_path)                  # nothing left: nothing moved
    assert not (tmp_path / ".stale" / "analyze-2").exists()


def test_scheduler_gives_a_free_slot_to_the_first_ready_stage(tmp_path, monkeypatch):
    """A stage that becomes ready (its `needs` done) takes the next free slot before the
    stages after it in plan order, instead of queueing behind every stage ready earlier;
    a resumed stage finishes in place and frees its dependants in the same pass."""
    import threading
    import time as _time

    from study import reproduce

    started, lock = [], threading.Lock()
    cost = {"long": 0.3, "needs_long": 0.05}

    def fake_run(st, out, env):
        with lock:
            started.append(st.name)
        _time.sleep(cost.get(st.name, 0.1))
        return {"name": st.name, "title": st.title, "status": "ok", "returncode": 0,
                "seconds": 0.0, "log": "", "missing_outputs": [], "argv": st.argv}

    monkeypatch.setattr(reproduce, "_run_stage", fake_run)
    plan = [reproduce.Stage("long", "t", []), reproduce.Stage("needs_long", "t", [], needs=["long"]),
            *[reproduce.Stage(f"short{i}", "t", []) for i in range(6)]]
    marks = tmp_path / ".stages"
    marks.mkdir()
    res = reproduce._schedule(plan, tmp_path, {}, marks, resume=False, jobs=2)
    assert all(r["status"] == "ok" for r in res)
    # long (0.3 s) ends while short0..short2 ran in the other slot: needs_long is next
    assert started.index("needs_long") < started.index("short4"), started

    for m in marks.iterdir():   # resume with only `long` marked done: its dependant runs
        if m.name != "long.json":
            m.unlink()
    started.clear()
    res = reproduce._schedule(plan[:2], tmp_path, {}, marks, resume=True, jobs=2)
    assert [r["status"] for r in res] == ["ok", "ok"] and started == ["needs_long"]


def test_the_study_is_data_and_its_scales_merge_their_values(tmp_path):
    """configs/study.toml is the plan (`--full`): the standard scale and --quick are the same
    stages in the same order, minus those they skip, with their values merged in; a skipped
    stage drops out of the others' needs / after and run lists; sizes become flags. The
    standard and quick scales read the multi-hour measurements from the shipped fit."""
    from adamspike import package_data
    from study.reproduce import load_study, scale_note, stages
    full, quick = stages(tmp_path, "full"), stages(tmp_path, "quick", jobs=3)
    standard = stages(tmp_path)
    names = [s.name for s in full]
    assert names == list(load_study(scale="full")) and names[0] == "theory"
    skipped = set(names) - {s.name for s in quick}
    assert skipped == {"llama_stable", "matched_toy_ge", "matched_toy_ge_1e8", "package_data",
                       "phase_map_w64", "spike_rate_mechanism", "phase_map_science4", "phase_map_science4_train", "phase_map_science4_heldout",
                       "phase_map_science4_heldout_batch", "phase_map_science4_heldout_init",
                       "phase_map_science4_matched", "phase_map_science4_matched_v4"}
    assert [s.name for s in quick] == [n for n in names if n not in skipped]
    assert set(names) - {s.name for s in standard} == {
        "phase_map_w64", "package_data",
        "phase_map_science4", "phase_map_science4_train", "phase_map_science4_heldout",
        "phase_map_science4_heldout_batch", "phase_map_science4_heldout_init",
        "phase_map_science4_matched", "phase_map_science4_matched_v4"}
    shipped = str(package_data.profile_dir("llama2-70b"))
    f, q, d = ({s.name: s for s in plan} for plan in (full, quick, standard))
    # quick: the shipped mechanism model; standard: the model re-derived from the shipped maps
    assert f"{shipped}/spike_rate_model.json" in q["predict_70b"].argv
    assert q["predict_70b"].needs == ["sweep", "ladder", "batch_sharpness"]
    mech = d["spike_rate_mechanism"]
    assert [mech.argv[i + 1] for i, a in enumerate(mech.argv) if a == "--map"] == [
        f"{shipped}/{rel}" for rel in package_data.PHASE_MAPS] and mech.needs == []
    rm = d["predict_70b"].argv.index("--rate-model")
    assert d["predict_70b"].argv[rm + 1] == str(tmp_path / "spike_rate_mechanism" / "model.json")
    assert d["predict_70b"].needs == ["sweep", "ladder", "spike_rate_mechanism", "batch_sharpness"]
    for plan in (q, d):      # the shipped cells refitted
        assert plan["ladder"].argv[-2:] == ["--cells-from", f"{shipped}/ladder"]
        # the batch-sharpness reading summarized again from the shipped rung-seed cells
        assert plan["batch_sharpness"].argv[-2:] == [
            "--cells-from", f"{shipped}/{package_data.BATCH_SHARPNESS_CELLS}"]
        bs = plan["predict_70b"].argv.index("--batch-sharpness")
        assert plan["predict_70b"].argv[bs + 1] == str(tmp_path / "batch_sharpness")
    assert "--cells-from" not in f["batch_sharpness"].argv
    assert "--cells-from" not in f["ladder"].argv and shipped not in " ".join(f["predict_70b"].argv)
    # the claims replications: the standard and quick studies copy the shipped cells;
    # --full runs them
    for stage in ("replication_phase", "replication_matched"):
        for plan in (d, q):
            assert plan[stage].argv[-2:] == ["--cells-from",
                                             f"{shipped}/{package_data.CLAIMS_CELLS}"]
        assert "--cells-from" not in f[stage].argv
    # --full ships what those stages and science4 wrote: only once they have finished
    assert {"predict_70b", "replication_phase", "replication_matched",
            "science4"} <= set(f["package_data"].needs)
    # the reduced map's explicit sizes (the module knows no scale); --full: the file as written
    assert "map.seeds=4" in d["phase_map"].argv and "--set" not in f["phase_map"].argv
    assert all("quick" not in a for plan in (f, q, d) for s in plan.values() for a in s.argv
               if not a.startswith(str(tmp_path)))
    # Science 4: the full study computes its cells and map; the others read the shipped ones
    assert "--compute" in f["science4"].argv and f["science4"].needs == [
        "phase_map_science4", "phase_map_science4_train", "phase_map_science4_heldout",
        "phase_map_science4_heldout_batch", "phase_map_science4_heldout_init",
        "phase_map_science4_matched", "phase_map_science4_matched_v4"]
    assert "--compute" not in q["science4"].argv and q["science4"].needs == []
    note = scale_note(standard, "standard")
    assert "`ladder`, `batch_sharpness`, `spike_rate_mechanism`, `replication_phase`, " \
        "`replication_matched`." in note and "Left out at this scale: `phase_map_w64`" in note
    assert scale_note(full, "full") == ""
    assert f["mlp"].argv[-2:] == ["--steps", "20000"] and q["mlp"].argv[-2:] == ["--steps", "4000"]
    assert "--torch-spikes" in f["replay"].argv and "--torch-spikes" not in q["replay"].argv
    assert q["replay"].argv[-2:] == ["--train.num_steps", "400"] and "--max-spikes" in q["replay"].argv
    assert "120 steps" in q["matched_toy"].title and "1000 steps" in f["matched_toy"].title
    assert str(tmp_path / "runs" / "llama_stable") in f["spike_rate"].argv
    assert str(tmp_path / "runs" / "llama_stable") not in q["spike_rate"].argv
    assert "llama_stable" not in q["spike_rate"].after
    assert not skipped & set(q["matched_report"].needs)
    assert f["llama_spike"].outputs == ["runs/llama_spike/run.json"]
    assert q["figures"].argv[q["figures"].argv.index("--jobs") + 1] == "3"
    assert all("{" not in a for s in full + quick for a in s.argv), "placeholder left"


def test_a_bad_study_file_names_the_key(tmp_path):
    from adamspike.config import ConfigError
    from study.reproduce import main, stages
    bad = tmp_path / "s.toml"
    bad.write_text('[stages.a]\nargs = ["theory"]\nneeds = ["nope"]\n')
    with pytest.raises(ConfigError, match=r"stages.a.needs: unknown stage\(s\) \['nope'\]"):
        stages(tmp_path, "full", study=bad)
    bad.write_text('[stages.a]\nargs = ["theory"]\nquick.steps = 3\n')
    with pytest.raises(ConfigError, match=r"stages.a.quick: unknown key\(s\) \['steps'\]"):
        stages(tmp_path, "quick", study=bad)
    with pytest.raises(ConfigError, match="study scale 'huge'"):
        stages(tmp_path, "huge", study=bad)
    assert main(["--study", str(bad), "--quick", "--out", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()
