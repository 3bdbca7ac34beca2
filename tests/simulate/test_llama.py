"""The JAX tiny LLaMA: shapes, init, causality, RoPE, GQA, the embedding shrink, loss scale."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from adamspike.llama import param_specs, preset
from simulate import llama as jl

CFG = preset("tiny")
fwd = jax.jit(lambda p, t: jl.forward(p, t, CFG))


@pytest.fixture(scope="module")
def params():
    return jl.init_params(CFG, jax.random.PRNGKey(0))


def _tokens(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, shape))


def test_init_matches_specs(params):
    specs = param_specs(CFG)
    assert list(params) == [s.name for s in specs]
    for s in specs:
        p = np.asarray(params[s.name])
        assert p.shape == s.shape and p.dtype == np.float32
        if s.init == "ones":
            assert np.all(p == 1.0)
        else:  # sample std within 4 standard errors of the spec's
            se = s.init_std * math.sqrt(2.0 / p.size)
            assert abs(p.std() - s.init_std) < 4 * se + 1e-9, s.name
    again = jl.init_params(CFG, jax.random.PRNGKey(0))
    assert all(np.array_equal(params[k], again[k]) for k in params)


def test_forward_shape_and_initial_loss(params):
    batch = _tokens((4, 17))
    logits = fwd(params, batch[:, :-1])
    assert logits.shape == (4, 16, CFG.vocab_size) and logits.dtype == jnp.float32
    scaled, aux = jl.loss_fn(params, batch, CFG)
    # small-init logits are near zero: the initial loss is close to log(vocab)
    assert abs(float(aux["loss"]) - math.log(CFG.vocab_size)) < 0.05
    assert float(scaled) == pytest.approx(float(aux["loss"]))


def test_causal(params):
    tok = _tokens((2, 12))
    changed = tok.at[:, 8:].set((tok[:, 8:] + 1) % CFG.vocab_size)
    a, b = fwd(params, tok), fwd(params, changed)
    np.testing.assert_array_equal(a[:, :8], b[:, :8])
    assert not np.allclose(a[:, 8:], b[:, 8:])


def test_rope_is_relative_and_norm_preserving():
    hd = CFG.head_dim
    cos, sin = jl.rope_angles(CFG, 16)
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(1, 1, 1, hd)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 1, hd)), jnp.float32)
    rot = lambda x, t: jl.apply_rope(jnp.broadcast_to(x, (1, 16, 1, hd)), cos, sin)[0, t, 0]
    # <R_t q, R_s k> depends on t - s only; rotations keep the norm
    d1 = float(rot(q, 5) @ rot(k, 2))
    d2 = float(rot(q, 13) @ rot(k, 10))
    assert d1 == pytest.approx(d2, rel=1e-4, abs=1e-5)
    assert float(jnp.linalg.norm(rot(q, 7))) == pytest.approx(float(jnp.linalg.norm(q)), rel=1e-5)
    # interleaved pairs: position 1 rotates (x0, x1) by angle 1 * theta^0 = 1 rad
    e0 = jnp.zeros((1, 16, 1, hd)).at[..., 0].set(1.0)
    out = jl.apply_rope(e0, cos, sin)[0, 1, 0]
    assert float(out[0]) == pytest.approx(math.cos(1.0), abs=1e-6)
    assert float(out[1]) == pytest.approx(math.sin(1.0), abs=1e-6)


def test_gqa_equals_mha_with_repeated_kv_heads(params):
    """num_kv_heads=2 equals a num_kv_heads=4 model whose kv heads are repeated per group."""
    mha = preset("tiny", num_kv_heads=CFG.num_heads)
    rep, hd = CFG.num_heads // CFG.num_kv_heads, CFG.head_dim
    p2 = dict(params)
    for i in range(CFG.num_layers):
        for w in ("wk", "wv"):
            name = f"layers.{i}.attention.{w}.weight"
            heads = params[name].reshape(CFG.num_kv_heads, hd, CFG.dim)
            p2[name] = jnp.repeat(heads, rep, axis=0).reshape(CFG.num_heads * hd, CFG.dim)
    tok = _tokens((2, 10))
    np.testing.assert_allclose(fwd(params, tok), jax.jit(lambda p, t: jl.forward(p, t, mha))(p2, tok),
                               rtol=1e-5, atol=1e-6)


def test_embed_grad_shrink_scales_only_the_embedding_gradient(params):
    batch = _tokens((4, 17), seed=2)
    grad = jax.jit(jax.grad(lambda p, a: jl.loss_fn(p, batch, CFG, embed_grad_shrink=a)[0]))
    g1, g2 = grad(params, 1.0), grad(params, 0.1)
    for k in params:
        want = 0.1 * g1[k] if k == "tok_embeddings.weight" else g1[k]
        np.testing.assert_allclose(g2[k], want, rtol=1e-4, atol=1e-5 * float(jnp.abs(want).max()),
                                   err_msg=k)
    v1 = jl.loss_fn(params, batch, CFG)[1]["loss"]
    v2 = jl.loss_fn(params, batch, CFG, embed_grad_shrink=0.1)[1]["loss"]
    assert float(v1) == pytest.approx(float(v2), rel=1e-6)


def test_loss_scale_and_z_loss(params):
    batch = _tokens((4, 17), seed=3)
    f = jax.jit(jax.value_and_grad(lambda p, s, z: jl.loss_fn(p, batch, CFG, s, z), has_aux=True))
    (s1, a1), g1 = f(params, 1.0, 0.0)
    (s2, a2), g2 = f(params, 1e-3, 0.0)
    assert float(a2["loss"]) == pytest.approx(float(a1["loss"]))
    assert float(s2) == pytest.approx(1e-3 * float(s1), rel=1e-6)
    for k in params:
        np.testing.assert_allclose(g2[k], 1e-3 * g1[k], rtol=1e-4,
                                   atol=1e-8 * float(jnp.abs(g1[k]).max()), err_msg=k)
    (_, az), _ = f(params, 1.0, 1e-2)
    lse = jax.nn.logsumexp(fwd(params, batch[:, :-1]), axis=-1)
    assert float(az["loss"]) == pytest.approx(float(a1["ce"] + 1e-2 * jnp.mean(lse ** 2)), rel=1e-6)
    assert float(az["ce"]) == pytest.approx(float(a1["ce"]), rel=1e-6)


def test_too_long_sequence_is_an_error(params):
    with pytest.raises(ValueError, match="max_seq_len"):
        jl.forward(params, _tokens((1, CFG.max_seq_len + 1)), CFG)
