"""End-to-end JAX toy LLaMA training: learning, the run directory, skips, poison, seeds, CLI."""

import math
import os
import shutil

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from filelock import FileLock

from adamspike.config import load_config
from adamspike.llama import spec_by_name
from adamspike.metrics import HIST_EDGES, METRIC_NAMES
from adamspike.rundir import STEP_COLUMNS, load_run
from adamspike.synthdata import SyntheticTokens
from adamspike.train_config import RunConfig
from simulate import llama_train as lt
from simulate import optim as jopt

NUM_STEPS, BATCH, SEQ = 150, 16, 32
SKIP, POISON, HIST_EVERY = (40, 41), 100, 25
OVERRIDES = ["--model.preset", "tiny", "--optim.lr", "3e-3", "--optim.warmup_steps", "10",
             "--train.num_steps", str(NUM_STEPS), "--train.global_batch_size", str(BATCH),
             "--train.seq_len", str(SEQ), "--data.skip_batches", ",".join(map(str, SKIP)),
             "--data.poison_steps", str(POISON), "--telemetry.hist_every", str(HIST_EVERY)]


def _cfg(*extra):
    return load_config(RunConfig, None, OVERRIDES + list(extra))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One training run shared by the tests of this module, also across pytest-xdist
    workers (the first worker trains it under a file lock, the others read it)."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    path = root / "llama_train_shared_run"
    with FileLock(str(path) + ".lock"):
        if not (path / "run.json").exists() or "end" not in set(load_run(path).events.type):
            shutil.rmtree(path, ignore_errors=True)
            lt.train(_cfg(), path, progress=False)
    return load_run(path)


def test_loss_falls_toward_the_entropy_rate(run):
    steps = run.steps.set_index("step")
    floor = SyntheticTokens("markov", 64, SEQ).entropy_rate()
    start = float(steps.loss.iloc[:3].mean())
    assert start == pytest.approx(math.log(64), abs=0.1)
    clean = steps.loss.drop(index=[POISON, *SKIP])
    end = float(clean.iloc[-20:].mean())
    # more than 60% of the gap between the uniform loss and the entropy rate is closed
    assert end < floor + 0.4 * (start - floor), (start, end, floor)
    assert end > floor - 0.05  # and nothing beats the entropy rate


def test_run_directory_has_every_column_and_metric(run):
    s = run.steps
    assert list(s.step) == list(range(1, NUM_STEPS + 1))
    assert set(STEP_COLUMNS) <= set(s.columns)
    assert (s.tokens == s.step * BATCH * SEQ).all()
    cfg = _cfg()
    np.testing.assert_allclose(s.lr, [cfg.optim.lr_at(k, NUM_STEPS) for k in s.step])
    assert np.isfinite(s[["loss", "grad_norm", "update_norm", "step_time_s"]].to_numpy()).all()
    assert run.backend == "jax" and run.config["train"]["num_steps"] == NUM_STEPS

    specs = spec_by_name(cfg.model.llama())
    lay = run.layers
    applied = [k for k in range(1, NUM_STEPS + 1) if k not in SKIP]
    assert sorted(lay.step.unique()) == applied
    assert len(lay) == len(applied) * len(specs)
    for name, g in lay.groupby("name", observed=True):
        spec = specs[name]
        assert (g.depth == spec.depth).all() and (g.kind == spec.kind).all()
        assert (g.numel == spec.numel).all()
    later = lay[lay.step > 1]
    for m in METRIC_NAMES:  # grad_mom_cos is NaN only at step 1 (m_prev = 0)
        assert np.isfinite(later[m]).all(), m
    # step 1: m_hat = g, v_hat = g^2, so g^2 / max(v_hat, eps^2) = 1 and |r| = |g|/(|g| + eps)
    # ~ 1 wherever |g| >> eps (embedding rows of tokens absent from the batch have g = 0)
    first = lay[lay.step == 1]
    assert (first.rms_t <= 1.0 + 1e-5).all() and (first.rms_t > 0.99).all()
    assert (first.sat_frac > 0.99).all()
    assert first.grad_mom_cos.isna().all()
    np.testing.assert_allclose(lay.rho, lay.grad_rms / cfg.optim.eps, rtol=1e-5)

    h = run.hists
    assert sorted(h.step.unique()) == list(range(HIST_EVERY, NUM_STEPS + 1, HIST_EVERY))
    assert len(h) == NUM_STEPS // HIST_EVERY * len(specs)
    for row in h.itertuples():
        assert len(row.counts) == len(HIST_EDGES) - 1 and sum(row.counts) == specs[row.name].numel
    vh = load_run(run.path, tables=("vhists",)).vhists   # sqrt(v_hat)/eps, same steps
    assert sorted(vh.step.unique()) == sorted(h.step.unique()) and len(vh) == len(h)
    assert all(sum(r.counts) == specs[r.name].numel for r in vh.itertuples())
    numel = np.array([specs[n].numel for n in vh.name.astype(str)])
    assert ((vh.g_below_eps.to_numpy() >= 0) & (vh.g_below_eps.to_numpy() <= numel)).all()
    types = list(run.events.type)
    assert types[0] == "start" and types[-1] == "end"


def test_skipped_batches_and_poison(run):
    s = run.steps.set_index("step")
    assert list(s.index[s.skipped]) == list(SKIP)
    assert (s.loc[list(SKIP), "update_norm"] == 0).all()
    assert (s.drop(index=list(SKIP)).update_norm.iloc[:-1] > 0).all()  # lr_at(last) = 0
    assert np.isfinite(s.loc[list(SKIP), ["loss", "grad_norm"]].to_numpy()).all()
    ev = run.events
    assert sorted(ev[ev.type == "skip"].step.astype(int)) == list(SKIP)
    # poisoned targets (one constant token) give a loss far above its neighbours
    neighbours = s.loss.loc[POISON - 5:POISON + 5].drop(index=POISON)
    assert s.loss[POISON] > neighbours.max() + 1.0


def test_same_seed_same_run_other_seed_differs(run, tmp_path):
    again = load_run(lt.train(_cfg(), tmp_path / "again", progress=False))
    cols = ["loss", "grad_norm", "update_norm", "lr", "clipped", "skipped"]
    assert run.steps[cols].equals(again.steps[cols])
    metric_cols = ["step", "name", *METRIC_NAMES]
    assert run.layers[metric_cols].equals(again.layers[metric_cols])
    other = load_run(lt.train(_cfg("--train.seed", "1"), tmp_path / "other", progress=False))
    assert not np.allclose(other.steps.loss, run.steps.loss)


def test_loss_scale_equals_eps_over_s(tmp_path):
    """Adam on s*L with eps (clip c*s) takes the steps of Adam on L with eps/s (clip c)."""
    common = ["--train.num_steps", "30", "--telemetry.enabled", "false",
              "--data.skip_batches", "", "--data.poison_steps", "", "--optim.grad_clip", "0.3"]
    a = load_run(lt.train(_cfg(*common, "--train.loss_scale", "1e-3", "--optim.eps", "1e-6"),
                          tmp_path / "a", progress=False)).steps
    b = load_run(lt.train(_cfg(*common, "--optim.eps", "1e-3"), tmp_path / "b",
                          progress=False)).steps
    assert a.clipped.any() and (a.clipped == b.clipped).all()
    np.testing.assert_allclose(a.loss, b.loss, rtol=2e-4)
    np.testing.assert_allclose(a.update_norm, b.update_norm, rtol=2e-3)
    np.testing.assert_allclose(a.grad_norm, 1e-3 * b.grad_norm, rtol=2e-3)
    # and eps matters at this scale: eps/s = 1e-3 is not the eps = 1e-6 run
    c = load_run(lt.train(_cfg(*common, "--optim.eps", "1e-6"), tmp_path / "c",
                          progress=False)).steps
    assert abs(c.loss.iloc[-1] - b.loss.iloc[-1]) > 1e-3


def test_cli_errors_name_the_problem(tmp_path, capsys):
    out = tmp_path / "run"
    assert lt.main(["--out", str(out), "--optim.nope", "1"]) == 2
    assert "optim.nope" in capsys.readouterr().err and not out.exists()
    assert lt.main(["--out", str(out), "--optim.b2", "1.5"]) == 2
    assert "optim.b2" in capsys.readouterr().err
    assert lt.main(["--out", str(out), "--data.source", "indexed"]) == 2
    assert "data.source" in capsys.readouterr().err
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert lt.main(["--out", str(out), "--train.num_steps", "2"]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "precious" and len(list(out.iterdir())) == 1
