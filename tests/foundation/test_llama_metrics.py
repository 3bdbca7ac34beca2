import numpy as np
import pytest

from adamspike import llama, metrics
from adamspike.synthdata import SyntheticTokens


def test_70b_parameter_count():
    cfg = llama.preset("llama2-70b")
    assert cfg.ffn_dim == 28672 and cfg.vocab_size == 32000
    assert llama.num_params(cfg) == 68_976_648_192
    # 6 N_non_embedding + 12 L d T at T=4096: ~444.5 GFLOP/token
    assert llama.flops_per_token(cfg, 4096) == pytest.approx(444.5e9, rel=1e-3)


def test_7b_count():
    assert llama.num_params(llama.preset("llama2-7b")) == 6_738_415_616


def test_specs_depth_kind():
    cfg = llama.preset("tiny")
    specs = llama.param_specs(cfg)
    assert specs[0].depth == -1 and specs[-1].kind == "output" and specs[-1].depth == cfg.num_layers
    assert {s.kind for s in specs} == {"embed", "wq", "wk", "wv", "wo", "w1", "w2", "w3", "norm", "output"}


def test_shard_sums_reduce_exactly():
    rng = np.random.default_rng(0)
    g, m, v, mp, p = rng.normal(size=(5, 1000))
    v = v ** 2 * 1e-6
    eps = 1e-3
    whole = metrics.shard_sums(g, m, v, mp, p, eps)
    parts = sum(metrics.shard_sums(g[s], m[s], v[s], mp[s], p[s], eps)
                for s in (slice(0, 300), slice(300, 1000)))
    np.testing.assert_allclose(whole, parts)
    out = metrics.reference_metrics(g, m, v, mp, p, eps)
    r = m / (np.sqrt(v) + eps)
    assert out["update_rms"] == pytest.approx(np.sqrt(np.mean(r ** 2)))
    assert out["sat_frac"] == pytest.approx(np.mean(np.abs(r) > 0.9))
    assert out["rms_t"] == pytest.approx(np.sqrt(np.mean(g ** 2 / np.maximum(v, eps ** 2))))
    assert out["grad_mom_cos"] == pytest.approx(g @ mp / np.linalg.norm(g) / np.linalg.norm(mp))
    assert metrics.histogram(r).sum() == 1000


def test_shape_stats_bimodal():
    x = np.concatenate([np.full(500, -1.0), np.full(500, 1.0)])
    s = metrics.shape_stats(*(np.mean(x ** k) for k in (1, 2, 3, 4)))
    assert s["bimodality"] == pytest.approx(1.0)
    z = np.random.default_rng(1).normal(size=200_000)
    s = metrics.shape_stats(*(np.mean(z ** k) for k in (1, 2, 3, 4)))
    assert s["bimodality"] == pytest.approx(1 / 3, abs=0.01)


def test_synthdata_deterministic_and_learnable():
    a = SyntheticTokens("markov", 64, 32, seed=1)
    b = SyntheticTokens("markov", 64, 32, seed=1)
    np.testing.assert_array_equal(a[123], b[123])
    assert a[0].shape == (33,) and a[0].dtype == np.int64 and a[0].max() < 64
    assert a.entropy_rate() < 0.8 * np.log(64)
    c = SyntheticTokens("copy", 16, 9)[5]
    np.testing.assert_array_equal(c[5:], c[:5])
    with pytest.raises(ValueError, match="data.task"):
        SyntheticTokens("zipf")
