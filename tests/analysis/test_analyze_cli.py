"""`adamspike analyze` end to end, and its exit-2 errors for bad input."""

import json
import shutil

import pytest

from adamspike.predictions import AlarmRule, Predictions, save_predictions
from adamspike.rundir import RunWriter
from analysis.cli import main


def test_analyze_writes_report_and_tables_the_figures_draw(synthetic_run, tmp_path, capsys):
    """analyze -> tables (spikes, precursors, fits, regime cards); figures -> drawn from them."""
    from figures.cli import generate

    pred = Predictions(alarm_rules=[AlarmRule(id="rms_t_shallow", metric="rms_t",
                                              depths=(-1, 1), threshold=2.0,
                                              expected_lead_steps=(1, 8))])
    save_predictions(pred, tmp_path / "p.json")
    out = tmp_path / "out"
    assert main([str(synthetic_run), "--predictions", str(tmp_path / "p.json"),
                 "--out", str(out)]) == 0
    report = (out / "synthetic" / "report.md").read_text()
    assert "**2 spike(s)**, 2 recovered" in report
    assert "| 300 | 300 |" in report and "| 450 | 450 |" in report
    assert "rms_t: shallow led 2/2 (median 10 steps), deep 0/2" in report
    assert "| rms_t_shallow | 8 | 2 | 2 | 1 | 2 | 2 | 1 |" in report  # precision 1, recall 1
    assert "update_rms vs theory" in report
    assert not (out / "synthetic" / "figures").exists()        # analysis draws nothing
    for table in ("spikes", "grad_norm_spikes", "precursor_trajectories", "precursor_leads",
                  "update_rms_fit_rows", "regime_trajectory"):
        assert (out / "synthetic" / f"{table}.csv").is_file(), table
    files, outcomes = generate([synthetic_run], tmp_path / "figs", theory=False, analysis=out)
    assert {o.status for o in outcomes if o.target} == {"ok"}, outcomes
    names = {f.name for f in files}
    for stem in ("loss_spikes", "grad_norm", "layer_grad_rms", "r_heatmap", "precursors",
                 "theory_fit", "regime_map"):
        assert f"{stem}.png" in names and f"{stem}.pdf" in names
    assert all(f.stat().st_size > 1000 for f in files)
    summary = json.loads((out / "synthetic" / "summary.json").read_text())
    assert summary["spike_starts"] == [300, 450]
    assert abs(summary["update_fit"]["eps_scale"] - 1) < 0.05  # the generator's truth is 1
    index = (out / "report.md").read_text()
    assert "[synthetic](synthetic/report.md)" in index and "## Run `synthetic`" in index


def _megatron_line(it, loss):
    return (f" [2024-06-01 12:00:{it % 60:02d}] iteration {it:8d}/{1000:8d} | consumed samples: "
            f"{it * 8:12d} | elapsed time per iteration (ms): 1234.5 | learning rate: "
            f"1.000000E-04 | global batch size:     8 | lm loss: {loss:.6E} | loss scale: 1.0 | "
            f"grad norm: {0.5:.3f} | number of skipped iterations:   0 | "
            f"number of nan iterations:   0 |")


def test_analyze_megatron_log(tmp_path, capsys):
    lines = [_megatron_line(i, 3.0 + (4.0 if i == 150 else 0.0)) for i in range(1, 201)]
    lines.append(_megatron_line(201, 3.0)[:70])
    log = tmp_path / "train.log"
    log.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    assert main(["--log", str(log), "--seq-len", "4096", "--clip", "1.0", "--b1", "0.9",
                 "--b2", "0.95", "--eps", "1e-5", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "200 steps, 1 malformed line(s) at 201" in err
    report = (out / "train.log.run" / "report.md").read_text()
    assert "**1 malformed** (not imported; line numbers: 201)" in report
    assert "**1 spike(s)**" in report and "| 150 | 150 |" in report
    assert "no per-layer telemetry" in report


def test_a_second_analyze_without_out_takes_the_next_free_folder(tmp_path, monkeypatch, capsys):
    """Without --out the report goes to analysis_out, then analysis_out-2 (a repeated
    `adamspike analyze --log LOG` failed on its own earlier output); the first is left as
    it was, and an explicit --out that exists is still refused."""
    log = tmp_path / "train.log"
    log.write_text("\n".join(_megatron_line(i, 3.0) for i in range(1, 61)) + "\n")
    monkeypatch.chdir(tmp_path)
    assert main(["--log", str(log)]) == 0
    first = {p: p.stat().st_mtime_ns for p in (tmp_path / "analysis_out").rglob("*")}
    assert main(["--log", str(log)]) == 0
    assert (tmp_path / "analysis_out-2" / "train.log.run" / "report.md").is_file()
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "analysis_out").rglob("*")} == first
    capsys.readouterr()
    _bad(["--log", str(log), "--out", "analysis_out"], capsys, "nothing was overwritten")


def _bad(argv, capsys, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_bad_inputs_exit_2(synthetic_run, tmp_path, capsys):
    out = ["--out", str(tmp_path / "o")]
    _bad([str(tmp_path / "nope"), *out], capsys, "does not exist")
    (tmp_path / "plain").mkdir()
    _bad([str(tmp_path / "plain"), *out], capsys, "no run.json")
    v2 = tmp_path / "v2"
    shutil.copytree(synthetic_run, v2)
    meta = json.loads((v2 / "run.json").read_text())
    meta["schema_version"] = 99
    (v2 / "run.json").write_text(json.dumps(meta))
    _bad([str(v2), *out], capsys, "schema_version 99 is not supported")
    with RunWriter(tmp_path / "empty", backend="torch", config={}):
        pass
    _bad([str(tmp_path / "empty"), *out], capsys, "no steps rows")
    log = tmp_path / "chatter.log"
    log.write_text("> building dataset\nusing world size: 8\n")
    _bad(["--log", str(log), *out], capsys, "no parseable iteration lines")
    (tmp_path / "p.json").write_text("{not json")
    _bad([str(synthetic_run), "--predictions", str(tmp_path / "p.json"), *out], capsys,
         "invalid JSON")
    _bad([*out], capsys, "no runs given")
    _bad([str(synthetic_run), "--window", "1", *out], capsys, "--window")


def test_jobs_give_the_same_reports_and_reports_link_drawn_figures(synthetic_run, tmp_path):
    """--jobs 2 analyses runs in two processes with the same results as one; the figures
    stage draws from the analysis afterwards, and a report written when the figures lie at
    their conventional path (a study's figures/<run>/) links them."""
    from analysis.report import rebase_links
    from figures.cli import generate

    runs = tmp_path / "runs"
    for name in ("a", "b"):
        shutil.copytree(synthetic_run, runs / name)
    one, two, three = tmp_path / "one", tmp_path / "two", tmp_path / "three"
    assert main([str(runs / "a"), str(runs / "b"), "--out", str(one)]) == 0
    assert main([str(runs / "a"), str(runs / "b"), "--out", str(two), "--jobs", "2"]) == 0
    for name in ("a", "b"):
        s1 = json.loads((one / name / "summary.json").read_text())
        s2 = json.loads((two / name / "summary.json").read_text())
        s1.pop("created", None), s2.pop("created", None)
        assert s1 == s2
        assert "Not drawn yet: `adamspike figures" in (two / name / "report.md").read_text()
        assert "<img" not in (two / name / "report.html").read_text()
    files, outcomes = generate([runs / "a", runs / "b"], tmp_path / "figures", theory=False,
                               analysis=two, jobs=2)
    assert {o.status for o in outcomes if "fig_" in o.module and o.target} <= {"ok", "skipped"}
    assert (tmp_path / "figures" / "a" / "loss_spikes.png").is_file()
    assert (tmp_path / "figures" / "b" / "loss_spikes.pdf").is_file()
    assert 'alt="loss_spikes" src="data:image/png;base64,' in (two / "a" / "report.html").read_text()
    assert main([str(runs / "a"), str(runs / "b"), "--out", str(three)]) == 0
    for name in ("a", "b"):
        report = (three / name / "report.md").read_text()
        assert f"](../../figures/{name}/loss_spikes.png)" in report
        assert (three / name / "../../figures" / name / "loss_spikes.png").is_file()
    index = (three / "report.md").read_text()
    assert "](../figures/a/loss_spikes.png)" in index           # rebased for the index
    assert rebase_links("![f](figures/x.png) [w](https://a.b/c) [h](#top)", "run") == \
        "![f](run/figures/x.png) [w](https://a.b/c) [h](#top)"


def test_a_log_without_a_finite_loss_leaves_no_out(tmp_path, capsys):
    """issue 40, defect 7: the refusal leaves nothing behind (a new --out is removed, an
    empty one emptied again)."""
    log = tmp_path / "nan.log"
    log.write_text("\n".join(_megatron_line(i, float("nan")) for i in range(1, 50)) + "\n")
    for out in (tmp_path / "new", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        rc = main(["--log", str(log), "--seq-len", "4096", "--clip", "1.0", "--out", str(out)])
        err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("adamspike analyze:")]
        assert rc == 2 and len(err) == 1, err
        assert not out.exists() if out.name == "new" else list(out.iterdir()) == []


def test_from_study_follows_each_folder_once(synthetic_run, tmp_path, capsys):
    """A symlink cycle under a study's runs/ (and a second link to the same run) is walked
    once: one run analysed, not 41."""
    from adamspike.rundir import find_runs
    runs = tmp_path / "study" / "runs"
    runs.mkdir(parents=True)
    (runs / "a").symlink_to(synthetic_run, target_is_directory=True)
    (runs / "b").symlink_to(synthetic_run, target_is_directory=True)
    (runs / "loop").mkdir()
    (runs / "loop" / "back").symlink_to(runs, target_is_directory=True)
    (runs / "loop" / "self").symlink_to(runs / "loop", target_is_directory=True)
    assert find_runs(runs) == [runs / "a"]
    out = tmp_path / "out"
    assert main(["--from-study", str(tmp_path / "study"), "--out", str(out)]) == 0
    assert [p.name for p in out.iterdir() if p.is_dir()] == ["a"]


def test_an_unwritable_out_is_one_line(synthetic_run, tmp_path, capsys):
    """A read-only --out (EROFS injected into mkdir with strace: root ignores modes)."""
    import subprocess
    import sys
    from pathlib import Path
    if not shutil.which("strace"):
        pytest.skip("no strace")
    out = tmp_path / "ro" / "out"
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-e", "inject=mkdir,mkdirat:error=EROFS",
                        sys.executable, "-m", "study", "analyze", str(synthetic_run), "--out", str(out)],
                       capture_output=True, text=True, cwd=root, timeout=300,
                       env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "MPLBACKEND": "Agg"})
    if "PTRACE" in r.stderr or "Operation not permitted" in r.stderr and "strace" in r.stderr:
        pytest.skip("ptrace not allowed here")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr and len(lines) == 1 and "Read-only file system" in lines[0], r.stderr
    assert not out.exists()
