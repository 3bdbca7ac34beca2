"""Import a HuggingFace LLaMA `config.json` as an adamspike.llama.LlamaConfig.

Field map (HF -> ours): hidden_size -> dim, intermediate_size -> ffn_dim,
num_hidden_layers -> num_layers, num_attention_heads -> num_heads,
num_key_value_heads -> num_kv_heads (absent = num_attention_heads, HF's own default),
vocab_size, rms_norm_eps -> norm_eps, rope_theta (absent = 10000, HF's default),
max_position_embeddings -> max_seq_len, initializer_range -> init_std (absent = 0.02).

Only what this architecture implements is accepted: model_type "llama", untied embeddings,
silu MLP, no attention/MLP biases, no rope_scaling, head_dim = hidden_size / heads. Anything
else is a ConfigError naming the field. Only the architecture is imported, not weights
(HF checkpoints permute wq/wk for the rotate-half RoPE; ours is Meta's interleaved form).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from adamspike.config import ConfigError
from adamspike.llama import LlamaConfig
from adamspike.rundir import read_json

REQUIRED = {"hidden_size": "dim", "intermediate_size": "ffn_dim", "num_hidden_layers": "num_layers",
            "num_attention_heads": "num_heads", "vocab_size": "vocab_size",
            "rms_norm_eps": "norm_eps", "max_position_embeddings": "max_seq_len"}


def _int(src: str, d: Mapping, key: str) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{src}: {key} must be a positive integer, got {v!r}")
    return v


def _float(src: str, d: Mapping, key: str) -> float:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ConfigError(f"{src}: {key} must be a positive number, got {v!r}")
    return float(v)


def from_hf_dict(d: Mapping[str, Any], source: str = "config.json") -> LlamaConfig:
    """LlamaConfig from the parsed contents of a HF config.json."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
    model_type = d.get("model_type", "llama")
    if model_type != "llama":
        raise ConfigError(f"{source}: model_type is {model_type!r}; only 'llama' is supported")
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise ConfigError(f"{source}: missing field{'s' if len(missing) > 1 else ''}: {', '.join(missing)}")
    if d.get("tie_word_embeddings", False) is not False:
        raise ConfigError(f"{source}: tie_word_embeddings must be false (LLaMA2 has an untied "
                          f"output head), got {d['tie_word_embeddings']!r}")
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act must be 'silu' (SwiGLU), got {d['hidden_act']!r}")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key, False):
            raise ConfigError(f"{source}: {key} must be false (this LLaMA has no biases)")
    if d.get("rope_scaling") is not None:
        raise ConfigError(f"{source}: rope_scaling {d['rope_scaling']!r} is not supported (plain RoPE only)")
    dim, heads = _int(source, d, "hidden_size"), _int(source, d, "num_attention_heads")
    kv = _int(source, d, "num_key_value_heads") if d.get("num_key_value_heads") is not None else heads
    if dim % heads:
        raise ConfigError(f"{source}: hidden_size {dim} is not divisible by num_attention_heads {heads}")
    if d.get("head_dim") is not None and d["head_dim"] != dim // heads:
        raise ConfigError(f"{source}: head_dim {d['head_dim']!r} contradicts hidden_size / "
                          f"num_attention_heads = {dim // heads}")
    if heads % kv:
        raise ConfigError(f"{source}: num_key_value_heads {kv} does not divide num_attention_heads {heads}")
    cfg = LlamaConfig(
        vocab_size=_int(source, d, "vocab_size"), dim=dim,
        num_layers=_int(source, d, "num_hidden_layers"), num_heads=heads, num_kv_heads=kv,
        ffn_dim=_int(source, d, "intermediate_size"),
        max_seq_len=_int(source, d, "max_position_embeddings"),
        norm_eps=_float(source, d, "rms_norm_eps"),
        rope_theta=_float(source, d, "rope_theta") if d.get("rope_theta") is not None else 10000.0,
        init_std=_float(source, d, "initializer_range") if d.get("initializer_range") is not None else 0.02)
    try:
        cfg.check()
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return cfg


def load_hf_config(path: str | Path) -> LlamaConfig:
    """LlamaConfig from a HF config.json file (or a directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    data = read_json(path, ConfigError, f"model.hf_config: file not found: {path}")
    return from_hf_dict(data, str(path))


def resolve_model(model_section) -> LlamaConfig:
    """The architecture a RunConfig's [model] section describes: its hf_config file if set
    (the preset and field overrides are then not used), else preset + overrides."""
    if model_section.hf_config:
        return load_hf_config(model_section.hf_config)
    return model_section.llama()
