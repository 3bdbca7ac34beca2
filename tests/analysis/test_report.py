"""The report's spike rule resolution and optimizer parameters from either config form."""

import numpy as np
import pandas as pd

from analysis.fits import optim_params
from adamspike.spikes import SpikeParams, loss_spikes


def test_rule_resolution_for_quadratic_runs():
    t = np.arange(1, 3001)
    loss = 10.0 ** (-t / 20.0)                      # 150 decades, like simulate.quadratic
    loss[::7] = 1e-320                               # dips where theta crosses zero
    loss[2000:2010] = 10.0 ** (-100 + np.arange(10) * 5)  # a rise of ~50 decades
    steps = pd.DataFrame({"step": t, "loss": loss})
    sp, rule = loss_spikes(steps, config={"problem": {"kind": "quadratic"}})
    assert rule.log and rule.absorb and rule.envelope == 50
    # the running max lags a rise that starts below the previous 50 steps' maximum (1e-97.5
    # here): the spike is dated when the envelope itself jumps, 2 steps into the rise
    assert list(sp["start"]) == [2003]
    assert "50-step running max" in rule.describe()
    _, plain = loss_spikes(steps.assign(loss=2.0 + 0.01 * np.sin(t)))
    assert not plain.log and not plain.absorb and plain.envelope == 0


def test_optim_params_from_optim_or_problem():
    assert optim_params({"optim": {"b1": 0.9, "b2": 0.95, "eps": 1e-8}})["b2"] == 0.95
    p = optim_params({"problem": {"kind": "quadratic", "b1": 0.9, "b2": 0.999, "lr": 0.01}})
    assert (p["b1"], p["b2"], p["lr"], p["eps"]) == (0.9, 0.999, 0.01, None)
