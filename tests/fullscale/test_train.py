"""fullscale.train end to end in one process (tiny LLaMA on the synthetic Markov task): the
loss falls, the run directory holds every table, the schedule is lr_at, poisoned batches
spike, skipped batches are consumed without an update, the guard rolls back and skips,
alarms fire, and bad input exits 2 with a message naming the problem."""

import json
import math

import numpy as np
import pytest
import torch

from adamspike.llama import PRESETS, param_specs
from adamspike.rundir import load_run
from adamspike.train_config import OptimSection
from fullscale.train import main

TINY = ["--model.preset", "tiny", "--train.global_batch_size", "8", "--train.seq_len", "32",
        "--optim.lr", "3e-3", "--optim.warmup_steps", "5", "--telemetry.flush_every_s", "0"]
NUM_TENSORS = len(param_specs(PRESETS["tiny"]))


pytestmark = pytest.mark.usefixtures("one_thread")


def _train(out, *extra):
    return main(["--out", str(out), *TINY, *extra])


def test_tiny_run_learns_and_writes_the_run_directory(tmp_path):
    out = tmp_path / "run"
    assert _train(out, "--train.num_steps", "40", "--telemetry.hist_every", "10",
                  "--train.micro_batch_size", "4") == 0
    run = load_run(out)
    s = run.steps
    assert s["step"].tolist() == list(range(1, 41))
    assert s["loss"].iloc[-5:].mean() < s["loss"].iloc[:5].mean() - 0.4
    assert s["loss"].iloc[0] == pytest.approx(math.log(64), abs=0.15)   # near uniform at init
    optim = OptimSection(lr=3e-3, warmup_steps=5)
    np.testing.assert_allclose(s["lr"], [optim.lr_at(k, 40) for k in range(1, 41)], rtol=1e-12)
    assert (s["tokens"] == s["step"] * 8 * 32).all()
    assert (s["grad_norm"] > 0).all() and (s["update_norm"].iloc[:-1] > 0).all()
    assert s["update_norm"].iloc[-1] == 0.0              # cosine to min_lr = 0 at the last step
    assert not s["skipped"].any() and (s["tokens_per_s"] > 0).all()
    assert len(run.layers) == 40 * NUM_TENSORS
    assert sorted(run.hists["step"].unique()) == [10, 20, 30, 40]
    assert (np.stack(run.hists["counts"]).sum(1) == run.hists.merge(
        run.layers[["step", "name", "numel"]], on=["step", "name"])["numel"]).all()
    emb = run.layers[run.layers["name"] == "tok_embeddings.weight"]
    assert (emb["depth"] == -1).all() and (emb["kind"] == "embed").all()
    assert run.meta["backend"] == "torch" and run.meta["world_size"] == 1
    assert run.meta["batch_plan"]["num_micro_batches"] == 2
    types = run.events["type"].tolist()
    assert types[0] == "start" and types[-1] == "end" and "checkpoint" in types


def test_poisoned_batch_spikes_and_skipped_batch_is_consumed_without_update(tmp_path):
    out = tmp_path / "run"
    assert _train(out, "--train.num_steps", "24", "--data.poison_steps", "22",
                  "--data.skip_batches", "6", "--telemetry.every", "2", "--guard.window", "8",
                  "--guard.min_rel_jump", "0.1") == 0
    s = load_run(out).steps.set_index("step")
    # the skipped batch is measured (loss, grad norm) but not trained on
    assert s.loc[6, "skipped"] and s.loc[6, "update_norm"] == 0
    assert np.isfinite(s.loc[6, "loss"]) and s.loc[6, "grad_norm"] > 0
    assert not s.drop(6)["skipped"].any()
    # all targets = token 0: the loss jumps to about -log p(0) ~ log(64) (measured ~4.1
    # against ~3.3 around it at this point of training)
    normal = s.loc[[19, 20, 21], "loss"].mean()
    assert s.loc[22, "loss"] > 1.15 * normal
    assert s.loc[22, "loss"] == s.loc[4:, "loss"].max()
    ev = load_run(out).events
    assert ev[ev["type"] == "skip"]["step"].tolist() == [6]
    assert ev[ev["type"] == "spike"]["step"].tolist() == [22]   # detector runs with guard off
    # step 6 read batch 6: same loss as a run without the skip (same weights after the 5
    # identical warmup steps, whose lr does not depend on num_steps)
    out2 = tmp_path / "noskip"
    assert _train(out2, "--train.num_steps", "7", "--telemetry.enabled", "false") == 0
    s2 = load_run(out2).steps.set_index("step")
    assert s2.loc[6, "loss"] == pytest.approx(s.loc[6, "loss"], rel=1e-6)


def test_guard_rolls_back_and_skips_past_a_poisoned_batch(tmp_path):
    out = tmp_path / "run"
    assert _train(out, "--train.num_steps", "30", "--data.poison_steps", "27",
                  "--guard.enabled", "true", "--guard.window", "8", "--guard.skip_batches", "3",
                  "--checkpoint.every", "5", "--telemetry.enabled", "false") == 0
    run = load_run(out)
    ev = run.events.set_index("type")
    assert ev.loc["spike", "step"] == 27
    assert ev.loc["rollback", "to_step"] == 25
    assert ev.loc["skip_batches", "num_batches"] == 3 and ev.loc["skip_batches", "offset_after"] == 3
    s = run.steps
    assert s["step"].tolist() == list(range(1, 31))       # no lost or doubled steps
    assert s["loss"].iloc[20:].max() < s["loss"].iloc[15:20].max()   # no spike left
    assert np.isfinite(s["loss"]).all()


def test_guard_aborts_without_a_checkpoint_to_roll_back_to(tmp_path, capsys):
    out = tmp_path / "run"
    rc = _train(out, "--train.num_steps", "28", "--data.poison_steps", "27",
                "--guard.enabled", "true", "--guard.window", "8", "--telemetry.enabled", "false")
    assert rc == 3
    assert "no checkpoint before it" in capsys.readouterr().err
    assert "abort" in load_run(out).events["type"].tolist()


def test_alarms_from_predictions_fire_as_events(tmp_path):
    pred = {"schema": "adamspike.predictions", "schema_version": 3, "settings": [],
            "alarm_rules": [{"id": "sat", "metric": "sat_frac", "depths": [-1, 0],
                             "op": ">", "threshold": 0.5, "consecutive": 1}]}
    (tmp_path / "p.json").write_text(json.dumps(pred))
    out = tmp_path / "run"
    assert _train(out, "--train.num_steps", "4", "--alarms.predictions",
                  str(tmp_path / "p.json")) == 0
    ev = load_run(out).events
    alarms = ev[ev["type"] == "alarm"]
    # step 1: r = m_hat / (sqrt(v_hat) + eps) = sign(g) almost everywhere -> saturated
    assert 1 in alarms["step"].tolist() and (alarms["rule"] == "sat").all()


def test_bad_input_exits_2_with_a_clear_message(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(out, "--optim.epz", "1") == 2
    assert "unknown config key: optim.epz" in capsys.readouterr().err
    assert _train(out, "--train.global_batch_size", "6", "--train.micro_batch_size", "4") == 2
    assert "micro_batch_size" in capsys.readouterr().err
    assert _train(out, "--resume") == 2
    assert "run directory does not exist" in capsys.readouterr().err   # nothing to resume
    (tmp_path / "bad.json").write_text("{")
    assert _train(out, "--alarms.predictions", str(tmp_path / "bad.json")) == 2
    assert "invalid JSON" in capsys.readouterr().err
    assert _train(out, "--train.num_steps", "1", "--telemetry.enabled", "false") == 0
    before = sorted(p.name for p in (out / "steps").iterdir())
    assert _train(out, "--train.num_steps", "1") == 2          # never overwrite a run
    assert "not empty" in capsys.readouterr().err
    assert sorted(p.name for p in (out / "steps").iterdir()) == before


def test_optimizer_and_model_knobs_run_through_the_trainer(tmp_path):
    """update clipping, z-loss, loss scale, GLM shrink, fp32 AC: the run trains, the lr column
    is the schedule (not the per-tensor clipped lr), rho is in the frame of s * loss."""
    out = tmp_path / "run"
    assert _train(out, "--train.num_steps", "12", "--mitigation.update_clip", "true",
                  "--train.z_loss", "1e-3", "--train.loss_scale", "1e-3",
                  "--mitigation.embed_grad_shrink", "0.1", "--train.activation_checkpointing", "true",
                  "--optim.eps", "1e-8", "--mitigation.eps_embed", "1e-6",
                  "--mitigation.v_reset_steps", "7") == 0
    run = load_run(out)
    optim = OptimSection(lr=3e-3, warmup_steps=5)
    np.testing.assert_allclose(run.steps["lr"], [optim.lr_at(k, 12) for k in range(1, 13)])
    assert np.isfinite(run.steps["loss"]).all()
    assert run.steps["loss"].iloc[-3:].mean() < run.steps["loss"].iloc[:3].mean()
    layers = run.layers
    eps = np.where(layers["depth"] == -1, 1e-6, 1e-8)     # mitigation.eps_embed
    np.testing.assert_allclose(layers["rho"], layers["grad_rms"] / eps, rtol=1e-5)
    # v reset of the embed + shallow groups at step 7: their rms_t is then close to
    # sqrt((1 - b2^7) / (1 - b2)) = 2.46 where v_hat > eps^2 (b2 = 0.95; the embedding's
    # gradient is below its eps = 1e-6 here, so the block-0 matrices are checked)
    reset = layers[(layers["step"] == 7) & (layers["depth"] == 0) & (layers["kind"] != "norm")]
    assert len(reset) and (reset["rms_t"] > 2.0).all()
    assert (layers.loc[(layers["step"] == 6) & (layers["depth"] == 0), "rms_t"] < 2.0).all()


def test_loss_terms_z_loss_formula():
    from fullscale.train import loss_terms
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g)
    targets = torch.randint(0, 7, (2, 5), generator=g)
    z = torch.logsumexp(logits, -1)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss_terms(logits, targets, 0.0), ce)
    torch.testing.assert_close(loss_terms(logits, targets, 0.5), ce + 0.5 * (z * z).mean())


def test_alarms_need_telemetry(tmp_path, capsys):
    assert _train(tmp_path / "run", "--alarms.predictions", "p.json",
                  "--telemetry.enabled", "false") == 2
    assert "telemetry.enabled" in capsys.readouterr().err
