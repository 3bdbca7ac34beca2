"""simulate.program's step with the telemetry's (b1, b2, eps) as traced inputs (issue 37,
compile once): the same bits as the old program with them compiled in as constants, and
runs that differ only in them share one compiled program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from adamspike.train_config import RunConfig
from simulate import llama_train as lt
from simulate.program import Program


def _cfg(eps):
    return RunConfig.from_dict({
        "model.preset": "tiny", "model.dim": 16, "model.num_layers": 1, "model.num_heads": 2,
        "model.num_kv_heads": 1, "model.vocab_size": 64, "model.ffn_dim": 32,
        "optim.lr": 1e-2, "optim.schedule": "constant", "optim.warmup_steps": 1,
        "optim.b2": 0.95, "optim.eps": eps, "optim.grad_clip": 1.0,
        "optim.weight_decay": 0.1, "train.num_steps": 3, "train.global_batch_size": 2,
        "train.seq_len": 8, "data.task": "copy"})


def _steps(step, prog, cfg, tel, native):
    """Three steps, the last with histograms (report 2), every output and the params."""
    data = lt.dataset(cfg, prog.llama)
    params, state = prog.init(0)
    ctl = prog.controls(cfg, [1, 2, 3])
    got = []
    for i in range(3):
        batch = jnp.asarray(lt.batch_at(data, cfg, i + 1))
        params, state, out = step(params, state, batch, ctl.at(i), tel, True, native,
                                  report=np.int32(2 if i == 2 else 1))
        got.append(jax.device_get(out))
    return got, jax.device_get(params)


@pytest.mark.parametrize("native", [True, False])
def test_traced_telemetry_constants_give_the_static_programs_bits(native):
    # bit for bit: the same XLA operations run, on inputs instead of constants (float32 b1,
    # b2, eps in XLA's path; the native loop reads b1 and eps as float64 bit patterns)
    cfg = _cfg(2e-3)
    prog = Program(cfg)
    tel = prog.telemetry_spec(cfg)
    static = jax.jit(prog.step, static_argnames=("tel", "hist", "native", "with_grads"))
    old, old_p = _steps(static, prog, cfg, tel, native)
    new, new_p = _steps(prog.step_fn, prog, cfg, tel, native)
    assert set(old[2]) >= {"sums", "hists", "vhists", "g_below_eps"}
    for a, b in zip(old, new):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    for a, b in zip(jax.tree.leaves(old_p), jax.tree.leaves(new_p)):
        np.testing.assert_array_equal(a, b)


def test_runs_differing_only_in_eps_share_one_compiled_step():
    prog = Program(_cfg(2e-3))
    outs = {}
    for eps in (2e-3, 2e-6):
        cfg = _cfg(eps)
        outs[eps] = _steps(prog.step_fn, prog, cfg, prog.telemetry_spec(cfg), True)[0]
    assert prog._step_jit._cache_size() == 1
    # the telemetry did read each run's eps: #sqrt(v_hat) < eps differs
    assert not np.array_equal(outs[2e-3][2]["sums"], outs[2e-6][2]["sums"])


def test_a_trainer_run_compiles_its_programs_not_one_per_tensor_shape(tmp_path):
    """A trainer run (a fresh process, so no program is in memory yet) compiles its step,
    its init and the PRNG seed's and one host array's programs, nothing per tensor shape:
    eager jnp operations outside the jitted functions (the optimizer state's zeros per
    parameter shape, `jnp.asarray` of each batch shape) compiled 16 programs here before
    the rule (docs/design.md: host code stays on the host). JAX logs every compile, a
    persistent-cache hit included, with JAX_LOG_COMPILES=1."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "study", "simulate", "llama", "--config",
                        str(root / "configs" / "toy_spike.toml"), "--out", str(tmp_path / "run"),
                        "--train.num_steps", "4", "--no-progress"],
                       env={**os.environ, "JAX_LOG_COMPILES": "1", "PYTHONPATH": str(root)},
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    names = re.findall(r"Compiling (jit\([^)]*\))", r.stderr)
    assert names, "no compile logged (JAX_LOG_COMPILES not honoured?)"
    allowed = {"jit(step)", "jit(_init_from_key)", "jit(_threefry_seed)", "jit(stage)"}
    assert set(names) <= allowed, sorted(set(names) - allowed)
    assert len(names) <= 6, names
