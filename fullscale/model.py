"""LLaMA2 decoder in torch, built from `adamspike.llama.param_specs` (the JAX toy in
simulate/llama.py implements the same function; tests/parity compares the two in fp32).

    h_0   = E[tokens]                                  E = tok_embeddings.weight (V, d)
    h_0   = a h_0 + (1 - a) stopgrad(h_0)              GLM-130B embedding-grad shrink (a < 1)
    for each block l:
      u   = RMSNorm(h) ;  q, k, v = u Wq^T, u Wk^T, u Wv^T      (heads of size hd = d / H)
      q,k = RoPE(q), RoPE(k)                           interleaved pairs (x[..0::2], x[..1::2])
      h   = h + softmax(q k^T / sqrt(hd) + causal) v Wo^T      GQA: kv head j // (H / KV)
      u   = RMSNorm(h) ;  h = h + (silu(u W1^T) * (u W3^T)) W2^T
    logits = RMSNorm(h) Wout^T                         float32, untied head, no biases

RMSNorm(x) = x * rsqrt(mean(x^2) + eps) computed in float32, cast back, then * weight.
RoPE: for pair i (i = 0..hd/2-1) at position t, angle t * theta^(-2i/hd) and
(x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos), in float32 with real arithmetic (no complex
dtype, so it runs on torch_npu).

The module tree makes `named_parameters()` equal `param_specs(cfg)` in names, shapes and
order. Activation checkpointing is a flag on each block (set by fullscale/parallelize.py)
rather than a wrapper module, so parameter names never change. The model can be built on
the meta device (`with torch.device("meta"): Transformer(cfg)`), sharded, materialised with
`to_empty`, then `init_weights`: the RoPE tables are computed in forward, there are no
buffers to restore.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from adamspike.llama import LlamaConfig, param_specs
from fullscale.device import local_shard


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of the rotation angles, float32 (seq_len, head_dim // 2)."""
    i = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
    freqs = theta ** (-i / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x (B, T, H, hd) by the angles (T, hd/2)."""
    xf = x.float()
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kv_dim = cfg.num_kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.num_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:  # query head j reads kv head j // rep (Meta's repeat_kv)
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=self.head_dim ** -0.5)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        # Attribute order fixes named_parameters() order (= param_specs).
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.activation_checkpointing = False

    def _forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x, cos, sin):
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)


class Transformer(nn.Module):
    def __init__(self, cfg: LlamaConfig, embed_grad_shrink: float = 1.0):
        super().__init__()
        cfg.check()
        if not 0.0 < embed_grad_shrink <= 1.0:
            raise ValueError(f"model.embed_grad_shrink: must be in (0, 1], got {embed_grad_shrink}")
        self.cfg, self.embed_grad_shrink = cfg, float(embed_grad_shrink)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, V) float32."""
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model max_seq_len={self.cfg.max_seq_len}")
        h = self.tok_embeddings(tokens)
        a = self.embed_grad_shrink
        if a < 1.0:  # forward unchanged, gradient into the embedding scaled by a
            h = a * h + (1.0 - a) * h.detach()
        cos, sin = rope_tables(T, self.cfg.head_dim, self.cfg.rope_theta, h.device)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h)).float()

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Megatron-style init from param_specs: N(0, std^2) or ones.

        Every rank draws every *full* tensor, in spec order, from `generator` (on the
        parameter's device if the generator is None) and keeps its own shard of it, so a
        seeded generator gives the same initial weights for any number of processes.
        """
        params = dict(self.named_parameters())
        for spec in param_specs(self.cfg):
            p = params[spec.name]
            local = local_shard(p)
            device = generator.device if generator is not None else local.device
            full = torch.empty(spec.shape, device=device, dtype=torch.float32)
            if spec.init == "ones":
                full.fill_(1.0)
            else:
                full.normal_(0.0, spec.init_std, generator=generator)
            local.copy_(_local_shard(full, p).to(device=local.device, dtype=local.dtype))


def _local_shard(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `full` for parameter p (a plain tensor or a DTensor)."""
    if not hasattr(p, "to_local"):
        return full
    # lazy: public torch.distributed.tensor needs torch >= 2.4 (model info and the probe run
    # on torch 2.1); only DTensor parameters get here
    from torch.distributed.tensor import distribute_tensor

    # All ranks hold the same `full`; src_data_rank=None slices locally, no communication.
    full = full.to(p.device)
    return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
