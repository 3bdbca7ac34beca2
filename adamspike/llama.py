"""The LLaMA2 architecture both backends build: configs, parameter names, shapes and init.

simulate/ (JAX) and fullscale/ (torch) each construct the model from `param_specs(cfg)`, so
the two share parameter paths, shapes, telemetry depth/kind and initialisation exactly.

Architecture (Touvron et al. 2023): pre-norm decoder, RMSNorm (weight only), rotary position
embedding on q and k with *interleaved pairs* (x[..., 0::2], x[..., 1::2]) as in Meta's
reference code, grouped-query attention (num_kv_heads divides num_heads), SwiGLU MLP
`w2(silu(w1 x) * w3 x)`, untied input embedding and output head, no biases. Linear weights
are stored torch-style as (out_features, in_features): y = x @ W.T.

Init (Megatron-style): every linear and the embedding ~ N(0, init_std^2); the two output
projections of each block (attention.wo, feed_forward.w2) use init_std / sqrt(2 * num_layers);
norm weights are ones.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from adamspike.config import ConfigError, param


@dataclass
class LlamaConfig:
    vocab_size: int = param(32000, lo=1)
    dim: int = param(4096, lo=1)
    num_layers: int = param(32, lo=1)
    num_heads: int = param(32, lo=1)
    num_kv_heads: int = param(32, lo=1)
    ffn_dim: int = param(11008, lo=1)
    max_seq_len: int = param(4096, lo=1)
    norm_eps: float = param(1e-5, lo=0.0, lo_open=True)
    rope_theta: float = param(10000.0, lo=0.0, lo_open=True)
    init_std: float = param(0.02, lo=0.0, lo_open=True)

    def check(self) -> None:
        if self.dim % self.num_heads:
            raise ConfigError(f"dim: {self.dim} is not divisible by num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_kv_heads: {self.num_kv_heads} does not divide num_heads={self.num_heads}")
        if (self.dim // self.num_heads) % 2:
            raise ConfigError(f"dim: head dim {self.dim // self.num_heads} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads


def ffn_dim_for(dim: int, multiple_of: int, ffn_dim_multiplier: float | None = None) -> int:
    """Meta's rule: hidden = multiple_of * ceil(mult * floor(2 * 4 * dim / 3) / multiple_of)."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


PRESETS: dict[str, LlamaConfig] = {
    # CI / laptop scale; vocab matches adamspike.synthdata defaults.
    "tiny": LlamaConfig(vocab_size=64, dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        ffn_dim=ffn_dim_for(64, 32), max_seq_len=64),
    "small": LlamaConfig(vocab_size=256, dim=128, num_layers=4, num_heads=4, num_kv_heads=2,
                         ffn_dim=ffn_dim_for(128, 32), max_seq_len=128),
    "llama2-7b": LlamaConfig(dim=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                             ffn_dim=11008),
    "llama2-13b": LlamaConfig(dim=5120, num_layers=40, num_heads=40, num_kv_heads=40,
                              ffn_dim=13824),
    "llama2-70b": LlamaConfig(dim=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                              ffn_dim=ffn_dim_for(8192, 4096, 1.3)),
}


def preset(name: str, **overrides) -> LlamaConfig:
    """A preset by name, with field overrides (None values ignored)."""
    if name not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {name!r}; known: {', '.join(PRESETS)}")
    cfg = dataclasses.replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})
    cfg.check()
    return cfg


@dataclass(frozen=True)
class ParamSpec:
    name: str            # parameter path, e.g. "layers.0.attention.wq.weight"
    shape: tuple[int, ...]
    depth: int           # -1 embedding, 0..L-1 blocks, L final norm / head
    kind: str            # embed, wq, wk, wv, wo, w1, w2, w3, norm, output
    init: str            # "normal" or "ones"
    init_std: float      # 0 for "ones"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def param_specs(cfg: LlamaConfig) -> list[ParamSpec]:
    """All parameters in module order (the order torch's named_parameters() yields)."""
    d, hd, L = cfg.dim, cfg.head_dim, cfg.num_layers
    kv = cfg.num_kv_heads * hd
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * L)
    specs = [ParamSpec("tok_embeddings.weight", (cfg.vocab_size, d), -1, "embed", "normal", std)]
    for i in range(L):
        p = f"layers.{i}."
        specs += [
            ParamSpec(p + "attention.wq.weight", (d, d), i, "wq", "normal", std),
            ParamSpec(p + "attention.wk.weight", (kv, d), i, "wk", "normal", std),
            ParamSpec(p + "attention.wv.weight", (kv, d), i, "wv", "normal", std),
            ParamSpec(p + "attention.wo.weight", (d, d), i, "wo", "normal", out_std),
            ParamSpec(p + "feed_forward.w1.weight", (cfg.ffn_dim, d), i, "w1", "normal", std),
            ParamSpec(p + "feed_forward.w2.weight", (d, cfg.ffn_dim), i, "w2", "normal", out_std),
            ParamSpec(p + "feed_forward.w3.weight", (cfg.ffn_dim, d), i, "w3", "normal", std),
            ParamSpec(p + "attention_norm.weight", (d,), i, "norm", "ones", 0.0),
            ParamSpec(p + "ffn_norm.weight", (d,), i, "norm", "ones", 0.0),
        ]
    specs += [ParamSpec("norm.weight", (d,), L, "norm", "ones", 0.0),
              ParamSpec("output.weight", (cfg.vocab_size, d), L, "output", "normal", std)]
    return specs


def spec_by_name(cfg: LlamaConfig) -> dict[str, ParamSpec]:
    return {s.name: s for s in param_specs(cfg)}


def num_params(cfg: LlamaConfig, *, embeddings: bool = True) -> int:
    """Total parameter count (LLaMA2-70B: 68,976,648,192)."""
    return sum(s.numel for s in param_specs(cfg) if embeddings or s.kind != "embed")


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token, PaLM / torchtitan convention:
    6 * N_non_embedding + 12 * L * d * T (attention scores; causal mask and recompute ignored).
    """
    return 6.0 * num_params(cfg, embeddings=False) + 12.0 * cfg.num_layers * cfg.dim * seq_len
