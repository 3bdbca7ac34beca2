"""fullscale.hf: HF LLaMA config.json -> LlamaConfig, with clear errors."""

from __future__ import annotations

import json

import pytest

from adamspike.config import ConfigError
from adamspike.llama import PRESETS, num_params
from adamspike.train_config import ModelSection
from fullscale.hf import from_hf_dict, load_hf_config, resolve_model

# The published Llama-2-70b-hf config.json fields (architecture part).
LLAMA2_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000,
    "rms_norm_eps": 1e-05, "max_position_embeddings": 4096, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "initializer_range": 0.02, "rope_scaling": None,
    "pretraining_tp": 1, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
}


def test_llama2_70b_config_matches_preset(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(LLAMA2_70B))
    cfg = load_hf_config(tmp_path)            # a directory works too
    assert cfg == PRESETS["llama2-70b"]
    assert num_params(cfg) == 68_976_648_192
    assert resolve_model(ModelSection(hf_config=str(p))) == cfg
    assert resolve_model(ModelSection(preset="tiny")) == PRESETS["tiny"]


def test_hf_defaults_for_absent_optional_fields():
    d = {k: v for k, v in LLAMA2_70B.items() if k not in ("num_key_value_heads", "rope_theta",
                                                           "tie_word_embeddings", "model_type")}
    cfg = from_hf_dict(d)
    assert cfg.num_kv_heads == 64 and cfg.rope_theta == 10000.0


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": None}, "missing field: hidden_size"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings must be false"),
    ({"model_type": "mistral"}, "only 'llama'"),
    ({"hidden_act": "gelu"}, "hidden_act must be 'silu'"),
    ({"attention_bias": True}, "attention_bias must be false"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"head_dim": 64}, "head_dim 64 contradicts hidden_size / num_attention_heads = 128"),
    ({"num_key_value_heads": 7}, "num_key_value_heads 7 does not divide num_attention_heads 64"),
    ({"hidden_size": 8100}, "hidden_size 8100 is not divisible by num_attention_heads 64"),
    ({"vocab_size": "32000"}, "vocab_size must be a positive integer"),
    ({"rms_norm_eps": 0}, "rms_norm_eps must be a positive number"),
])
def test_bad_fields_are_named(change, message):
    d = dict(LLAMA2_70B)
    for k, v in change.items():
        if v is None:
            d.pop(k)
        else:
            d[k] = v
    with pytest.raises(ConfigError, match=message):
        from_hf_dict(d, "x/config.json")


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_hf_config(tmp_path / "nope.json")
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        load_hf_config(p)
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        load_hf_config(p)
