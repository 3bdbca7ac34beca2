"""The JAX tiny LLaMA's bf16 compute path (train.dtype = "bf16"): float32 master parameters,
bfloat16 matmuls, float32 gradients, Adam state and telemetry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from adamspike.llama import LlamaConfig
from adamspike.rundir import load_run
from adamspike.train_config import RunConfig
from simulate import llama as jllama
from simulate.llama_train import train

CFG = LlamaConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_seq_len=16)


def _batch(seed=0):
    return jax.random.randint(jax.random.PRNGKey(seed), (4, 17), 0, CFG.vocab_size)


def test_bf16_loss_and_grads_close_to_fp32_and_float32():
    params = jllama.init_params(CFG, jax.random.PRNGKey(0))
    batch = _batch()
    # jitted, as the trainer runs it (eagerly, each of the ~300 primitives compiles apart)
    def vg(dtype):
        return jax.jit(jax.value_and_grad(
            lambda p, b: jllama.loss_fn(p, b, CFG, compute_dtype=dtype), has_aux=True))
    (l32, _), g32 = vg("fp32")(params, batch)
    (l16, _), g16 = vg("bf16")(params, batch)
    assert l16.dtype == jnp.float32
    # bf16 has an 8-bit mantissa: relative error ~ 2^-8 per op, a few ops deep
    assert abs(float(l16) - float(l32)) < 2e-2 * abs(float(l32))
    assert float(l16) != float(l32)          # bf16 really ran
    for n in params:
        assert g16[n].dtype == jnp.float32, n
        a, b = np.ravel(g32[n]), np.ravel(g16[n])
        if np.linalg.norm(a) > 0:
            cos = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
            assert cos > 0.99, (n, cos)


def test_bf16_matmuls_in_bfloat16():
    params = jllama.init_params(CFG, jax.random.PRNGKey(0))
    text = jax.jit(lambda p, b: jllama.loss_fn(p, b, CFG, compute_dtype="bf16")[0]).lower(
        params, _batch()).as_text()
    assert "bf16" in text
    assert "dot_general" in text and any("dot_general" in ln and "bf16" in ln
                                         for ln in text.splitlines())


def test_bad_compute_dtype():
    params = jllama.init_params(CFG, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="train.dtype"):
        jllama.loss_fn(params, _batch(), CFG, compute_dtype="fp16")


def test_trainer_bf16_run_keeps_fp32_state(tmp_path):
    over = {"model.vocab_size": 64, "model.dim": 32, "model.num_layers": 2,
            "model.num_heads": 4, "model.num_kv_heads": 2, "model.max_seq_len": 16,
            "train.seq_len": 16, "train.global_batch_size": 4, "train.num_steps": 20,
            "telemetry.hist_every": 0}
    runs = {}
    for dt in ("fp32", "bf16"):
        cfg = RunConfig.from_dict({**over, "train.dtype": dt})
        runs[dt] = load_run(train(cfg, tmp_path / dt, progress=False))
    s32, s16 = runs["fp32"].steps, runs["bf16"].steps
    assert len(s16) == 20 and np.isfinite(s16["loss"]).all()
    assert not np.array_equal(s32["loss"].to_numpy(), s16["loss"].to_numpy())
    np.testing.assert_allclose(s16["loss"], s32["loss"], rtol=3e-2)
    assert (s16["loss"].iloc[-5:].mean() < s16["loss"].iloc[:5].mean())   # it trains
