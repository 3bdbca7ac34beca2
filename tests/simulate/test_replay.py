"""simulate.replay: the replay program is the trainer's step, the 'none' control reproduces
the base trace bit for bit, each intervention changes only what it names, and the study
cache resumes."""

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

from adamspike.config import ConfigError, flatten, to_dict
from adamspike.depth_groups import depth_group
from adamspike.llama import spec_by_name
from adamspike.train_config import RunConfig
from adamspike.rundir import load_run
from simulate import llama_train as lt
from simulate import replay as R
from simulate.program import program


def _cfg(**extra):
    base = {"model.preset": "tiny", "optim.lr": 1e-2, "optim.schedule": "constant",
            "optim.warmup_steps": 5, "optim.b2": 0.999, "optim.grad_clip": 0.0,
            "optim.weight_decay": 0.0, "train.num_steps": 100, "train.global_batch_size": 4,
            "train.seq_len": 16, "data.task": "copy"}
    return RunConfig.from_dict({**base, **extra})


def _controls(prog, cfg, first):
    return prog.controls(cfg, range(first, first + R.CHUNK))


def _run(prog, cfg, params, state, first, steps):
    data = lt.dataset(cfg, prog.llama)
    losses = []
    for s in range(first, first + steps, R.CHUNK):
        (params,), (state,), loss = R.run_chunk(
            prog, [params], [state], [R.chunk_batches(data, cfg, s)], [_controls(prog, cfg, s)])
        losses.extend(loss[0].tolist())
    return params, state, np.array(losses)


def _shallow(prog):
    L = prog.llama.num_layers
    specs = spec_by_name(prog.llama)
    return [depth_group(specs[n].depth, L) in ("embed", "shallow") for n in prog.names]


def test_replay_is_the_trainer_bit_for_bit_and_none_replays_bit_for_bit(tmp_path):
    cfg = _cfg()
    prog = program(cfg)
    p0, s0 = prog.init(0)
    p25, s25, first = _run(prog, cfg, p0, s0, 1, 25)
    _, _, rest = _run(prog, cfg, p25, s25, 26, 25)
    snap = jax.device_get((p25, s25))               # what the study keeps in memory
    _, _, again = _run(prog, cfg, *snap, 26, 25)
    np.testing.assert_array_equal(again, rest)      # determinism control: exact
    # the trainer runs the same compiled step on the same inputs: exact, on any CPU
    run = load_run(lt.train(RunConfig.from_dict({**flatten(to_dict(cfg)), "train.num_steps": 50,
                                                 "telemetry.enabled": False}),
                            tmp_path / "run", progress=False))
    np.testing.assert_array_equal(run.steps.sort_values("step")["loss"].to_numpy(),
                                  np.concatenate([first, rest]).astype(np.float32))


def test_each_intervention_changes_only_what_it_names():
    cfg = _cfg(**{"train.seed": 0})
    prog = program(cfg)
    t, restart = 60, 26
    lanes = {n: R.lane_config(cfg, R.intervention_overrides(n, cfg, t, restart, 20))
             for n in R.INTERVENTIONS}
    shallow = np.array(_shallow(prog))
    ctl = {n: _controls(prog, c, 51) for n, c in lanes.items()}    # steps 51..75
    first = {n: _controls(prog, c, 26) for n, c in lanes.items()}  # steps 26..50
    none = ctl["none"]
    for n, c in ctl.items():
        same = {f: np.array_equal(getattr(c, f), getattr(none, f))
                for f in ("lr", "skip", "frozen", "reset", "eps")}
        changed = {"none": set(), "eps_shallow": {"eps"}, "eps_deep": {"eps"}, "v_reset": set(),
                   "skip_window": {"skip"}, "freeze": {"frozen"}, "lr_half": {"lr"}}[n]
        assert {f for f, ok in same.items() if not ok} == changed, n
    assert np.array_equal(ctl["eps_shallow"].eps[0] != none.eps[0], shallow)
    assert np.array_equal(ctl["eps_deep"].eps[0] != none.eps[0], ~shallow)
    np.testing.assert_allclose(ctl["eps_shallow"].eps[:, shallow], 1e-9, rtol=1e-6)
    assert np.array_equal(first["v_reset"].reset[0], shallow) and not first["v_reset"].reset[1:].any()
    assert np.array_equal(np.flatnonzero(ctl["skip_window"].skip) + 51, np.arange(51, 61))
    assert ctl["freeze"].frozen.all(axis=0).tolist() == shallow.tolist()
    np.testing.assert_allclose(ctl["lr_half"].lr, 0.5 * none.lr)
    # effects over steps 26..50: frozen tensors keep their values (m, v still move); the skip
    # window [40, 60] leaves steps 26..40 bit-identical to the control (step 40's loss is
    # measured before its skipped update), later ones not
    p, s = prog.init(0)
    p, s, _ = _run(prog, cfg, p, s, 1, 25)
    out = {}
    for n in ("none", "freeze", "skip_window"):
        data = lt.dataset(cfg, prog.llama)
        (pn,), (sn,), loss = R.run_chunk(prog, [p], [s], [R.chunk_batches(data, cfg, 26)],
                                         [_controls(prog, lanes[n], 26)])
        out[n] = (pn, sn, loss[0])
    names = prog.names
    leaves = lambda tree: dict(zip(names, jax.tree.leaves(tree)))  # noqa: E731
    before, frozen_p = leaves(p), leaves(out["freeze"][0])
    nu0 = leaves(lt.jopt.adam_state(s).nu)
    nu1 = leaves(lt.jopt.adam_state(out["freeze"][1]).nu)
    for n, sh in zip(names, shallow):
        assert np.array_equal(frozen_p[n], before[n]) == bool(sh), n
        assert not np.array_equal(nu1[n], nu0[n]), n
    np.testing.assert_array_equal(out["skip_window"][2][:15], out["none"][2][:15])
    assert not np.array_equal(out["skip_window"][2][15:], out["none"][2][15:])
    with pytest.raises(ConfigError, match="optim.weight_decay"):
        R.lane_config(cfg, {"optim.weight_decay": 0.1})


def test_study_detects_a_poisoned_spike_replays_it_and_resumes(tmp_path, monkeypatch):
    # a low-entropy Markov source is learned by step 80 (loss ~1.2), so the poisoned batch
    # (every target = token 0) is a ~7x loss spike
    cfg = _cfg(**{"data.task": "markov", "data.alpha": 0.01, "data.poison_steps": [80]})
    spec = R.ReplaySpec(config=to_dict(cfg), seeds=[0], snapshot_every=25, min_lead=50,
                        max_lead=150, horizon=10, recur_window=5, skip_window=5)
    table = R.run_study(spec, tmp_path, progress=False)
    assert set(table["intervention"]) == set(R.INTERVENTIONS)
    row = table.set_index("intervention")
    assert row.loc["none", "spike_step"] == 80 and row.loc["none", "lead"] == 55
    assert bool(row.loc["none", "recurred"]) and bool(row.loc["none", "exact_trace"])
    # skipping the poisoned batch removes its spike
    assert not bool(row.loc["skip_window", "recurred"])
    summ = R.summarize(table)
    assert summ.loc[summ["intervention"] == "none", "ci_low"].item() == pytest.approx(0.025, abs=1e-3)
    # resume: nothing is recomputed
    monkeypatch.setattr(R, "replay_spike", lambda *a, **k: pytest.fail("recomputed"))
    monkeypatch.setattr(R, "run_base", lambda *a, **k: pytest.fail("recomputed"))
    again = R.run_study(spec, tmp_path, progress=False)
    pd.testing.assert_frame_equal(again, table, check_dtype=False, rtol=1e-12)
    other = R.ReplaySpec(config=to_dict(cfg), seeds=[0, 1], snapshot_every=25, min_lead=50,
                         max_lead=150, horizon=10)
    with pytest.raises(ConfigError, match="another replay study"):
        R.run_study(other, tmp_path, progress=False)
    md = R.write_outputs(tmp_path, table, spec, 1.0, "test")
    assert "| jax | none | 1 / 1 |" in md and (tmp_path / "replay.csv").is_file()


def test_incidents_merge_bursts_within_two_windows():
    # a start within 2 W of the previous start (chained) is the same incident
    spec = R.ReplaySpec(config=to_dict(_cfg()), seeds=[0], recur_window=10)
    spikes = pd.DataFrame({"start": [374, 376, 378, 381, 1184, 1334, 1337, 1355, 1376]})
    assert spec.incidents(spikes)["start"].tolist() == [374, 1184, 1334, 1376]
    assert spec.incidents(spikes.iloc[:0]).empty


def test_min_incidents_stops_running_seeds_once_enough_are_found(tmp_path):
    # every seed has one poisoned-batch spike: one incident is found in seed 0, so seeds 1
    # and 2 (the cap) are never trained, and the report says how many seeds ran
    cfg = _cfg(**{"data.task": "markov", "data.alpha": 0.01, "data.poison_steps": [80]})
    spec = R.ReplaySpec(config=to_dict(cfg), seeds=[0, 1, 2], snapshot_every=25, min_lead=50,
                        max_lead=150, horizon=10, recur_window=5, skip_window=5,
                        min_incidents=1, interventions=("none",))
    table = R.run_study(spec, tmp_path, progress=False)
    assert len(list((tmp_path / "cells" / "replay_base").glob("*[0-9a-f].json"))) == 1
    assert table["spike_step"].tolist() == [80]
    md = R.write_outputs(tmp_path, table, spec, 1.0, "test")
    assert "1 seeds x 100 steps: seeds run in order until 1 incidents were found, at most 3" in md
