"""The JAX toy (simulate/) and the torch trainer (fullscale/) compute the same thing.

Same weights (copied JAX -> torch) and the same batches (adamspike.order + synthdata):
1. forward loss and every parameter gradient, float32, with GQA, the GLM embedding shrink
   and z-loss on: |loss_j - loss_t| <= 1e-5 relative; per tensor
   max|g_j - g_t| <= 1e-5 * max|g_t| + 1e-9 (float32 reassociation noise only).
2. AdamW trajectory over 50 steps (warmup + cosine, weight decay, clipping active, loss
   scale 1e-2): simulate.optim.adamw (optax chain, torch clip formula) vs torch.optim.AdamW
   with fullscale.optim's LambdaLR and clip_gradients: every step's loss within 1e-4
   relative, the clipped flags equal, final parameters within 1e-4 * max|p| per tensor.
3. Telemetry of the same steps: simulate.telemetry (float32 on device) vs
   fullscale.telemetry.Telemetry (float64): the per-tensor metrics agree to 1e-3 relative
   (1e-5 absolute floor), counting metrics (sat_frac, eps_frac) to 2 elements.
The only test module that imports both frameworks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from adamspike.config import load_config
from adamspike.llama import spec_by_name
from adamspike.metrics import METRIC_NAMES
from adamspike.train_config import RunConfig
from fullscale import optim as topt
from fullscale.model import Transformer
from fullscale.telemetry import Telemetry
from fullscale.train import loss_terms
from simulate import llama as jl
from simulate import llama_train as lt

NUM_STEPS = 50
torch.set_num_threads(1)  # tiny tensors: threads only contend with XLA


def _cfg(*extra):
    return load_config(RunConfig, None, [
        "--model.preset", "tiny", "--optim.lr", "3e-3", "--optim.warmup_steps", "5",
        "--optim.weight_decay", "0.1", "--optim.grad_clip", "0.5", "--optim.b2", "0.95",
        "--train.num_steps", str(NUM_STEPS), "--train.global_batch_size", "8",
        "--train.seq_len", "32", "--train.loss_scale", "1e-2", *extra])


def _torch_model(params, cfg):
    model = Transformer(cfg.model.llama(), embed_grad_shrink=cfg.mitigation.embed_grad_shrink)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(np.array(params[name])))
    return model


def _torch_loss(model, batch, cfg):
    b = torch.from_numpy(np.asarray(batch, dtype=np.int64))
    return loss_terms(model(b[:, :-1]), b[:, 1:], cfg.train.z_loss)


def test_loss_and_gradients_match():
    torch.manual_seed(0)
    cfg = _cfg("--model.embed_grad_shrink", "0.1", "--train.z_loss", "1e-3")
    llama = cfg.model.llama()
    assert llama.num_kv_heads < llama.num_heads  # GQA is exercised
    params = jl.init_params(llama, jax.random.PRNGKey(3))
    batch = lt.batch_at(lt.dataset(cfg, llama), cfg, 1)
    (_, aux), grads = jax.jit(jax.value_and_grad(
        lambda p, b: jl.loss_fn(p, b, llama, 1.0, cfg.train.z_loss, cfg.mitigation.embed_grad_shrink),
        has_aux=True))(params, jnp.asarray(batch))
    model = _torch_model(params, cfg)
    loss = _torch_loss(model, batch, cfg)
    loss.backward()
    assert float(aux["loss"]) == pytest.approx(loss.item(), rel=1e-5)
    tgrads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    assert set(tgrads) == set(grads)
    for name, gt in tgrads.items():
        gj = np.asarray(grads[name])
        assert np.abs(gt).max() > 0, name
        np.testing.assert_allclose(gj, gt, rtol=0, atol=1e-5 * np.abs(gt).max() + 1e-9, err_msg=name)


def test_adamw_trajectory_and_telemetry_match():
    torch.manual_seed(0)
    cfg = _cfg()
    llama = cfg.model.llama()
    data = lt.dataset(cfg, llama)
    tx, step_fn = lt.make_steps(cfg)
    params = jl.init_params(llama, jax.random.PRNGKey(0))
    state = tx.init(params)
    model = _torch_model(params, cfg)
    opt = topt.build_optimizer(model, cfg.optim)
    sched = topt.build_scheduler(opt, cfg.optim, NUM_STEPS)
    tel = Telemetry(opt, spec_by_name(llama), every=1)
    names = jax.tree_util.tree_flatten_with_path(params)[0]
    jnames = [".".join(str(k.key) for k in path) for path, _ in names]
    s = cfg.train.loss_scale
    tel_steps = {1, 2, 30, NUM_STEPS}
    clipped_any = False
    for step in range(1, NUM_STEPS + 1):
        batch = lt.batch_at(data, cfg, step)
        log = step in tel_steps
        params, state, out = step_fn(params, state, jnp.asarray(batch), log, False)
        out = jax.device_get(out)

        loss = _torch_loss(model, batch, cfg)
        (loss * s).backward()
        grad_norm, clipped = topt.clip_gradients(model.parameters(), cfg.optim.grad_clip * s)
        if log:
            tel.before_step(step)
        opt.step()
        tstats = tel.after_step(step) if log else None
        sched.step()
        opt.zero_grad(set_to_none=True)

        assert float(out["loss"]) == pytest.approx(loss.item(), rel=1e-4), step
        assert float(out["grad_norm"]) == pytest.approx(grad_norm, rel=1e-3), step
        assert bool(out["clipped"]) == clipped, step
        clipped_any |= clipped
        if log:
            _compare_telemetry(step, out["sums"], jnames, tstats, cfg, llama)
    assert clipped_any  # the clipping path was exercised
    for name, p in model.named_parameters():
        pt, pj = p.detach().numpy(), np.asarray(params[name])
        np.testing.assert_allclose(pj, pt, rtol=0, atol=1e-4 * np.abs(pt).max(), err_msg=name)


def _compare_telemetry(step, sums, jnames, tstats, cfg, llama):
    jcols = lt.jtel.layer_columns(jnames, [0] * len(jnames), ["param"] * len(jnames),
                                  [0] * len(jnames), sums, cfg.optim.eps)
    jrow = {n: i for i, n in enumerate(jcols["name"])}
    specs = spec_by_name(llama)
    for i, name in enumerate(tstats.columns["name"]):
        numel = specs[name].numel
        for m in METRIC_NAMES:
            t, j = float(tstats.columns[m][i]), float(jcols[m][jrow[name]])
            if m == "grad_mom_cos" and step == 1:
                assert np.isnan(t) and np.isnan(j)
                continue
            tol = 2.0 / numel if m in ("sat_frac", "eps_frac") else 1e-3 * abs(t) + 1e-5
            assert abs(t - j) <= tol, (step, name, m, t, j)
