"""The tiny LLaMA in JAX: a pure function of a flat parameter dict (never torch).

Parameters are a flat dict `name -> float32 array` built from `adamspike.llama.param_specs`
(torch-style names and (out, in) linear weights), so a JAX parameter and its torch twin in
`fullscale.model.Transformer` have the same name, shape and meaning, and weights copy 1:1.

The function, exactly (both backends must compute it; all math in float32):

    linear(x, W)   = x @ W.T                                  W: (out, in), no bias
    rmsnorm(x, w)  = x * rsqrt(mean(x^2, -1) + norm_eps) * w
    rope(x)        pairs (x[..., 0::2], x[..., 1::2]) = (a, b) of each head, position t,
                   freq_i = rope_theta^(-2i/head_dim), i = 0..head_dim/2-1, angle = t*freq_i:
                   a' = a cos - b sin,  b' = a sin + b cos,  re-interleaved (Meta's complex
                   multiply on view_as_complex(x.reshape(..., -1, 2)))
    attention(x)   q = rope(linear(x, wq)) as (B, T, H, hd); k = rope(linear(x, wk)),
                   v = linear(x, wv) as (B, T, KV, hd); kv head j serves query heads
                   j*H/KV .. (j+1)*H/KV - 1 (Meta's repeat_kv); scores = q.k / sqrt(hd) with a
                   causal mask (key position <= query position); softmax over keys;
                   out = linear(concat_heads(softmax @ v), wo)
    ffn(x)         linear(silu(linear(x, w1)) * linear(x, w3), w2)
    block(x)       h = x + attention(rmsnorm(x, attention_norm));  h + ffn(rmsnorm(h, ffn_norm))
    forward(tok)   x = tok_embeddings[tok];  x = a*x + (1-a)*stop_gradient(x)  (GLM-130B
                   embedding-gradient shrink, a = embed_grad_shrink; the value is unchanged,
                   the embedding gradient is multiplied by a);  x = block_L-1(...block_0(x));
                   logits = linear(rmsnorm(x, norm), output)          (untied head)

Loss (`loss_fn`): with z = logsumexp(logits) per token,
    ce = mean_tokens(z - logits[target]),   total = ce + z_loss * mean_tokens(z^2)  (PaLM)
and the differentiated objective is `loss_scale * total`. Adam is invariant to the gradient
scale except through eps: Adam(s*L, eps) takes exactly the steps of Adam(L, eps/s) (with the
global-norm clip threshold scaled by s too; decoupled weight decay is unaffected). A small s
therefore moves a tiny model into the rho = rms(g)/eps ~ 1 regime of a 70B model at eps=1e-8.
The unscaled `total` and `ce` are returned for logging.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from adamspike.llama import LlamaConfig, param_specs

Params = dict[str, jax.Array]


def init_params(cfg: LlamaConfig, key: jax.Array) -> Params:
    """Megatron-style init from the specs: N(0, std^2) (std per spec), norm weights ones.
    One PRNG key per tensor, split in spec order (deterministic for a seed); one compiled
    function draws all tensors."""
    specs = param_specs(cfg)
    params = _draw(tuple((s.name, tuple(s.shape), s.init, s.init_std) for s in specs))(key)
    return {s.name: params[s.name] for s in specs}  # spec order (jit returns sorted keys)


@functools.lru_cache(maxsize=16)
def _draw(layout: tuple):
    """The jitted draw of one tensor layout ((name, shape, init, std) in spec order), kept:
    a new jit per call compiled it again each time (~1 s, dozens of times in the suite)."""
    def draw(key):
        keys = jax.random.split(key, len(layout))
        return {name: jnp.ones(shape, jnp.float32) if init == "ones"
                else std * jax.random.normal(k, shape, jnp.float32)
                for (name, shape, init, std), k in zip(layout, keys)}
    return jax.jit(draw)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Normalised in float32, cast back to x's dtype, then * weight (torch's RMSNorm)."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight


def rope_angles(cfg: LlamaConfig, seq_len: int) -> tuple[jax.Array, jax.Array]:
    """cos, sin of t * theta^(-2i/hd), shape (seq_len, hd/2)."""
    hd = cfg.head_dim
    freqs = 1.0 / (cfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * freqs[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: (B, T, heads, hd); rotate interleaved pairs (x[..., 0::2], x[..., 1::2])."""
    xf = x.astype(jnp.float32)   # float32 rotation, cast back (torch's apply_rope)
    a, b = xf[..., 0::2], xf[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(x.shape).astype(x.dtype)


def attention(params: Params, prefix: str, x: jax.Array, cfg: LlamaConfig,
              cos: jax.Array, sin: jax.Array) -> jax.Array:
    B, T, _ = x.shape
    H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = (x @ params[prefix + "wq.weight"].T).reshape(B, T, H, hd)
    k = (x @ params[prefix + "wk.weight"].T).reshape(B, T, KV, hd)
    v = (x @ params[prefix + "wv.weight"].T).reshape(B, T, KV, hd)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k, v = jnp.repeat(k, H // KV, axis=2), jnp.repeat(v, H // KV, axis=2)  # Meta's repeat_kv
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    scores = jnp.where(causal[None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, T, H * hd)
    return out @ params[prefix + "wo.weight"].T


def feed_forward(params: Params, prefix: str, x: jax.Array) -> jax.Array:
    gate = jax.nn.silu(x @ params[prefix + "w1.weight"].T)
    return (gate * (x @ params[prefix + "w3.weight"].T)) @ params[prefix + "w2.weight"].T


def forward(params: Params, tokens: jax.Array, cfg: LlamaConfig,
            embed_grad_shrink: float = 1.0) -> jax.Array:
    """tokens (B, T) int -> logits (B, T, vocab) float32."""
    T = tokens.shape[1]
    if T > cfg.max_seq_len:
        raise ValueError(f"sequence length {T} exceeds max_seq_len={cfg.max_seq_len}")
    x = params["tok_embeddings.weight"][tokens]
    # GLM-130B: same value, embedding gradient times a. Unconditional, so `a` may be traced;
    # a = 1 is exact (1*x + 0*x == x, gradient 1*g).
    a = embed_grad_shrink
    x = (a * x + (1.0 - a) * jax.lax.stop_gradient(x)).astype(x.dtype)  # a traced: keep bf16
    cos, sin = rope_angles(cfg, T)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        h = x + attention(params, p + "attention.", rms_norm(x, params[p + "attention_norm.weight"],
                                                              cfg.norm_eps), cfg, cos, sin)
        x = h + feed_forward(params, p + "feed_forward.",
                             rms_norm(h, params[p + "ffn_norm.weight"], cfg.norm_eps))
    x = rms_norm(x, params["norm.weight"], cfg.norm_eps)
    return (x @ params["output.weight"].T).astype(jnp.float32)


def loss_fn(params: Params, batch: jax.Array, cfg: LlamaConfig, loss_scale: float = 1.0,
            z_loss: float = 0.0, embed_grad_shrink: float = 1.0,
            compute_dtype: str = "fp32"):
    """batch (B, T+1) int tokens -> (loss_scale * total, {"loss": total, "ce": ce}).

    total = mean CE + z_loss * mean(logsumexp^2); differentiate the first output
    (`jax.value_and_grad(loss_fn, has_aux=True)`), log the unscaled aux. The scalars may be
    traced (one compiled step serves every loss scale).

    compute_dtype "bf16" (`train.dtype`): the torch trainer's FSDP2 policy
    (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`): the float32 master
    parameters are cast to bfloat16 for the forward, every matmul runs in bfloat16, RMSNorm
    and RoPE compute in float32 and cast back, the logits and the loss are float32. The
    gradient w.r.t. the float32 parameters is float32 (the cast's transpose), so Adam's
    state and the telemetry stay float32, as at 70B."""
    if compute_dtype not in ("fp32", "bf16"):
        raise ValueError(f"train.dtype: must be 'fp32' or 'bf16', got {compute_dtype!r}")
    if compute_dtype == "bf16":
        params = {n: p.astype(jnp.bfloat16) for n, p in params.items()}
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = forward(params, inputs, cfg, embed_grad_shrink)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    ce = jnp.mean(lse - target_logit)
    total = ce + z_loss * jnp.mean(lse * lse)  # z_loss = 0 adds an exact 0 (may be traced)
    return loss_scale * total, {"loss": total, "ce": ce}
