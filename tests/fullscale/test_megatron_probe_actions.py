"""The Megatron probe acts and fails open: megatron-core on 2 gloo ranks (real processes).

tests/fullscale/megatron_worker.py --scenarios runs a Megatron-shaped train_step (zero
grad buffers, megatron's forward/backward schedule over 2 micro batches, finalize_model_grads,
optimizer.step(), Megatron's return value; bf16, distributed optimizer, data parallel 2)
wrapped exactly as install() wraps Megatron's, 12 steps per scenario, rules with window 6:

- off / on: the probe (rules, skip-step and telemetry on) leaves the loss trace bit for bit;
- skip: a loss spike injected at step 10 (the loss function's value x30, so the gradient
  too) is skipped on both ranks: the trace equals the probe-off run whose train_step does
  not apply step 10's update (off_spike_skipped), and events.jsonl has spike, skip and
  restart_recipe events, one printed line;
- budget: spikes at 8, 10, 12 with a budget of 2: 8 and 10 skipped, 12 applied and the
  probe.skip_budget alarm raised;
- error_rank0: a ProbeError on rank 0 only (step 4): the probe is off on both ranks, one
  line printed, training runs on with the probe-off trace;
- disk_full: OSError ENOSPC on the writer rank (step 3): same;
- error_layout_rank1: a ProbeError on rank 1 while the tensor layout is built (step 1, after
  the names were gathered): same;
- skip_pp2: the same spike with pipeline parallel 2: both stages skip step 10;
- hang_rank0: rank 0 hangs 5 s inside the probe (step 3); the probe's collectives time out
  after 2 s (its own gloo group), the probe is off on both ranks and training runs on.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("megatron_worker.py")
SCENARIOS = ("off", "off_spike_skipped", "on", "skip", "budget", "error_rank0", "disk_full",
             "error_layout_rank1",
             "off_spike_skipped_pp2", "skip_pp2", "hang_rank0")
LINE = "adamspike probe:"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("actions")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    port = _port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--rank", str(r), "--port", str(port),
                               "--out", str(out), "--steps", "12", "--scenarios", ",".join(SCENARIOS)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]

    def lines(name):   # the probe's printed lines of one scenario, per rank
        got = []
        for r, log in enumerate(logs):
            body = log.split(f"=== start {name} rank {r}")[1].split(f"=== end {name} rank {r}")[0]
            got.append([x for x in body.splitlines() if x.startswith(LINE)])
        return got

    def res(name):
        return [json.loads((out / name / f"rank{r}.json").read_text()) for r in range(2)]

    def events(name):
        p = out / name / "run" / "events.jsonl"
        return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []

    return {"res": res, "lines": lines, "events": events, "out": out}


def _trace(r):
    return np.array(r["loss"])


@pytest.mark.slow
def test_probe_on_leaves_the_loss_trace_bit_for_bit(runs):
    off, on = runs["res"]("off"), runs["res"]("on")
    for r in range(2):
        np.testing.assert_array_equal(_trace(on[r]), _trace(off[r]))
        assert on[r]["skips"] == 0 and not on[r]["disabled"] and not any(on[r]["skipped"])
        # the rules judge Megatron's numbers: the loss train_step reports and the grad norm
        # optimizer.step() computes (before clipping), both known before the update
        loss_in, gn_in = np.array(on[r]["rule_inputs"], dtype=float).T
        np.testing.assert_allclose(loss_in, _trace(on[r]), rtol=1e-6)
        np.testing.assert_allclose(gn_in, np.array(on[r]["grad_norm"], dtype=float), rtol=1e-5)


@pytest.mark.slow
def test_online_alarms_are_the_offline_decision(runs):
    """predictions.json's armed rules on the probe's telemetry (every 2 steps) fire where
    analysis.alarms.fire_steps, the offline evaluation, fires them; the rule marked
    uninformative stays unarmed; each alarm is an event and one printed line."""
    from adamspike.predictions import AlarmRule
    from adamspike.rundir import load_run
    from analysis.alarms import fire_steps

    sys.path.insert(0, str(WORKER.parent))
    from megatron_worker import PREDICTION_RULES

    run = load_run(runs["out"] / "on" / "run")
    online = run.events[run.events["type"] == "alarm"][["rule", "step"]].astype({"step": int})
    rules = [AlarmRule(**r) for r in PREDICTION_RULES if r.get("informative") is not False]
    offline = fire_steps(rules, run.layers)[["rule", "step"]]
    assert len(online) >= 2 and set(online["rule"]) == {"sat", "rms_t_2"}
    assert sorted(map(tuple, online.values.tolist())) == sorted(map(tuple, offline.values.tolist()))
    lines = runs["lines"]("on")
    assert lines[0] == [] and len(lines[1]) == len(online)
    assert all(" ALARM " in x for x in lines[1])


@pytest.mark.slow
def test_injected_loss_spike_is_skipped_on_both_ranks_and_logged(runs):
    on, ref = runs["res"]("skip"), runs["res"]("off_spike_skipped")
    for r in range(2):
        assert on[r]["skipped"] == [int(s == 10) for s in range(1, 13)]
        assert on[r]["skips"] == 1 and not on[r]["disabled"]
        # the trace equals the probe-off run that does not apply step 10's update
        np.testing.assert_array_equal(_trace(on[r]), _trace(ref[r]))
        # and the probe-off run without the spike before it
        np.testing.assert_array_equal(_trace(on[r])[:9], _trace(runs["res"]("off")[r])[:9])
    ev = runs["events"]("skip")
    spikes = [e for e in ev if e["type"] == "spike"]
    assert {e["rule"] for e in spikes} == {"probe.loss", "probe.grad_norm"}
    assert all(e["step"] == 10 and e["action"] == "skip" for e in spikes)
    assert [e["step"] for e in ev if e["type"] == "skip"] == [10]
    assert "probe: loss spike" in next(e for e in ev if e["type"] == "skip")["reason"]
    recipe = next(e for e in ev if e["type"] == "restart_recipe")
    assert recipe["step"] == 10 and Path(recipe["path"]).is_file()
    assert "--iterations-to-skip" in Path(recipe["path"]).read_text()
    lines = runs["lines"]("skip")
    assert lines[0] == [] and len(lines[1]) == 1          # one line, from the log rank
    assert "step 10: loss spike" in lines[1][0] and "skipped on every rank" in lines[1][0]
    from adamspike.rundir import load_run
    run = load_run(runs["out"] / "skip" / "run")
    assert list(run.steps.loc[run.steps["skipped"], "step"]) == [10]


@pytest.mark.slow
def test_pipeline_stages_skip_together(runs):
    """Pipeline parallel 2: the loss exists on the last stage only; the first stage skips the
    same update by the all-reduced decision."""
    on, ref = runs["res"]("skip_pp2"), runs["res"]("off_spike_skipped_pp2")
    for r in range(2):
        assert on[r]["skipped"] == [int(s == 10) for s in range(1, 13)] and on[r]["skips"] == 1
    assert np.isnan(_trace(on[0])).all()                    # stage 0 has no loss
    assert np.isfinite(_trace(on[1])).all() and _trace(on[1])[9] > 50   # the spike, on stage 1
    np.testing.assert_array_equal(_trace(on[1]), _trace(ref[1]))
    assert [e["step"] for e in runs["events"]("skip_pp2") if e["type"] == "skip"] == [10]


@pytest.mark.slow
def test_skip_budget_runs_out_and_the_alarm_fires(runs):
    res = runs["res"]("budget")
    for r in range(2):
        assert [i + 1 for i, s in enumerate(res[r]["skipped"]) if s] == [8, 10]
        assert res[r]["skips"] == 2
        assert res[r]["loss"][11] > 50                   # step 12's spike, applied
    ev = runs["events"]("budget")
    alarms = [e for e in ev if e["type"] == "alarm"]
    assert [(e["rule"], e["step"]) for e in alarms] == [("probe.skip_budget", 12)]
    assert {e["action"] for e in ev if e["type"] == "spike" and e["step"] == 12} == \
        {"none: skip budget spent"}
    lines = runs["lines"]("budget")[1]
    assert len(lines) == 3 and "ALARM skip budget spent" in lines[2]


@pytest.mark.slow
@pytest.mark.parametrize("name,rank,step,what", [
    ("error_rank0", 0, 4, "ProbeError: injected error on one rank"),
    ("disk_full", 1, 4, "No space left on device"),
    ("error_layout_rank1", 1, 1, "ProbeError: injected error on one rank"),   # after the gather
])
def test_probe_error_on_one_rank_disables_it_everywhere_and_training_runs_on(runs, name, rank,
                                                                             step, what):
    res, off = runs["res"](name), runs["res"]("off")
    for r in range(2):
        assert res[r]["disabled"] and len(res[r]["loss"]) == 12
        np.testing.assert_array_equal(_trace(res[r]), _trace(off[r]))
    assert what in res[rank]["reason"] and res[1 - rank]["reason"] == "an error on another rank"
    lines = runs["lines"](name)
    assert [len(x) for x in lines] == [int(rank == 0), int(rank == 1)]     # one line in all
    assert f"disabled on every rank at step {step} (rank {rank}: " in lines[rank][0]


@pytest.mark.slow
def test_hung_rank_times_out_the_probe_not_the_job(runs):
    res, off = runs["res"]("hang_rank0"), runs["res"]("off")
    for r in range(2):
        assert res[r]["disabled"] and len(res[r]["loss"]) == 12
        np.testing.assert_array_equal(_trace(res[r]), _trace(off[r]))
    assert "Timed out" in res[1]["reason"]
    assert res[1]["seconds"] < 60                       # 2 s probe timeout, not the job's
    assert all(len(x) <= 1 for x in runs["lines"]("hang_rank0"))
