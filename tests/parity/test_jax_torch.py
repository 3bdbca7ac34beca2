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

import math

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
    model = Transformer(cfg.model.llama(), **lt.step_plan(cfg).model_options)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(np.array(params[name])))
    return model


def _torch_loss(model, batch, cfg):
    b = torch.from_numpy(np.asarray(batch, dtype=np.int64))
    return loss_terms(model(b[:, :-1]), b[:, 1:], cfg.train.z_loss)


def test_loss_and_gradients_match():
    torch.manual_seed(0)
    cfg = _cfg("--mitigation.embed_grad_shrink", "0.1", "--train.z_loss", "1e-3")
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
    prog = lt.program(cfg)
    params, state = prog.init(0)
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
        params, state, out = prog.step_fn(params, state, jnp.asarray(batch),
                                          prog.controls(cfg, [step]).at(0),
                                          prog.telemetry_spec(cfg), report=int(log))
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


def _run_both(cfg, tel_steps, explicit_m_prev, params_at=None):
    """50 steps of the JAX step (simulate.program: the registry's v resets are its
    controls) and of the torch optimizer step (fullscale.train's hook order); returns per step the
    telemetry of both and the final parameters of both."""
    from adamspike import mitigations

    torch.manual_seed(0)
    llama = cfg.model.llama()
    data = lt.dataset(cfg, llama)
    prog = lt.program(cfg)
    mit = lt.step_plan(cfg)
    params, state = prog.init(0)
    model = _torch_model(params, cfg)
    opt = topt.build_optimizer(model, cfg.optim, mit)
    sched = topt.build_scheduler(opt, cfg.optim, NUM_STEPS)
    assert mitigations.needs_explicit_m_prev(cfg) == explicit_m_prev
    tel = Telemetry(opt, spec_by_name(llama), every=1, explicit_m_prev=explicit_m_prev)
    jnames = lt.jtel.tensor_names(params)
    jeps = np.array([mit.tensor_eps[n] for n in jnames])
    s = cfg.train.loss_scale
    seen = []
    for step in range(1, NUM_STEPS + 1):
        batch = lt.batch_at(data, cfg, step)
        mu = lt.jopt.adam_state(state).mu
        prev_mu = dict(zip(lt.jtel.tensor_names(mu), jax.device_get(jax.tree.leaves(mu))))
        log = step in tel_steps
        params, state, out = prog.step_fn(params, state, jnp.asarray(batch),
                                          prog.controls(cfg, [step]).at(0),
                                          prog.telemetry_spec(cfg), report=int(log))
        out = jax.device_get(out)
        loss = _torch_loss(model, batch, cfg)
        (loss * s).backward()
        topt.clip_gradients(model.parameters(), cfg.optim.grad_clip * s)
        topt.apply_mitigations(opt, mit, step, sched.get_last_lr()[0])   # as fullscale.train
        if log:
            tel.before_step(step)
            tgrad = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            tmprev = {n: opt.state[p]["exp_avg"].detach().clone() if p in opt.state
                      else torch.zeros_like(p) for n, p in model.named_parameters()}
        opt.step()
        tstats = tel.after_step(step) if log else None
        sched.step()
        opt.zero_grad(set_to_none=True)
        assert float(out["loss"]) == pytest.approx(loss.item(), rel=1e-5), step
        if params_at is not None:   # both sides' parameters and torch's m after this step
            params_at[step] = (jax.device_get(params),
                               {n: p.detach().clone() for n, p in model.named_parameters()},
                               {n: opt.state[p]["exp_avg"].detach().clone()
                                for n, p in model.named_parameters()})
        if log:
            jcols = lt.jtel.layer_columns(jnames, [0] * len(jnames), ["param"] * len(jnames),
                                          [0] * len(jnames), out["sums"], jeps)
            seen.append((step, jcols, tstats, tgrad, tmprev, prev_mu))
    return seen, params, model


def _check_cos(step, name, got, g, m_prev):
    """grad_mom_cos against cos(g_t, m_{t-1}) from the tensors themselves (float64)."""
    g, mp = np.asarray(g, np.float64).ravel(), np.asarray(m_prev, np.float64).ravel()
    if not (g @ g > 0 and mp @ mp > 0):
        assert np.isnan(got), (step, name)
        return
    want = g @ mp / np.sqrt((g @ g) * (mp @ mp))
    assert abs(got - want) <= 1e-5, (step, name, got, want)


def test_group_eps_and_v_reset_match_and_grad_mom_cos_is_right_after_a_reset():
    """Per-layer-group eps (embed / shallow / deep + head) and a v reset of the embed and
    shallow groups at steps 20 and 35, through the registry alone: 50 fp32 steps of both
    trainers agree (loss to 1e-5 relative, final parameters to 1e-5 of each tensor's
    scale), rho uses each tensor's eps, and on the reset steps (and the step after) both
    backends' grad_mom_cos equal cos(g_t, m_{t-1}) computed from the tensors, the torch
    side from its explicit m_{t-1} copy."""
    cfg = _cfg("--mitigation.eps_embed", "1e-3", "--mitigation.eps_shallow", "1e-4",
               "--mitigation.eps_deep", "1e-6", "--mitigation.v_reset_steps", "20,35",
               "--mitigation.v_reset_groups", "embed,shallow", "--optim.grad_clip", "0",
               "--train.loss_scale", "1", "--optim.lr", "5e-4")
    mit = lt.step_plan(cfg)
    assert len(set(mit.tensor_eps.values())) == 3 and set(mit.v_reset) == {20, 35}
    tel_steps = {1, 19, 20, 21, 35, 36, NUM_STEPS}
    seen, params, model = _run_both(cfg, tel_steps, explicit_m_prev=True)
    llama = cfg.model.llama()
    specs = spec_by_name(llama)
    reset = set(mit.v_reset[20])
    for step, jcols, tstats, tgrad, tmprev, prev_mu in seen:
        jrow = {n: i for i, n in enumerate(jcols["name"])}
        for i, name in enumerate(tstats.columns["name"]):
            j = jrow[name]
            for m in ("grad_rms", "rho", "update_rms", "rms_t", "grad_mom_cos"):
                t, jv = float(tstats.columns[m][i]), float(jcols[m][j])
                if np.isnan(t) or np.isnan(jv):
                    assert np.isnan(t) and np.isnan(jv), (step, name, m)
                    continue
                assert abs(t - jv) <= 1e-3 * abs(t) + 1e-5, (step, name, m, t, jv)
            rho_t = float(tstats.columns["rho"][i])
            grad_rms = float(tstats.columns["grad_rms"][i])
            assert rho_t == pytest.approx(grad_rms / mit.tensor_eps[name], rel=1e-9)
            if step in (20, 21, 35, 36):
                _check_cos(step, name, float(tstats.columns["grad_mom_cos"][i]),
                           tgrad[name].numpy(), tmprev[name].numpy())
                _check_cos(step, name, float(jcols["grad_mom_cos"][j]),
                           tgrad[name].numpy(), prev_mu[name])
            if step in (20, 35) and name in reset:
                # v_t = (1 - b2) g^2: rms_t = sqrt(mean(g^2 / max(v_hat, eps^2))) with
                # v_hat = (1 - b2) g^2 / (1 - b2^t), i.e. sqrt((1 - b2^t) / (1 - b2)) where
                # v_hat > eps^2
                b2, e = cfg.optim.b2, mit.tensor_eps[name]
                g2 = tgrad[name].double().numpy() ** 2
                want = math.sqrt(np.mean(g2 / np.maximum((1 - b2) * g2 / (1 - b2 ** step), e * e)))
                assert float(tstats.columns["rms_t"][i]) == pytest.approx(want, rel=1e-4), (step, name)
        assert specs  # names of both sides come from one spec table
    for name, p in model.named_parameters():
        pt, pj = p.detach().numpy(), np.asarray(params[name])
        np.testing.assert_allclose(pj, pt, rtol=0, atol=1e-5 * np.abs(pt).max(), err_msg=name)


def test_bias_correction_offset_matches_and_the_telemetry_reads_the_shifted_corrections():
    """optim.bias_correction_offset = 1 (the seed stack's NPU AdamW: corrections at t + 1,
    docs/results/seed_stack_adamw.md) with update clipping on (its rms_t uses this step's
    corrections, also on the torch side's first step, before the state exists): 50 fp32
    steps of both trainers agree (loss to 1e-5 relative, final parameters to 1e-5 of each
    tensor's scale), the per-tensor telemetry agrees, and both backends' rms_t equals
    sqrt(mean(g^2 / max(v_hat, eps^2))) with v_hat = v_t / (1 - b2^(t+1)) (on step 1:
    sqrt(1 + b2) where g^2 >> eps^2, against 1 for torch's AdamW)."""
    cfg = _cfg("--optim.bias_correction_offset", "1", "--mitigation.update_clip", "true",
               "--optim.grad_clip", "0", "--train.loss_scale", "1", "--optim.lr", "5e-4")
    tel_steps = {1, 2, 30, NUM_STEPS}
    seen, params, model = _run_both(cfg, tel_steps, explicit_m_prev=False)
    b2, eps = cfg.optim.b2, cfg.optim.eps
    for step, jcols, tstats, tgrad, _tmprev, _prev_mu in seen:
        jrow = {n: i for i, n in enumerate(jcols["name"])}
        for i, name in enumerate(tstats.columns["name"]):
            j = jrow[name]
            for m in METRIC_NAMES:
                t, jv = float(tstats.columns[m][i]), float(jcols[m][j])
                if np.isnan(t) or np.isnan(jv):
                    assert np.isnan(t) and np.isnan(jv), (step, name, m)
                    continue
                tol = 2.0 / tgrad[name].numel() if m in ("sat_frac", "eps_frac") else 1e-3 * abs(t) + 1e-5
                assert abs(t - jv) <= tol, (step, name, m, t, jv)
            if step == 1:   # v_1 = (1 - b2) g^2, corrected by 1 - b2^2
                g2 = tgrad[name].double().numpy() ** 2
                want = math.sqrt(np.mean(g2 / np.maximum((1 - b2) * g2 / (1 - b2 ** 2), eps * eps)))
                assert float(tstats.columns["rms_t"][i]) == pytest.approx(want, rel=1e-4), name
                assert float(jcols["rms_t"][j]) == pytest.approx(want, rel=1e-4), name
    assert float(dict(zip(seen[0][2].columns["name"], seen[0][2].columns["rms_t"]))[
        "output.weight"]) == pytest.approx(math.sqrt(1 + b2), rel=1e-3)
    for name, p in model.named_parameters():
        pt, pj = p.detach().numpy(), np.asarray(params[name])
        np.testing.assert_allclose(pj, pt, rtol=0, atol=1e-5 * np.abs(pt).max(), err_msg=name)


def test_freeze_groups_match_and_keep_adam_state_accumulating():
    """Layer freezing of the embed and shallow groups on steps 20..35 through the registry
    alone (weight decay on, so a frozen tensor would move without the freeze): 50 fp32 steps
    of both trainers agree (loss to 1e-5 relative, final parameters to 1e-5 of each tensor's
    scale); in both, the frozen tensors are bit-for-bit unchanged from step 19 to 35 and move
    again after; the other tensors move on every step; torch's m of a frozen tensor keeps
    changing (Adam state accumulates)."""
    cfg = _cfg("--mitigation.freeze_groups", "embed,shallow", "--mitigation.freeze_from", "20",
               "--mitigation.freeze_until", "35", "--optim.grad_clip", "0",
               "--train.loss_scale", "1", "--optim.lr", "5e-4")
    mit = lt.step_plan(cfg)
    assert mit.frozen_at(19) == () and mit.frozen_at(36) == ()
    frozen = set(mit.frozen_at(20))
    assert "tok_embeddings.weight" in frozen and "layers.0.attention.wq.weight" in frozen
    assert "layers.1.attention.wq.weight" not in frozen and "output.weight" not in frozen
    at: dict = {}
    _, params, model = _run_both(cfg, {1, 20, NUM_STEPS}, explicit_m_prev=False, params_at=at)
    for name in model.state_dict():
        j19, t19, m19 = (x[name] for x in at[19])
        j35, t35, m35 = (x[name] for x in at[35])
        j36, t36 = at[36][0][name], at[36][1][name]
        if name in frozen:
            np.testing.assert_array_equal(np.asarray(j35), np.asarray(j19), err_msg=name)
            assert torch.equal(t35, t19), name
            assert not np.array_equal(np.asarray(j36), np.asarray(j35)), name
            assert not torch.equal(t36, t35), name
            assert not torch.equal(m35, m19), name        # m still accumulates
        else:
            assert not np.array_equal(np.asarray(j35), np.asarray(j19)), name
            assert not torch.equal(t35, t19), name
    for name, p in model.named_parameters():
        pt, pj = p.detach().numpy(), np.asarray(params[name])
        np.testing.assert_allclose(pj, pt, rtol=0, atol=1e-5 * np.abs(pt).max(), err_msg=name)
