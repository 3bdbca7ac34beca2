"""fullscale.model_info: 70B parameter count, FLOPs/token, memory per card, step cost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from adamspike.config import ConfigError
from adamspike.llama import PRESETS, flops_per_token
from fullscale.model_info import (Assumptions, memory_per_card, meta_param_count, model_info,
                                  resolve_config, step_cost)

ROOT = Path(__file__).resolve().parents[2]
N70 = 68_976_648_192
C70 = PRESETS["llama2-70b"]


def test_model_info_70b_json_subprocess():
    r = subprocess.run([sys.executable, "-m", "study", "model", "info", "--config", "llama2-70b",
                        "--world-size", "1024", "--json"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    p = info["params"]
    assert p["total"] == N70 and p["meta_device"] == N70          # specs == torch model on meta
    assert p["embedding"] == p["output"] == 262_144_000 and p["per_block"] == 855_654_400
    # 6 * 68,714,504,192 + 12 * 80 * 8192 * 4096
    assert info["flops_per_token"] == 444_499_279_872 and info["seq_len"] == 4096
    m = info["memory_bytes"]
    assert m["state_sharded"] == pytest.approx(16 * N70 / 1024)   # 1.08 GB / card
    assert m["activations_checkpoints"] == 80 * 4096 * 8192 * 2     # 5.37 GB
    assert 12e9 < m["total"] < 25e9 and m["fits"]
    c = info["cost"]
    assert c["tokens_per_step"] == 1024 * 4096 and c["grad_accum_steps"] == 1
    assert c["compute_s"] == pytest.approx(444_499_279_872 * 1024 * 4096 / (1024 * 313e12 * 0.45))


def test_meta_device_count_matches_specs_for_every_preset():
    for name in ("tiny", "small", "llama2-7b"):
        cfg = PRESETS[name]
        assert meta_param_count(cfg) == model_info(cfg, meta_check=False)["params"]["total"]


def test_memory_layouts_and_sharding():
    kw = dict(world_size=1024, seq_len=4096, micro_batch=1)
    fsdp2 = memory_per_card(C70, **kw)
    assert fsdp2["state_bytes_per_param"] == 16
    assert memory_per_card(C70, **kw, grad_dtype="bf16")["state_bytes_per_param"] == 14
    assert memory_per_card(C70, **kw, layout="megatron")["state_bytes_per_param"] == 16
    mg32 = memory_per_card(C70, **kw, layout="megatron", grad_dtype="fp32")
    assert mg32["state_sharded"] == pytest.approx(18 * N70 / 1024)             # notes: 1.21 GB
    hsdp = memory_per_card(C70, **kw, sharding="hsdp:8")
    assert hsdp["state_sharded"] == pytest.approx(16 * N70 / 8)                 # 138 GB: no fit
    no_ac = memory_per_card(C70, **kw, activation_checkpointing=False)
    assert no_ac["activations_checkpoints"] == 0 and no_ac["activations_blocks"] == 80 * fsdp2["activations_blocks"]
    assert memory_per_card(C70, **kw, prefetch=False)["gathered_block_params"] == 855_654_400 * 2
    two = memory_per_card(C70, world_size=1024, seq_len=4096, micro_batch=2)
    assert two["logits"] == 2 * fsdp2["logits"] and two["state_sharded"] == fsdp2["state_sharded"]


def test_step_cost_volumes_and_bandwidth_domains():
    a = Assumptions(mfu=0.5, peak_flops=300e12, intra_node_gbs=100.0, inter_node_gbs=10.0)
    f = step_cost(C70, world_size=1024, seq_len=4096, micro_batch=1, global_batch=1024, assumptions=a)
    frac = 1023 / 1024
    assert f["all_gather_forward_bytes"] == pytest.approx(2 * N70 * frac)
    assert f["all_gather_backward_bytes"] == pytest.approx(2 * 80 * 855_654_400 * frac)
    assert f["reduce_scatter_bytes"] == pytest.approx(4 * N70 * frac)
    assert f["all_reduce_replicas_bytes"] == 0
    assert f["comm_s"] == pytest.approx(f["comm_bytes"] / 10e9)                 # spans nodes
    h = step_cost(C70, world_size=1024, seq_len=4096, micro_batch=1, global_batch=1024,
                  sharding="hsdp:8", assumptions=a)
    assert (h["shard_group"], h["replicas"]) == (8, 128)
    assert h["all_reduce_replicas_bytes"] == pytest.approx(2 * 127 / 128 * N70 / 8 * 4)
    assert h["reduce_scatter_s"] == pytest.approx(h["reduce_scatter_bytes"] / 100e9)   # in a node
    assert h["all_reduce_replicas_s"] == pytest.approx(h["all_reduce_replicas_bytes"] / 10e9)
    assert h["compute_s"] == f["compute_s"] and h["comm_s"] < f["comm_s"]
    # gradient accumulation multiplies per-micro-step traffic, not compute per token
    g = step_cost(C70, world_size=256, seq_len=4096, micro_batch=1, global_batch=1024, assumptions=a)
    assert g["grad_accum_steps"] == 4 and g["compute_s"] == pytest.approx(4 * f["compute_s"])
    assert g["step_s_overlapped"] == max(g["compute_s"], g["comm_s"])
    assert g["step_s_serial"] == pytest.approx(g["compute_s"] + g["comm_s"])


def test_config_sources(tmp_path):
    cfg, run, src = resolve_config(str(ROOT / "configs" / "llama2-70b.toml"))
    assert cfg == C70 and run.train.global_batch_size == 1024 and "run config" in src
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps({"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
                              "rms_norm_eps": 1e-5, "max_position_embeddings": 64}))
    cfg, run, _ = resolve_config(str(hf))
    assert run is None and cfg.dim == 64 and cfg.ffn_dim == 192
    with pytest.raises(ConfigError, match="neither a preset"):
        resolve_config("llama2-71b")


@pytest.mark.parametrize("kw, message", [
    (dict(world_size=1024, sharding="hsdp:3"), "hsdp:3|shard group size 3"),
    (dict(world_size=1024, sharding="zero9"), "expected fsdp or hsdp:K"),
    (dict(seq_len=5000), "--seq-len: 5000"),
    (dict(world_size=1024, global_batch=1000), "--global-batch 1000 is not divisible"),
    (dict(world_size=0), "--world-size"),
    (dict(micro_batch=0), "--micro-batch"),
])
def test_bad_arguments(kw, message):
    with pytest.raises(ConfigError, match=message):
        model_info(C70, meta_check=False, **kw)


def test_flops_per_token_grows_with_seq_len():
    a = model_info(C70, seq_len=2048, meta_check=False)["flops_per_token"]
    assert a == flops_per_token(C70, 2048)
    assert model_info(C70, seq_len=4096, meta_check=False)["flops_per_token"] - a == 12 * 80 * 8192 * 2048


def test_megatron_tp8_pp8_layout_matches_the_notes():
    """TP8/PP8/DP16 + distributed optimizer on 1024 cards: per rank ~2.2 GB bf16 weights,
    ~4.3 GB fp32 main grads, ~0.8 GB optimizer state (fullscale notes, section 5)."""
    from fullscale.model_info import megatron_cost, megatron_memory

    kw = dict(world_size=1024, seq_len=4096, micro_batch=1, sharding="megatron:tp8pp8", global_batch=1024)
    mem = megatron_memory(C70, **kw)
    p_rank = (10 * 855_654_400 + 32000 * 8192) / 8
    assert mem["weights"] == pytest.approx(2 * p_rank) and 2.1e9 < mem["weights"] < 2.3e9
    assert mem["main_grads"] == pytest.approx(4 * p_rank) and 4.2e9 < mem["main_grads"] < 4.5e9
    assert mem["optimizer_sharded"] == pytest.approx(12 * p_rank / 16)
    assert mem["stage"] == "first" and mem["activations_checkpoints"] == pytest.approx(8 * 10 * 4096 * 8192 * 2 / 8)
    c = megatron_cost(C70, **kw)
    assert (c["tp"], c["pp"], c["dp"], c["grad_accum_steps"]) == (8, 8, 16, 64)
    assert c["pipeline_bubble_s"] == pytest.approx(c["compute_s"] * 7 / 64)
    assert c["tensor_parallel_bytes"] == pytest.approx(64 * 10 * 12 * 7 / 8 * 4096 * 8192 * 2)
    assert c["dp_reduce_scatter_bytes"] == pytest.approx(15 / 16 * p_rank * 4)
    info = model_info(C70, meta_check=False, **kw)
    assert info["layout"] == "megatron" and info["grad_dtype"] == "fp32" and info["memory_bytes"]["fits"]
    with pytest.raises(ConfigError, match="TP x PP = 64 must divide --world-size 32"):
        megatron_memory(C70, **{**kw, "world_size": 32})
    with pytest.raises(ConfigError, match="PP 3 must divide num_layers 80"):
        megatron_memory(C70, **{**kw, "sharding": "megatron:tp8pp3", "world_size": 1032, "global_batch": 43})
    with pytest.raises(ConfigError, match="data-parallel size 16"):
        megatron_cost(C70, **{**kw, "global_batch": 1000})
    with pytest.raises(ConfigError, match="expected megatron:tpTppP"):
        megatron_memory(C70, **{**kw, "sharding": "megatron:8x8"})


def test_model_info_defaults_to_the_world_size_the_run_config_implies(capsys):
    from fullscale.model_info import default_world_size
    from study.cli import main

    cfg = str(ROOT / "configs" / "llama2-70b.toml")
    assert default_world_size(["--config", cfg]) == 1024          # 1024 sequences / micro batch 1
    assert default_world_size(["--config", "llama2-70b"]) is None   # a preset: the CLI's 1
    assert default_world_size(["--config", "/no/such.toml"]) is None
    assert main(["model", "info", "--config", cfg, "--json", "--no-meta-check"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["world_size"] == 1024 and info["memory_bytes"]["fits"]
    assert main(["model", "info", "--config", cfg, "--json", "--no-meta-check",
                 "--world-size", "64"]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 64


BLOCK = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):   # an install without the extras
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "jax", "jaxlib", "optax"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
from study.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv, extra", [
    (["train", "--help"], "trainer"),
    (["model", "info", "--config", "llama2-70b"], "cluster"),
    (["sweep", "run", "--help"], "study"),
])
def test_a_missing_extra_is_named_in_one_line(argv, extra):
    r = subprocess.run([sys.executable, "-c", BLOCK, *argv], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"pip install -e '.[{extra}]'" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_trainer_on_the_cluster_torch_names_the_trainer_extra(monkeypatch, capsys):
    import importlib.metadata

    from study import cli
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.1.0")
    assert cli.main(["train", "--help"]) == 2
    err = capsys.readouterr().err
    assert "needs torch >= 2.6 (found 2.1.0)" in err and ".[trainer]" in err
    assert cli.missing_extra("analyze", "pandas") is None       # not an extra's module
