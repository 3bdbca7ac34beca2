"""The phase map's JAX side: Program.stability against a dense eigendecomposition, the
curvature-tracking run against the plain run, and a tiny map end to end (resumable)."""

import json

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

from adamspike.train_config import RunConfig
from simulate import optim as jopt
from simulate.program import Program, secant_init, secant_readings, secant_update
from simulate.seeds import arm_tokens
from study.cli import main as cli

# a model small enough for a dense Hessian (856 parameters)
DENSE = {"model.preset": "tiny", "model.vocab_size": 16, "model.dim": 8, "model.num_layers": 1,
         "model.ffn_dim": 16,
         "model.num_heads": 2, "model.num_kv_heads": 1, "model.max_seq_len": 8,
         "train.seq_len": 8, "train.global_batch_size": 2, "train.num_steps": 20,
         "optim.lr": 1e-2, "optim.warmup_steps": 2, "optim.b2": 0.95, "optim.eps": 1e-3,
         "optim.grad_clip": 1.0, "data.task": "zipf", "data.zipf_exponent": 1.1,
         "train.dtype": "fp32"}


@pytest.fixture(scope="module")
def prog():
    """The DENSE model's one Program for the whole module: the loss scale (4 in some tests)
    is a control, so every config here shares its compiled step, runs and curvature."""
    return Program(RunConfig.from_dict(DENSE))


@pytest.fixture(scope="module")
def stab(prog):
    """Program.stability compiled once (the phase map's check and simulate.batch_sharpness
    call it jitted too)."""
    return jax.jit(prog.stability, static_argnames=("num_iters", "precondition"))


@pytest.fixture(scope="module")
def hessian(prog):
    """hessian(flat, batch, s): the dense Hessian of s * loss over the flattened parameters,
    as one compiled program for every test (eagerly, jax.hessian compiled each of its
    primitives apart: ~500 small programs, 38 s of the first test on 2 loaded cores)."""
    _, unravel = jax.flatten_util.ravel_pytree(prog.init(0)[0])
    fn = jax.jit(jax.hessian(lambda x, b, s: prog.loss(unravel(x), b, s)[0]))
    return lambda flat, batch, s: np.asarray(fn(flat, batch, jnp.float32(s)), np.float64)


def _trained(prog, cfg):
    """(params, state, last batch, controls) after 20 trainer steps of seed 0."""
    ctl = prog.controls(cfg, range(1, 21))
    tokens = arm_tokens(cfg, [0])[0]
    params, state = prog.init(0)
    for s in range(20):
        params, state, _ = prog.step_fn(params, state, jnp.asarray(tokens[s]), ctl.at(s))
    return params, state, jnp.asarray(tokens[19]), ctl


def test_stability_is_the_top_eigenvalue_of_the_preconditioned_hessian(prog, stab, hessian):
    params, state, batch, ctl = _trained(prog, RunConfig.from_dict(DENSE))
    c = ctl.at(19)._replace(lr=np.float32(1e-2))   # the schedule's last lr is 0: S would be 0
    u0 = jax.tree.map(lambda p: jnp.ones_like(p), params)
    S, _ = stab(params, state, batch, c, u0, num_iters=400)
    # dense: P^(1/2) H P^(1/2) of the flattened parameters
    flat, _ = jax.flatten_util.ravel_pytree(params)
    hess = hessian(flat, batch, c.loss_scale)
    adam = jopt.adam_state(state)
    t = float(adam.count)
    nu, _ = jax.flatten_util.ravel_pytree(adam.nu)
    eps, _ = jax.flatten_util.ravel_pytree(prog.tree([jnp.full(p.shape, c.eps[i]) for i, p in
                                                       enumerate(jax.tree.leaves(params))]))
    ct = (1 - 0.9) / (1 + 0.9) / (1 - 0.9 ** t)
    root = np.sqrt(ct / (np.sqrt(np.asarray(nu) / (1 - 0.95 ** t)) + np.asarray(eps)))
    ev = np.linalg.eigvalsh(root[:, None] * hess * root[None, :])
    top = ev[np.argmax(np.abs(ev))]          # power iteration finds the largest magnitude
    assert abs(top) > 1.0                    # a real curvature, not 0 = 0
    # 400 float32 products from a flat start: the top two magnitudes are 14.6 and 12.4
    # (ratio 0.85, 0.85^400 ~ 1e-28), so the Rayleigh quotient is converged to fp32 rounding
    np.testing.assert_allclose(float(S), float(c.lr) * top / 2, rtol=1e-3)


def test_sharpness_is_the_top_eigenvalue_of_the_hessian(prog, stab, hessian):
    params, state, batch, ctl = _trained(prog, RunConfig.from_dict({**DENSE, "train.loss_scale": 4.0}))
    c = ctl.at(19)
    u0 = jax.tree.map(lambda p: jnp.ones_like(p), params)
    lam, _ = stab(params, state, batch, c, u0, num_iters=400, precondition=False)
    flat, _ = jax.flatten_util.ravel_pytree(params)
    # the unscaled loss: sharpness does not move with the loss scale (H_s = s H)
    hess = hessian(flat, batch, 1.0)
    ev = np.linalg.eigvalsh(hess)
    top = ev[np.argmax(np.abs(ev))]
    gap = np.sort(np.abs(ev))[-2] / abs(top)
    assert abs(top) > 1.0 and gap < 0.95    # converged well within 400 products (gap^400)
    np.testing.assert_allclose(float(lam), top, rtol=1e-3)


def test_the_curvature_run_trains_the_same_lanes(prog):
    cfg = RunConfig.from_dict(DENSE)
    tokens = arm_tokens(cfg, [0, 1])
    ctl = prog.controls(cfg, range(1, 21))
    plain = prog.run([0, 1], tokens, ctl)
    curv = prog.run([0, 1], tokens, ctl, curvature_every=5)
    # another compiled program (a scan over blocks of 5 steps): fp32 rounding, not bits;
    # measured worst relative difference 0 to 2e-7 on this model
    np.testing.assert_allclose(curv["loss"], plain["loss"], rtol=1e-5)
    assert curv["stability"].shape == (2, 4)
    assert np.isfinite(curv["stability"]).all()
    both = prog.run([0, 1], tokens, ctl, curvature_every=5, sharpness=True)
    assert both["sharpness"].shape == (2, 4) and (both["sharpness"] > 0).all()
    # the same stability iteration beside a second one: another compiled program again
    np.testing.assert_allclose(both["stability"], curv["stability"], rtol=1e-4)
    np.testing.assert_allclose(both["loss"], plain["loss"], rtol=1e-5)


def test_the_secant_proxy_is_the_curvature_along_the_update(prog, stab, hessian):
    """On one fixed batch (no minibatch noise) the proxy's first term (g_t - g_{t-1}) . u_{t-1}
    is u' H u at the segment's midpoint (a secant), and its reading is a Rayleigh quotient,
    so it cannot exceed the top eigenvalue's."""
    cfg = RunConfig.from_dict({**DENSE, "train.loss_scale": 4.0})
    ctl = prog.controls(cfg, range(1, 21))
    batch = jnp.asarray(arm_tokens(cfg, [0])[0][0])
    params, state = prog.init(0)
    sec = secant_init(params)
    for s in range(12):
        c = ctl.at(s)._replace(lr=np.float32(1e-3))
        new, state, out = prog.step_fn(params, state, batch, c, with_grads=True)
        sec, terms = secant_update(sec, out["grads"], new, params, prog._pinv(state, c))
        if s == 10:
            before, u_prev = params, jax.tree.map(jnp.subtract, new, params)
        params = new
    flat, _ = jax.flatten_util.ravel_pytree(before)
    u, _ = jax.flatten_util.ravel_pytree(u_prev)
    mid = flat + u / 2
    hess = hessian(mid, batch, 4.0)
    uhu = float(np.asarray(u, np.float64) @ hess @ np.asarray(u, np.float64))
    # the midpoint rule's error is third order in |u| (0.017 here; H at the segment's start
    # is 12 % off, so H does move along u) and the fp32 gradient difference loses
    # ~1e-7 |g| / |g_t - g_{t-1}|: measured 0.14 % apart; 1 % leaves room for rounding
    np.testing.assert_allclose(float(terms[0]), uhu, rtol=1e-2)
    S_sec, lam_sec = secant_readings(terms, 1e-3, 4.0)
    S_top, _ = stab(params, state, batch, c, jax.tree.map(jnp.ones_like, params),
                    num_iters=400)
    assert 0 < float(S_sec) <= float(S_top) * 1.001     # a Rayleigh quotient of the same operator
    # the unscaled reading: u' H u / |u|^2 of the loss, not of 4 x loss
    np.testing.assert_allclose(float(lam_sec), uhu / float(terms[2]) / 4.0, rtol=1e-2)


def test_the_secant_run_trains_the_same_lanes(prog):
    cfg = RunConfig.from_dict(DENSE)
    tokens = arm_tokens(cfg, [0, 1])
    ctl = prog.controls(cfg, range(1, 21))
    # the curvature run of test_the_curvature_run_trains_the_same_lanes: the module's one
    # Program keeps its compiled scan, so this reruns it without compiling again
    plain = prog.run([0, 1], tokens, ctl, curvature_every=5)
    sec = prog.run([0, 1], tokens, ctl, curvature_every=5, secant=True)
    # another compiled program (the gradients kept for the proxy): fp32 rounding, not bits
    np.testing.assert_allclose(sec["loss"], plain["loss"], rtol=1e-5)
    np.testing.assert_allclose(sec["stability"], plain["stability"], rtol=1e-4)
    assert sec["S_secant"].shape == (2, 4) and np.isfinite(sec["S_secant"]).all()
    assert sec["sharpness_secant"].shape == (2, 4)


def test_a_tiny_map_end_to_end_and_resumed(tmp_path, monkeypatch):
    base = tmp_path / "base.toml"
    base.write_text("""
[model]
preset = "tiny"
vocab_size = 64
dim = 16
num_layers = 2
num_heads = 2
num_kv_heads = 1
max_seq_len = 16
[optim]
lr = 1e-3
min_lr = 1e-4
schedule = "cosine"
warmup_steps = 10
b2 = 0.95
eps = 1e-3
weight_decay = 0.1
grad_clip = 1.0
[train]
num_steps = 40
global_batch_size = 4
seq_len = 16
dtype = "fp32"
[data]
task = "zipf"
zipf_exponent = 1.1
""")
    cfg = tmp_path / "map.toml"
    cfg.write_text(f"""
[map]
title = "tiny map"
base = "{base}"
seeds = 2
lr_mult = [1, 100]
b2 = [0.95]
batch_mult = [1]
curvature_every = 10
calibrate = {{ rounds = 1, seeds = 2, steps = 20 }}
check = {{ steps = 20, every = 10, lr_mult = [100], seeds = 1 }}
[targets]
embed = 0.7
shallow = 0.9
deep = 0.2
head = 2.8
[spikes]
window = 10
""")
    out = tmp_path / "map"
    assert cli(["phase-map", "--config", str(cfg), "--out", str(out), "--no-progress"]) == 0
    table = pd.read_csv(out / "phase_map.csv")
    assert sorted(table["lr_mult"]) == [1, 100]
    assert (table["num_seeds"] == 2).all() and (table["num_steps"] == 40).all()
    assert {"rho_embed", "rho_shallow", "rho_deep", "rho_head", "rate_10", "rate_10_hi",
            "S_median", "mechanism"} <= set(table.columns)
    # a larger lr, a larger stability number (the point of the lr axis)
    assert table.set_index("lr_mult").loc[100, "S_median"] > table.set_index("lr_mult").loc[1, "S_median"]
    check = pd.read_csv(out / "stability_check.csv")
    assert len(check) == 2 and np.isfinite(check["S_power"]).all()
    assert np.isfinite(check["S_secant"]).all()
    assert "online proxy S_secant" in (out / "phase_map.md").read_text()
    meta = json.loads((out / "map.json").read_text())
    assert len(meta["calibration"]) == 2 and len(meta["cells"]) == 2
    assert "Phase map" in (out / "phase_map.md").read_text() or "tiny map" in (out / "phase_map.md").read_text()
    # resumed: nothing reruns (the cells' files are kept as they are; calibrating, a cell or
    # the check would fail the call)
    mtimes = {p.name: p.stat().st_mtime_ns for p in (out / "cells").rglob("*")}
    assert {p.parent.name for p in (out / "cells").rglob("*.json")} == {"phase_map_cell",
                                                                      "calibration"}
    from simulate import claims, phase_map

    def recomputed(*args, **kwargs):
        raise AssertionError("the resumed map recomputed")
    monkeypatch.setattr(claims, "calibrate", recomputed)     # the calibration cells' computation
    for name in ("run_cell", "check_stability"):
        monkeypatch.setattr(phase_map, name, recomputed)
    assert cli(["phase-map", "--config", str(cfg), "--out", str(out), "--no-progress"]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in (out / "cells").rglob("*")} == mtimes


def test_a_bad_map_file_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "map.toml"
    cfg.write_text("[map]\nbase = 'configs/matched_replication.toml'\nseeds = 2\nlr_mult = 3\n")
    assert cli(["phase-map", "--config", str(cfg), "--out", str(tmp_path / "o")]) == 2
    assert "lr_mult" in capsys.readouterr().err


def test_cell_ids_of_configs_at_the_default_adamw_are_those_from_before_its_offset_setting():
    """The phase map's cell id of the default config (seeds 0, 1; K 10), pinned as main
    computed it before optim.bias_correction_offset existed: cached cells stay valid; a
    config with the seed stack's offset gets another id."""
    from adamspike.config import flatten, to_dict
    from simulate.phase_map import cell_id

    flat = flatten(to_dict(RunConfig()))
    assert cell_id(flat, [0, 1], 10) == "509d6bf9cd81"
    assert cell_id({**flat, "optim.bias_correction_offset": 1}, [0, 1], 10) != "509d6bf9cd81"
