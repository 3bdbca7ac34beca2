"""The seed stack's AdamW written out in numpy (docs/results/seed_stack_adamw.md), the
reference both backends' `optim.bias_correction_offset = 1` is tested against.

AscendSpeed 2023 (github:Ascend/AscendSpeed 64b1937a, ascendspeed/optimizer/adam.py) keeps
a per-tensor step, increments it before the update and hands the CANN kernel
torch_npu.npu_apply_adam_w(beta1 ** step, beta2 ** step, lr, wd, beta1, beta2, eps, grad,
None, False, False, out=(param, exp_avg, exp_avg_sq)); `apply_adam_w` is the kernel as
torch_npu states it in its own test (v2.1.0-5.0.rc3, test/test_network_ops/
test_apply_adam_w.py, cpu_op_exec): the powers it is given are multiplied by beta once
more before the bias corrections. numpy only (the python 3.8 + torch CI has no jax).
"""

import numpy as np


def apply_adam_w(var, m, v, beta1_power, beta2_power, lr, weight_decay, beta1, beta2, eps,
                 grad):
    """torch_npu.npu_apply_adam_w with amsgrad = maximize = False: (var, m, v) after."""
    m_out = m * beta1 - (beta1 + (-1)) * grad
    v_out = v * beta2 - (beta2 + (-1)) * grad * grad
    var_t = var * (1 + (-lr * weight_decay))
    beta1_power_out = beta1_power * beta1
    beta2_power_out = beta2_power * beta2
    denom = np.sqrt(v_out / (1 - beta2_power_out)) + eps
    var_out = var_t + (-lr * m_out / (1 - beta1_power_out)) / denom
    return var_out, m_out, v_out


def ascendspeed_adamw(params, grads_seq, lrs, b1, b2, eps, weight_decay, max_norm):
    """AscendSpeed 2023's optimizer step over `grads_seq` (a list, per step, of gradients
    like `params`): global-norm clip g * min(1, max_norm / (||g|| + 1e-6)) (max_norm 0:
    off), then per tensor step += 1 and apply_adam_w(b1 ** step, b2 ** step, ...) at the
    step's lr (`lrs[t - 1]`). eps: a float or one per tensor. Returns the parameters."""
    p = [np.array(x, np.float64) for x in params]
    m = [np.zeros_like(x) for x in p]
    v = [np.zeros_like(x) for x in p]
    eps = list(eps) if isinstance(eps, (list, tuple)) else [eps] * len(p)
    for step, grads in enumerate(grads_seq, start=1):
        norm = np.sqrt(sum((np.asarray(g, np.float64) ** 2).sum() for g in grads))
        coef = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0
        for i, g in enumerate(grads):
            p[i], m[i], v[i] = apply_adam_w(p[i], m[i], v[i], b1 ** step, b2 ** step,
                                            lrs[step - 1], weight_decay, b1, b2, eps[i],
                                            np.asarray(g, np.float64) * coef)
    return p
