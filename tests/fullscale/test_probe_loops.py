"""The probe's skip and the rerun's checkpoint-and-exit on the loops users run: vendored
excerpts of MindSpeed-LLM's and Megatron-LM's train() (tests/fullscale/upstream_loops.py,
sources and commits in its header) with megatron-core's rerun state machine, a GPTModel,
DDP and the distributed optimizer on 2 gloo ranks (real processes:
tests/fullscale/loops_worker.py). 6 iterations of 2 micro batches per rank; the batches of
logged iterations 3 and 4 are to be skipped; a NaN forward result (Megatron's
--check-for-nan-in-loss-and-grad, fatal, reproducible) at logged iteration 4 in the rerun
scenarios.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
TRAINED_WITHOUT_3_4 = [1, 2, 5, 6]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    out = tmp_path_factory.mktemp("loops")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    port = _port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "loops_worker.py"), "--rank", str(r),
                               "--port", str(port), "--out", str(out)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]

    def get(name):
        return [json.loads((out / name / f"rank{r}.json").read_text()) for r in range(2)]
    get.logs = logs
    get.out = out
    return get


def _iterations(r):
    return sorted({logged for logged, _ in r["trained"]})


def _batches(r):
    return sorted(idx for _, idx in r["trained"])


@pytest.mark.slow
def test_mindspeed_llm_loop_skips_only_with_the_probe(res):
    """MindSpeed-LLM's loop has no iterations_to_skip: the flag's values change nothing;
    the probe's list skips logged 3 and 4 on both ranks: their 4 micro batches are drawn
    (batches 4-7 never trained), no Adam step, no lr-schedule step, the samples counted."""
    for r in res("ms_bare_skip"):
        assert _iterations(r) == [1, 2, 3, 4, 5, 6] and r["adam_steps"] == [6]
    for r in res("ms_probe_skip"):
        assert _iterations(r) == TRAINED_WITHOUT_3_4
        assert _batches(r) == [0, 1, 2, 3, 8, 9, 10, 11]
        assert r["adam_steps"] == [4] and r["sched_steps"] == 4
        assert r["iteration"] == 6 and r["consumed"] == 6 * 8
    events = [json.loads(x) for x in (res.out / "ms_probe_skip" / "run" / "events.jsonl")
              .read_text().splitlines()]
    skips = [e for e in events if e["type"] == "skip"]
    assert [e["step"] for e in skips] == [3, 4]
    assert all("ADAMSPIKE_PROBE_SKIP_ITERATIONS" in e["reason"] for e in skips)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["m012_flag_and_probe", "m012_probe_only", "m016_flag_and_probe",
                                  "m017_flag", "m017_flag_and_probe", "ml2024_probe_skip"])
def test_megatron_loops_skip_the_same_batches_never_twice(res, name):
    """core_v0.12-0.16 (values 2 3: 0-based) and core_v0.17+ (values 3 4: the logged
    numbers) skip the same batches as the probe's list; with both, the loop skips first
    and the probe never sees those iterations (no further skip). ModelLink 2024's loop (the
    seed's stack: 4 return values, no skip list): the probe's list alone."""
    for r in res(name):
        assert _iterations(r) == TRAINED_WITHOUT_3_4 and _batches(r) == [0, 1, 2, 3, 8, 9, 10, 11]
        assert r["adam_steps"] == [4] and r["sched_steps"] == 4 and r["consumed"] == 48


@pytest.mark.slow
def test_rerun_checkpoint_and_exit_on_mindspeed_llm_as_on_megatron(res):
    """A reproducible fatal result at logged iteration 4: Megatron's loop saves at its
    iteration 3 and exits 16 (EXIT_CODE_RESUME_TO_DISAMBIGUATE); MindSpeed-LLM's loop alone
    ignores it (no checkpoint, trains on until the rerun machine raises); with the probe it
    saves at the same iteration and exits with the same code, on both ranks, exactly once."""
    for r in res("ms_rerun_bare"):
        assert r["exit_code"] is None and r["saves"] == [] and r["error"] == "Should not be here"
        assert r["iteration"] > 3
    for name in ("ms_rerun_probe", "m012_rerun_probe"):
        for r in res(name):
            assert r["exit_code"] == 16 and r["saves"] == [3] and r["iteration"] == 3
            assert r["adam_steps"] == [3] and r["error"] is None
    assert any("the rerun state machine stopped the job (exit code 16, checkpoint saved)" in log
               for log in res.logs)


def test_loop_facts_from_the_vendored_upstream_loops():
    """fullscale.probe.loop reads what each loop does from its source."""
    sys.path.insert(0, str(HERE))
    import upstream_loops as L

    from fullscale.probe.loop import LoopFacts
    import inspect
    facts = {n: LoopFacts(n, inspect.getsource(getattr(L, n)))
             for n in ("train_mindspeed_llm", "train_megatron_0_12", "train_megatron_0_17",
                       "train_megatron_0_16", "train_modellink_2024")}
    ms, m12, m17, m16, ml = facts.values()
    assert (m16.skips_itself, m16.skip_base, m16.honours_exit, m16.returns) == (True, 0, True, 8)
    assert (ml.skips_itself, ml.honours_exit, ml.returns) == (False, False, 4)
    assert (ms.skips_itself, ms.honours_exit, ms.returns) == (False, False, 7)
    assert (m12.skips_itself, m12.skip_base, m12.honours_exit, m12.returns) == (True, 0, True, 7)
    assert (m17.skips_itself, m17.skip_base, m17.honours_exit, m17.returns) == (True, 1, True, 8)
