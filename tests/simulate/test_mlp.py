"""simulate.mlp: training traces, telemetry bookkeeping, the loss-scale = eps/s identity."""

import numpy as np
import pytest

from adamspike.metrics import NUM_HIST_BINS, finalize
from adamspike.train_config import OptimSection
from simulate.mlp import MLPSpec, init_params, tensor_meta, train
from simulate.telemetry import NUM_SUMS


def test_sin_fnn_trains_and_records_telemetry():
    spec = MLPSpec(kind="sin", width=32, num_points=64)
    opt = OptimSection(lr=1e-2, b2=0.999, eps=1e-8, grad_clip=0.0, schedule="constant")
    tr = train(spec, opt, 300, hist_every=100, chunk=150, progress=False)
    names, depths, kinds, numels = tensor_meta(spec)
    assert names == ["layers.0.bias", "layers.0.weight", "output.bias", "output.weight"]
    assert depths == [0, 0, 1, 1] and kinds == ["param", "param", "output", "output"]
    assert tr["sums"].shape == (300, 4, NUM_SUMS)
    np.testing.assert_array_equal(tr["sums"][:, :, 0], np.broadcast_to(numels, (300, 4)))
    assert tr["loss"][-1] < 0.5 * tr["loss"][0]
    assert not tr["clipped"].any() and (tr["lr"] == np.float32(1e-2)).all()
    # step 1: Adam's r is +-1 per coordinate with a nonzero gradient -> update_rms ~ sat_frac
    m1 = finalize(tr["sums"][0], opt.eps)
    assert np.all(m1["sat_frac"][[1, 3]] > 0.9)
    # grad_norm of the steps table = sqrt(sum over tensors of sum g^2) (no clipping here)
    np.testing.assert_allclose(tr["grad_norm"], np.sqrt(tr["sums"][:, :, 1].sum(1)), rtol=1e-5)
    np.testing.assert_array_equal(tr["hist_steps"], [100, 200, 300])
    assert tr["hists"].shape == (3, 4, NUM_HIST_BINS)
    np.testing.assert_array_equal(tr["hists"].sum(-1), np.broadcast_to(numels, (3, 4)))


def test_loss_scale_equals_eps_over_s():
    """Adam on s*L with eps, clip c*s == Adam on L with eps/s, clip c (s = 2^10: the
    scaling is exact in binary floating point up to torch's +1e-6 in the clip factor)."""
    s = 1024.0
    spec = MLPSpec(kind="deep", width=16, depth=3, num_points=64, batch_size=16, init_gain=0.5)
    kw = dict(lr=3e-3, b2=0.95, grad_clip=0.05, schedule="cosine", warmup_steps=5)
    a = train(spec, OptimSection(eps=1e-6, **kw), 120, loss_scale=s, chunk=120, progress=False)
    b = train(spec, OptimSection(eps=1e-6 / s, **kw), 120, loss_scale=1.0, chunk=120,
              progress=False)
    assert a["clipped"].any() and (a["clipped"] == b["clipped"]).all()
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-4)
    np.testing.assert_allclose(a["grad_norm"], s * b["grad_norm"], rtol=1e-4)
    ma, mb = finalize(a["sums"][-1], 1e-6), finalize(b["sums"][-1], 1e-6 / s)
    for k in ("rho", "update_rms", "rms_t", "sat_frac", "m_v_ratio"):
        np.testing.assert_allclose(ma[k], mb[k], rtol=1e-3, atol=1e-6, err_msg=k)


def test_init_and_spec_errors():
    p = init_params(MLPSpec(kind="deep", width=8, depth=2))
    assert p["layers.0.weight"].shape == (8, 16) and p["output.weight"].shape == (1, 8)
    for kw, name in [({"kind": "cnn"}, "kind"), ({"width": 0}, "width"),
                     ({"kind": "sin", "depth": 3}, "depth"), ({"batch_size": 10**6}, "batch_size"),
                     ({"init_gain": 0.0}, "init_gain"), ({"input_scale": -1.0}, "input_scale")]:
        with pytest.raises(ValueError, match=name):
            MLPSpec(**kw)
    with pytest.raises(ValueError, match="num_steps"):
        train(MLPSpec(), OptimSection(), 0, progress=False)


def test_sin_fnn_spikes_follow_curvature_crossings():
    """Bai et al.: on the sin x + sin 4x FNN (full batch, b2 = 0.999, eps = 1e-8) every large
    loss spike comes after lam_hat_grad = g^T P H g / ||g||^2 exceeded 2/lr; the crossing is
    not permanent (it is a precursor, not a constant)."""
    from analysis.spikes import detect_spikes

    opt = OptimSection(lr=1e-2, eps=1e-8, b2=0.999, grad_clip=0.0, schedule="constant")
    tr = train(MLPSpec(kind="sin", width=256), opt, 3000, curvature=True, chunk=3000,
               progress=False)
    sp = detect_spikes(tr["loss"], window=100, k=6.0, min_rel_jump=1.0, log=True)
    big = sp[sp.height >= 9]
    assert len(big) >= 2
    above = tr["lam_hat_grad"] > tr["threshold"]
    for s in big.start:
        assert above[max(0, s - 101):s - 1].any(), s
    assert 0.01 < above[500:].mean() < 0.5
