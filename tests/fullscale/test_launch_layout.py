"""The Megatron layout from the memory estimate (fullscale.model_info.choose_megatron_layout):
upstream's LLaMA2-70B layout (MindSpeed-LLM pretrain_llama2_70b_ptd.sh at 251f267c: TP8 PP4,
5 layers per virtual pipeline stage, no recompute) on 128 x 8 910B where it fits; a card
too small for it forces more PP / recompute; `model info --cluster` says the same as
`launch`; the generated flags parse against each stack's vendored option list."""

import json
from pathlib import Path

import pytest

from adamspike.config import ConfigError
from adamspike.llama import preset
from fullscale.launch import OPTIONS_FILE, STACKS, launch_main
from fullscale.model_info import (choose_megatron_layout, layer_microbatches_in_flight,
                                  megatron_cost, megatron_memory)
from study.cli import main as adamspike
from tests.fullscale.test_launch_mindspeed import _cluster, _run_script

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "configs" / "llama2-70b.toml"
CLUSTER = ROOT / "configs" / "cluster-128x8.toml"
C70 = preset("llama2-70b")
KW = dict(world_size=1024, seq_len=4096, micro_batch=1, global_batch=1024)


def _launch(tmp_path, name, *extra):
    out = tmp_path / name
    assert launch_main(["--config", str(BASE), "--cluster", str(CLUSTER), "--master-addr", "n0",
                        "--out", str(out), *extra]) == 0
    return json.loads((out / "launch.json").read_text()), out / "train_mindspeed.sh"


def test_70b_on_128x8_gets_upstreams_layout_and_it_fits():
    ch = choose_megatron_layout(C70, **KW)
    assert (ch["tp"], ch["pp"], ch["vpp_layers"], ch["recompute"]) == (8, 4, 5, "none")
    assert ch["chosen_by"] == "upstream" and ch["fits"]
    # fits 64 GB less 15 % headroom; the interleaved first stage holds 19 chunk-micro-batches
    # of 5 layers (Megatron's warm-up 2 (PP-1) + (chunks-1) PP, + 1)
    assert ch["memory"]["total"] <= 0.85 * 64e9 == ch["usable_bytes"]
    assert layer_microbatches_in_flight(4, 32, 0, 20, 5) == 19 * 5
    assert layer_microbatches_in_flight(4, 32, 0, 20, 0) == 4 * 20
    assert layer_microbatches_in_flight(4, 2, 0, 20, 5) == 2 * 4 * 5    # capped at m x chunks
    # the former fixed TP8 PP8 + full recompute used 8.6 of 64 GB: no recompute is needed
    assert megatron_memory(C70, sharding="megatron:tp8pp8", recompute="full", **KW)["total"] < 10e9
    none = megatron_memory(C70, sharding="megatron:tp8pp4v5", recompute="none", **KW)
    sel = megatron_memory(C70, sharding="megatron:tp8pp4v5", recompute="selective", **KW)
    full = megatron_memory(C70, sharding="megatron:tp8pp4v5", recompute="full", **KW)
    assert full["total"] < sel["total"] < none["total"]
    # interleaving: the bubble (PP-1)/m shrinks by the 4 chunks per stage
    c = megatron_cost(C70, sharding="megatron:tp8pp4v5", **KW)
    assert c["vpp_layers"] == 5 and c["pipeline_bubble_s"] == pytest.approx(c["compute_s"] * 3 / 32 / 4)


def test_a_card_too_small_forces_more_pp_or_recompute():
    small = choose_megatron_layout(C70, device_memory_gb=24, **KW)
    assert small["fits"] and small["chosen_by"] == "smallest fitting"
    assert (small["sharding"], small["recompute"]) == ("megatron:tp8pp4v5", "full")
    assert small["memory"]["total"] <= 0.85 * 24e9
    # each candidate tried before it did not fit; none without recompute fits 20.4 GB
    assert all(t["total_gb"] > 0.85 * 24 for t in small["tried"][:-1])
    assert not any(t["recompute"] == "none" and t["total_gb"] <= 0.85 * 24 for t in small["tried"])
    tiny = choose_megatron_layout(C70, device_memory_gb=2, **KW)
    assert not tiny["fits"] and tiny["recompute"] == "full" and tiny["chosen_by"] == "none fits"
    # upstream's layout is kept only where it fits; fixed TP / PP are kept
    fixed = choose_megatron_layout(C70, tp=8, pp=8, **KW)
    assert (fixed["tp"], fixed["pp"], fixed["vpp_layers"], fixed["recompute"]) == (8, 8, 5, "none")
    # a model without an upstream layout on one node: TP 1 (85 GB) does not fit, TP 2 does
    ch = choose_megatron_layout(preset("llama2-7b"), **{**KW, "world_size": 8, "global_batch": 8})
    assert (ch["sharding"], ch["recompute"], ch["chosen_by"]) == ("megatron:tp2pp1", "none", "smallest fitting")
    assert [t["sharding"] for t in ch["tried"]] == ["megatron:tp1pp1", "megatron:tp2pp1"]
    with pytest.raises(ConfigError, match="needs PP > 2"):
        megatron_memory(C70, sharding="megatron:tp8pp2v5", **KW)


def test_model_info_honours_cluster_and_recompute(capsys):
    base = ["model", "info", "--config", str(BASE), "--cluster", str(CLUSTER), "--no-meta-check"]
    assert adamspike(base + ["--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["world_size"] == 1024 and info["sharding"] == "megatron:tp8pp4v5"
    assert info["recompute"] == "none" and info["memory_bytes"]["fits"]
    assert info["cost"]["vpp_layers"] == 5 and info["layout_choice"]["chosen_by"] == "upstream"
    assert adamspike(base) == 0
    text = capsys.readouterr().out
    assert "world 1024, megatron:tp8pp4v5" in text and "recompute none, 5 layers per virtual" in text
    assert "upstream's layout" in text and "less 15% headroom; fits" in text
    # a smaller card: recompute / more PP, still fitting
    assert adamspike(base + ["--json", "--device-memory-gb", "24"]) == 0
    small = json.loads(capsys.readouterr().out)
    assert small["memory_bytes"]["fits"]
    assert small["recompute"] != "none" or small["cost"]["pp"] > 4
    # an explicit layout and recompute are estimated as given
    assert adamspike(base + ["--json", "--sharding", "megatron:tp8pp8", "--recompute", "full"]) == 0
    fixed = json.loads(capsys.readouterr().out)
    assert fixed["sharding"] == "megatron:tp8pp8" and fixed["recompute"] == "full"
    assert "layout_choice" not in fixed and fixed["memory_bytes"]["total"] < 10e9
    # a named interleaving is kept under --recompute auto
    assert adamspike(base + ["--json", "--sharding", "megatron:tp8pp4v2", "--recompute", "auto"]) == 0
    kept = json.loads(capsys.readouterr().out)
    assert kept["sharding"] == "megatron:tp8pp4v2" and kept["recompute"] == "none"
    assert adamspike(base + ["--sharding", "megatron:tp8pp2v5"]) == 2
    assert "needs PP > 2" in capsys.readouterr().err
    assert adamspike(base + ["--memory-headroom", "1.5"]) == 2
    assert "--memory-headroom" in capsys.readouterr().err


def _flags(argv):
    return [a for a in argv if a.startswith("--")]


@pytest.mark.parametrize("extra, vpp, recompute", [
    ([], "5", []),
    (["--recompute", "full", "--pp", "4"], "5",
     ["--recompute-granularity", "--recompute-method", "--recompute-num-layers"]),
    (["--recompute", "selective", "--pp", "8"], "5", ["--recompute-granularity"]),
])
def test_layout_flags_parse_against_every_stack(tmp_path, extra, vpp, recompute):
    vendored = json.loads(OPTIONS_FILE.read_text())
    out = tmp_path / "l"
    assert launch_main(["--config", str(BASE), "--cluster", str(_cluster(tmp_path)), "--master-addr", "n0",
                        "--out", str(out), *extra]) == 0
    info = json.loads((out / "launch.json").read_text())
    assert info["megatron_layout"]["fits"] and info["megatron_vpp_layers"] == int(vpp)
    for stack in STACKS:
        code, argv, err = _run_script(out / "train_mindspeed.sh", tmp_path, MEGATRON_STACK=stack)
        assert code == 0, err
        flags = _flags(argv)
        assert not sorted(set(flags) - set(vendored["stacks"][stack]["options"])), stack
        assert argv[argv.index("--num-layers-per-virtual-pipeline-stage") + 1] == vpp
        assert [f for f in flags if f.startswith("--recompute")] == recompute
        if "selective" in extra:
            assert argv[argv.index("--recompute-granularity") + 1] == "selective"
            assert argv[argv.index("--pipeline-model-parallel-size") + 1] == "8"


def test_launch_on_a_smaller_card_recomputes_and_says_so(tmp_path, capsys):
    info, script = _launch(tmp_path, "small", "--device-memory-gb", "24")
    assert (info["megatron_tp"], info["megatron_pp"], info["megatron_vpp_layers"]) == (8, 4, 5)
    assert info["megatron_recompute"] == "full" and info["megatron_layout"]["chosen_by"] == "smallest fitting"
    text = script.read_text()
    assert "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1" in text
    assert "# Megatron layout: TP 8 x PP 4, 5 layers per virtual pipeline stage, recompute full" in text
    assert "differs from upstream's megatron:tp8pp4v5 without recompute: its estimate 37.7 GB does not fit" in text
    info, script = _launch(tmp_path, "tiny", "--device-memory-gb", "2")
    assert not info["megatron_layout"]["fits"]
    assert "no TP x PP fits the estimate even with full recompute" in capsys.readouterr().err
    # model info --cluster reads the same card size from the cluster config
    cluster = tmp_path / "c.toml"
    cluster.write_text(CLUSTER.read_text().replace("device_memory_gb = 64.0", "device_memory_gb = 24.0"))
    assert adamspike(["model", "info", "--config", str(BASE), "--cluster", str(cluster), "--no-meta-check",
                      "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sharding"] == "megatron:tp8pp4v5" and out["recompute"] == "full"
