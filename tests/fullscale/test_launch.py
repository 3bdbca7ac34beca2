"""adamspike launch / plan: scripts for 128 x 8 NPUs, MindSpeed equivalent, plan from predictions."""

from __future__ import annotations

import json
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest

from adamspike.config import load_config
from adamspike.predictions import AlarmRule, Predictions, save_predictions
from adamspike.train_config import RunConfig
from fullscale.launch import dump_toml, launch_main, plan_main

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "configs" / "llama2-70b.toml"
CLUSTER = ROOT / "configs" / "cluster-128x8.toml"


def bash_n(path: Path) -> None:
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _flags(script: str) -> dict[str, str]:
    """`--flag value` pairs of a script's command lines (value '' for bare flags)."""
    toks = shlex.split(script.replace("\\\n", " "), comments=True)
    out = {}
    for i, t in enumerate(toks):
        if t.startswith("--"):
            nxt = toks[i + 1] if i + 1 < len(toks) else ""
            out[t] = "" if nxt.startswith("--") else nxt
    return out


def test_launch_128x8_npu_scripts(tmp_path, capsys):
    out = tmp_path / "launch"
    assert launch_main(["--config", str(BASE), "--cluster", str(CLUSTER), "--master-addr", "node-000",
                        "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["launch.json", "run.toml", "train_mindspeed.sh", "train_torchrun.sh"]
    tr = (out / "train_torchrun.sh").read_text()
    for script in ("train_torchrun.sh", "train_mindspeed.sh"):
        bash_n(out / script)
    assert "--nnodes 128 --nproc-per-node 8 --node-rank \"$NODE_RANK\"" in tr
    assert "-m fullscale.train --config " + str(out / "run.toml") + " --out " + str(out / "run") in tr
    for line in ("source /usr/local/Ascend/ascend-toolkit/set_env.sh", "export HCCL_CONNECT_TIMEOUT=1200",
                 "export HCCL_EXEC_TIMEOUT=1836", "export ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7",
                 "export ASCEND_GLOBAL_LOG_LEVEL=3", "HCCL_IF_IP", 'if [[ -z "$MASTER_ADDR" ]]; then MASTER_ADDR=node-000; fi'):
        assert line in tr, line
    # the copied run config loads and is the base config with dist.device = npu
    run = load_config(RunConfig, out / "run.toml")
    base = load_config(RunConfig, BASE)
    assert run.optim == base.optim and run.train == base.train and run.dist.device == "npu"
    info = json.loads((out / "launch.json").read_text())
    # the layout from the memory estimate: upstream's TP8 PP4, 5 layers per virtual stage, no
    # recompute, which fits 64 GB less 15 % (tests/fullscale/test_launch_layout.py)
    assert info["world_size"] == 1024 and (info["megatron_tp"], info["megatron_pp"]) == (8, 4)
    assert info["megatron_recompute"] == "none" and info["megatron_layout"]["fits"]
    mem = info["estimated_memory_gb_per_card"]          # fullscale.model_info, both engines fit
    assert 12 < mem["fsdp"] < 25 and 30 < mem["megatron"] < 54.4
    assert "exceeds" not in capsys.readouterr().err

    ms = (out / "train_mindspeed.sh").read_text()
    f = _flags(ms)
    assert (f["--adam-beta1"], f["--adam-beta2"], f["--adam-eps"]) == ("0.9", "0.95", "1e-05")
    assert (f["--lr"], f["--min-lr"], f["--lr-warmup-iters"], f["--clip-grad"]) == ("0.00015", "1.5e-05", "2000", "1")
    assert (f["--weight-decay"], f["--global-batch-size"], f["--micro-batch-size"]) == ("0.1", "1024", "1")
    assert (f["--seq-length"], f["--train-iters"], f["--data-path"]) == ("4096", "5000", "/data/llama2/pretrain_text_document")
    assert (f["--tensor-model-parallel-size"], f["--pipeline-model-parallel-size"]) == ("8", "4")
    assert (f["--num-layers"], f["--hidden-size"], f["--ffn-hidden-size"]) == ("80", "8192", "28672")
    assert (f["--num-attention-heads"], f["--num-query-groups"]) == ("64", "8")
    assert "--bf16" in f and "--untie-embeddings-and-output-weights" in f and "--swiglu" in f
    assert "--nnodes 128 --nproc_per_node 8 --node_rank" in ms
    assert "export HCCL_CONNECT_TIMEOUT=1200" in ms


def test_scripts_check_the_node_rank(tmp_path):
    out = tmp_path / "l"
    assert launch_main(["--config", str(BASE), "--cluster", str(CLUSTER), "--master-addr", "h",
                        "--out", str(out), "--engine", "fsdp"]) == 0
    for bad in ("", "128", "x"):
        r = subprocess.run(["bash", str(out / "train_torchrun.sh"), bad], capture_output=True, text=True)
        assert r.returncode == 2 and "NODE_RANK" in r.stderr


def test_cuda_scripts_and_loss_scale_folding(tmp_path):
    out = tmp_path / "c"
    assert launch_main(["--config", str(BASE), "--nodes", "8", "--devices-per-node", "8",
                        "--master-addr", "gpu0", "--device", "cuda", "--out", str(out),
                        "--train.loss_scale", "10", "--mitigation.embed_grad_shrink", "0.1"]) == 0
    tr, ms = (out / "train_torchrun.sh").read_text(), (out / "train_mindspeed.sh").read_text()
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in tr and "HCCL" not in tr and "Ascend" not in tr
    f = _flags(ms)
    assert f["--adam-eps"] == "1e-06" and f["--clip-grad"] == "0.1"      # eps / s, clip / s
    assert "NOTE: mitigation.embed_grad_shrink = 0.1" in ms and "no Megatron flag" in ms
    assert load_config(RunConfig, out / "run.toml").train.loss_scale == 10.0


@pytest.mark.parametrize("args, message", [
    (["--nodes", "0"], "--nodes"),
    (["--nodes", "3"], "3 x 8 = 24 does not divide train.global_batch_size = 1024"),
    (["--train.micro_batch_size", "3"], "train.micro_batch_size"),
    (["--tp", "3"], "--tp 3 must divide num_heads 64"),
    (["--pp", "7"], "--pp 7 must divide num_layers 80"),
    (["--nodes", "4", "--tp", "8", "--pp", "8"], "--tp x --pp = 64 must divide the world size 32"),
    (["--optim.eps", "-1"], "optim.eps"),
    (["--master-port", "70000"], "--master-port"),
])
def test_bad_launch_arguments_are_named(tmp_path, capsys, args, message):
    out = tmp_path / "o"
    argv = ["--config", str(BASE), "--cluster", str(CLUSTER), "--master-addr", "h", "--out", str(out)]
    assert launch_main(argv + args) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.iterdir())        # nothing half-written


def test_launch_never_overwrites_and_needs_a_master(tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert launch_main(["--config", str(BASE), "--cluster", str(CLUSTER), "--master-addr", "h",
                        "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    assert launch_main(["--config", str(BASE), "--cluster", str(CLUSTER), "--out", str(tmp_path / "p")]) == 2
    assert "--master-addr: required" in capsys.readouterr().err


def _predictions(path: Path) -> Path:
    def over(b2, eps, lr, gbs):
        return {"optim.b1": 0.9, "optim.b2": b2, "optim.eps": eps, "optim.lr": lr,
                "train.global_batch_size": gbs}

    settings = [
        {"id": "eps1e-05-b2_0.95", "overrides": over(0.95, 1e-5, 1.5e-4, 1024), "risk": 0.8,
         "risk_label": "high", "rank": 3},
        {"id": "eps1e-08-b2_0.95", "overrides": over(0.95, 1e-8, 1.5e-4, 1024), "risk": 0.1,
         "risk_label": "low", "rank": 1},
        {"id": "eps1e-06-b2_0.9", "overrides": over(0.9, 1e-6, 1e-4, 2048), "risk": 0.2,
         "risk_label": "low", "rank": 2},
    ]
    rule = AlarmRule(id="rms_t_shallow", metric="rms_t", depths=(-1, 1), threshold=2.0)
    save_predictions(Predictions(settings=settings, alarm_rules=[rule],
                                 validate=["eps1e-08-b2_0.95", "eps1e-06-b2_0.9", "eps1e-05-b2_0.95"]), path)
    return path


def test_plan_from_predictions(tmp_path, capsys):
    pred = _predictions(tmp_path / "predictions.json")
    out = tmp_path / "plan"
    assert plan_main(["--predictions", str(pred), "--base", str(BASE), "--cluster", str(CLUSTER),
                      "--master-addr", "node-000", "--out", str(out), "--top", "2"]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert [s["id"] for s in plan["settings"]] == ["eps1e-08-b2_0.95", "eps1e-06-b2_0.9"]
    assert (out / "predictions.json").read_bytes() == pred.read_bytes()
    for sid, (b2, eps, lr, gbs) in {"eps1e-08-b2_0.95": (0.95, 1e-8, 1.5e-4, 1024),
                                    "eps1e-06-b2_0.9": (0.9, 1e-6, 1e-4, 2048)}.items():
        d = out / sid
        run = load_config(RunConfig, d / "run.toml")
        assert (run.optim.b1, run.optim.b2, run.optim.eps, run.optim.lr) == (0.9, b2, eps, lr)
        assert run.optim.min_lr == pytest.approx(lr / 10)          # keeps the base's 10% floor
        assert run.train.global_batch_size == gbs
        assert run.alarms.predictions == str(out / "predictions.json")
        for script in ("train_torchrun.sh", "train_mindspeed.sh"):
            bash_n(d / script)
        tr = (d / "train_torchrun.sh").read_text()
        assert f"--config {d / 'run.toml'} --out {d / 'run'}" in tr      # final paths, not temp
        ms = (d / "train_mindspeed.sh").read_text()
        f = _flags(ms)
        assert (float(f["--adam-beta2"]), float(f["--adam-eps"]), float(f["--lr"])) == (b2, eps, lr)
        # the probe evaluates the alarm rules online; the analyze hints score them
        assert f'ADAMSPIKE_PROBE_PREDICTIONS={out / "predictions.json"}; fi' in ms
        hints = [l for l in ms.splitlines() if l.startswith("#   adamspike analyze")]
        assert len(hints) == 2 and all(f"--predictions {out / 'predictions.json'}" in h for h in hints)
        assert int(f["--global-batch-size"]) == gbs
    assert not (out / "eps1e-05-b2_0.95").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]    # no temp dirs left
    # again into the same directory: refused, nothing touched
    before = (out / "plan.json").read_text()
    assert plan_main(["--predictions", str(pred), "--base", str(BASE), "--master-addr", "h",
                      "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and (out / "plan.json").read_text() == before


def test_plan_errors(tmp_path, capsys):
    pred = _predictions(tmp_path / "predictions.json")
    argv = ["--base", str(BASE), "--cluster", str(CLUSTER), "--master-addr", "h"]
    # 2048 is fine on 1024 cards, but 1536 cards divide neither setting's batch
    assert plan_main(["--predictions", str(pred), "--out", str(tmp_path / "a"), "--nodes", "192"] + argv) == 2
    assert "setting 'eps1e-08-b2_0.95'" in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert plan_main(["--predictions", str(tmp_path / "nope.json"), "--out", str(tmp_path / "b")] + argv) == 2
    assert "not found" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('{"schema": "other"}')
    assert plan_main(["--predictions", str(tmp_path / "bad.json"), "--out", str(tmp_path / "c")] + argv) == 2
    assert "schema" in capsys.readouterr().err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_dump_toml_round_trip():
    d = {"a": 1, "s": 'x"y', "t": {"f": 1e-8, "l": [1, 2], "b": True, "n": None}}
    assert tomllib.loads(dump_toml(d)) == {"a": 1, "s": 'x"y', "t": {"f": 1e-8, "l": [1, 2], "b": True}}


def test_torchrun_script_runs_with_the_right_argv(tmp_path):
    """Execute the generated script with a stand-in torchrun that records its arguments."""
    out = tmp_path / "cpu"
    assert launch_main(["--config", str(ROOT / "configs" / "tiny.toml"), "--nodes", "2",
                        "--devices-per-node", "2", "--device", "cpu", "--master-addr", "h0",
                        "--out", str(out), "--engine", "fsdp"]) == 0
    fake = tmp_path / "fake_torchrun"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "TORCHRUN": str(fake), "ADAMSPIKE_HOME": str(tmp_path)}

    def argv(rank, **extra):
        r = subprocess.run(["bash", str(out / "train_torchrun.sh"), rank], capture_output=True,
                           text=True, env={**env, **extra})
        assert r.returncode == 0, r.stderr
        return r.stdout.split("\n")[:-1]

    a = argv("1")
    assert a == ["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", "1", "--master-addr", "h0",
                 "--master-port", "29500", "--max-restarts", "0", "-m", "fullscale.train",
                 "--config", str(out / "run.toml"), "--out", str(out / "run")]
    assert argv("0", RESUME="1", MASTER_ADDR="other")[-1] == "--resume"
    assert "other" in argv("0", MASTER_ADDR="other")
    # logs beside the scripts; the run directory itself is left for the trainer to create
    assert (out / "logs" / "node1.log").read_text().startswith("--nnodes")
    assert not (out / "run").exists()


def test_launch_warns_when_the_memory_estimate_does_not_fit(tmp_path, capsys):
    assert launch_main(["--config", str(BASE), "--cluster", str(CLUSTER), "--nodes", "1",
                        "--out", str(tmp_path / "one"), "--engine", "fsdp",
                        "--train.global_batch_size", "8"]) == 0
    err = capsys.readouterr().err
    assert "fsdp: estimated 158 GB per card exceeds the 910B's 64 GB" in err


def test_plan_says_when_the_model_cannot_tell_settings_apart(tmp_path, capsys):
    """Two planned settings with the same model features (batch only differs, not a model
    feature): plan warns and records them in plan.json (adamspike.predictions
    .indistinguishable)."""
    feats = {"log10_rho_shallow": 0.0, "log10_one_minus_b2": -1.3, "log10_lr_over_eps": 1.2}
    names = list(feats)

    def s(sid, gbs, rho=0.0):
        return {"id": sid, "overrides": {"optim.b1": 0.9, "optim.b2": 0.95, "optim.eps": 1e-5,
                                         "optim.lr": 1.5e-4, "train.global_batch_size": gbs},
                "features": {**feats, "log10_rho_shallow": rho}, "model_features": names,
                "rate_per_1k": 0.1, "rate_ci": [0.05, 0.2]}

    path = tmp_path / "p.json"
    save_predictions(Predictions(settings=[s("a", 1024), s("b", 2048), s("c", 1024, 1.0)],
                                 validate=["a", "b", "c"]), path)
    out = tmp_path / "plan"
    assert plan_main(["--predictions", str(path), "--base", str(BASE), "--cluster",
                      str(CLUSTER), "--master-addr", "h", "--out", str(out)]) == 0
    cap = capsys.readouterr()
    assert "settings a, b have the same model features" in cap.err
    assert "2 of them indistinguishable for the model (a = b)" in cap.out
    plan = json.loads((out / "plan.json").read_text())
    assert plan["indistinguishable"] == [["a", "b"]]
    # the one predictor's label (issue 39 item 1): the model and what it cannot see
    assert "model: regime GLM" in cap.out and plan["model"].startswith("regime GLM")
    assert plan["not_in_model"] == ["optim.b1", "train.global_batch_size"]
