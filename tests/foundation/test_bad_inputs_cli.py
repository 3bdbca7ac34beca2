"""Every command answers bad input the same way: exit status 2, exactly one stderr line that
names the problem, no traceback, and nothing already written changes (a sha256 snapshot of
the whole fixture directory, which holds an existing run, analysis report, predictions and
files, is identical before and after every case; a new --out is not created).

The commands run in-process through `study.cli.main` (the real entry point; it returns
the exit status): one process pays the torch / jax imports once.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest

from study.cli import main
from adamspike.predictions import AlarmRule, Predictions, save_predictions

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")
GRID = str(ROOT / "configs" / "sweep_quadratic.toml")


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _megatron_log(path: Path, n: int = 60) -> None:
    lines = [f" iteration {i:8d}/     100 | consumed samples: {16 * i:12d} | elapsed time per "
             f"iteration (ms): 100.0 | learning rate: 1.000000E-04 | global batch size:    16 | "
             f"lm loss: {9.0 + 0.01 * (i % 3):.6E} | loss scale: 1.0 | grad norm: 1.000 | "
             "number of skipped iterations:   0 | number of nan iterations:   0 |"
             for i in range(1, n + 1)]
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad_cli")
    run = d / "run"
    assert main(["simulate", "quadratic", "--steps", "60", "--out", str(run),
                 "--no-progress"]) == 0
    assert main(["analyze", str(run), "--out", str(d / "report")]) == 0
    (d / "afile").write_text("not a directory\n")
    _megatron_log(d / "megatron.log")
    pred = Predictions(settings=[{"id": "a", "overrides": {
                                      "optim.b1": 0.9, "optim.b2": 0.95, "optim.eps": 1e-8,
                                      "optim.lr": 1e-4, "train.global_batch_size": 16}}],
                       alarm_rules=[AlarmRule(id="r", metric="rms_t", threshold=2.0)],
                       validate=["a"])
    save_predictions(pred, d / "good.json")
    good = json.loads((d / "good.json").read_text())

    def variant(name, edit):
        data = copy.deepcopy(good)
        edit(data)
        (d / f"{name}.json").write_text(json.dumps(data))

    variant("b1_string", lambda p: p["settings"][0]["overrides"].__setitem__("optim.b1", "0.9"))
    variant("lr_null", lambda p: p["settings"][0]["overrides"].__setitem__("optim.lr", None))
    variant("consecutive_a", lambda p: p["alarm_rules"][0].__setitem__("consecutive", "a"))
    variant("eps_negative", lambda p: p["settings"][0]["overrides"].__setitem__("optim.eps", -1.0))
    (d / "notjson.json").write_text("{oops")
    (d / "profile.json").write_text(json.dumps({"name": "toy", "num_layers": 2, "eps_ref": 1e-8,
                                                "rho_by_depth": {"-1": 1.0, "0": 2.0, "1": 3.0,
                                                                 "2": 4.0}}))
    return {"dir": d, "run": str(run), "report": str(d / "report"), "file": str(d / "afile"),
            "log": str(d / "megatron.log"), "snapshot": _snapshot(d)}


def _train(w, *extra):
    return ["train", "--config", TINY, "--train.num_steps", "2", *extra]


def _an_log(w, out, *extra):
    return ["analyze", "--log", w["log"], "--out", out, *extra]


def _plan(w, out, pred):
    return ["plan", "--predictions", str(w["dir"] / f"{pred}.json"), "--base", TINY, "--out", out]


# (id, argv(world, new_out), substrings the one stderr line must contain)
CASES = [
    # train
    ("train-out-is-a-file", lambda w, o: _train(w, "--out", w["file"]), ["afile", "is a file"]),
    ("train-out-under-a-file", lambda w, o: _train(w, "--out", w["file"] + "/run"),
     ["afile", "is a file"]),
    ("train-out-existing-run", lambda w, o: _train(w, "--out", w["run"]), ["not empty"]),
    ("train-lr-nan", lambda w, o: _train(w, "--out", o, "--optim.lr", "nan"),
     ["optim.lr", "finite"]),
    ("train-resume-not-a-run", lambda w, o: _train(w, "--out", w["report"], "--resume"),
     ["no run.json"]),
    ("train-faults-poison-one-value", lambda w, o: _train(w, "--out", o,
                                                           "--faults.poison_batches", "5"),
     ["faults.poison_batches", "[from, to]"]),
    ("train-faults-poison-reversed", lambda w, o: _train(w, "--out", o,
                                                          "--faults.poison_batches", "9,3"),
     ["faults.poison_batches", "after"]),
    ("train-faults-nan-grad-step-0", lambda w, o: _train(w, "--out", o,
                                                          "--faults.nan_grad_at_step", "0"),
     ["faults.nan_grad_at_step"]),
    # simulate
    ("simulate-eps-nan", lambda w, o: ["simulate", "quadratic", "--eps", "nan", "--out", o],
     ["optim.eps", "finite"]),
    ("simulate-noise-nan", lambda w, o: ["simulate", "quadratic", "--noise", "nan", "--out", o],
     ["quadratic.noise", "finite"]),
    ("simulate-theta0-inf", lambda w, o: ["simulate", "quadratic", "--theta0", "inf", "--out", o],
     ["quadratic.theta0", "finite"]),
    ("simulate-mlp-loss-scale-nan", lambda w, o: ["simulate", "mlp", "--loss-scale", "nan",
                                                  "--out", o], ["train.loss_scale", "finite"]),
    ("simulate-out-existing-run", lambda w, o: ["simulate", "quadratic", "--out", w["run"]],
     ["exists"]),
    ("simulate-streams-b2-inf", lambda w, o: ["simulate", "streams", "--b2", "inf"],
     ["--b2", "finite"]),
    # sweep
    ("sweep-missing-grid", lambda w, o: ["sweep", "run", "--grid", str(w["dir"] / "nope.toml"),
                                         "--out", o], ["nope.toml"]),
    ("sweep-into-a-run-dir", lambda w, o: ["sweep", "run", "--grid", GRID, "--set", "sweep.seeds=1",
                                           "--out", w["run"]], ["exists and is not an empty directory"]),
    ("sweep-bad-shard", lambda w, o: ["sweep", "run", "--grid", GRID, "--shard", "3/2",
                                      "--out", o], ["shard"]),
    # predict
    ("predict-out-exists", lambda w, o: ["predict", "--profile", "llama2-70b", "--sweep",
                                         w["run"], "--out", str(w["dir"] / "good.json")],
     ["good.json"]),
    ("predict-missing-sweep", lambda w, o: ["predict", "--profile", str(w["dir"] / "profile.json"), "--sweep",
                                            str(w["dir"] / "nosweep"), "--out", o + ".json"],
     ["nosweep"]),
    ("predict-70b-bad-setting", lambda w, o: ["predict", "--profile", "llama2-70b", "--setting",
                                              "optim.eps=abc", "--out", o + ".json"],
     ["optim.eps", "not a number"]),
    ("predict-missing-ladder", lambda w, o: ["predict", "--profile", "llama2-70b", "--ladder",
                                             str(w["dir"] / "noladder"), "--out", o + ".json"],
     ["noladder"]),
    # plan
    ("plan-b1-string", lambda w, o: _plan(w, o, "b1_string"), ["settings[0].overrides.optim.b1", "'0.9'"]),
    ("plan-lr-null", lambda w, o: _plan(w, o, "lr_null"), ["settings[0].overrides", "optim.lr"]),
    ("plan-consecutive-a", lambda w, o: _plan(w, o, "consecutive_a"), ["consecutive", "'a'"]),
    ("plan-eps-negative", lambda w, o: _plan(w, o, "eps_negative"), ["settings[0].overrides", "optim.eps", ">= 0"]),
    ("plan-not-json", lambda w, o: _plan(w, o, "notjson"), ["notjson.json", "JSON"]),
    ("plan-missing-predictions", lambda w, o: _plan(w, o, "absent"), ["absent.json"]),
    # analyze
    ("analyze-k-nan", lambda w, o: ["analyze", w["run"], "--k", "nan", "--out", o], ["--k", "finite"]),
    ("analyze-min-rel-jump-inf", lambda w, o: ["analyze", w["run"], "--min-rel-jump", "inf",
                                               "--out", o], ["--min-rel-jump", "finite"]),
    ("analyze-out-existing-report", lambda w, o: ["analyze", w["run"], "--out", w["report"]],
     ["--out", "not an empty directory"]),
    ("analyze-missing-run", lambda w, o: ["analyze", str(w["dir"] / "norun"), "--out", o],
     ["norun", "does not exist"]),
    ("analyze-log-seq-len-negative", lambda w, o: _an_log(w, o, "--seq-len", "-1"),
     ["--seq-len", ">= 1"]),
    ("analyze-log-b2-above-1", lambda w, o: _an_log(w, o, "--b2", "1.5"), ["--b2", "< 1.0"]),
    ("analyze-log-eps-negative", lambda w, o: _an_log(w, o, "--eps", "-1"), ["--eps", "> 0"]),
    ("analyze-log-lr-inf", lambda w, o: _an_log(w, o, "--lr", "inf"), ["--lr", "finite"]),
    ("analyze-log-clip-nan", lambda w, o: _an_log(w, o, "--clip", "nan"), ["--clip", "finite"]),
    ("analyze-horizon-negative", lambda w, o: _an_log(w, o, "--horizon", "-1"),
     ["--horizon", ">= 1"]),
    ("analyze-precursor-window-negative", lambda w, o: _an_log(w, o, "--precursor-window", "-3"),
     ["--precursor-window", ">= 1"]),
    # data
    ("data-inspect-missing", lambda w, o: ["data", "inspect", str(w["dir"] / "absent_text")],
     ["absent_text"]),
    ("data-convert-not-npy", lambda w, o: ["data", "convert", "--input", w["file"], "--out", o],
     ["--input", "afile", ".npy or .jsonl"]),
    # figures
    ("figures-missing-study", lambda w, o: ["figures", "--from-study", str(w["dir"] / "nostudy"),
                                            "--out", o], ["nostudy"]),
    ("figures-missing-run", lambda w, o: ["figures", str(w["dir"] / "norun"), "--out", o,
                                          "--no-theory"], ["norun"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(world, case, capsys):
    name, argv, needles = case
    new = world["dir"] / f"new-{name}"
    rc = main(argv(world, str(new)))
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert "Traceback" not in err and len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert not new.exists() and not Path(f"{new}.json").exists(), "a failed command wrote"
    assert _snapshot(world["dir"]) == world["snapshot"], "an existing file was changed"


def test_the_table_covers_every_command():
    assert len(CASES) >= 30
    assert {c[0].split("-")[0] for c in CASES} >= {"train", "simulate", "sweep", "predict",
                                                   "plan", "analyze", "data", "figures"}
