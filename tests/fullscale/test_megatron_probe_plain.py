"""fullscale.megatron_probe without Megatron: a plain torch.optim.AdamW model through the
train_step wrapper (tests/compat/probe_adamw.py, also run by the python 3.8 CI job), the
plain JSON-lines writer read back by adamspike.rundir.load_run, skipped iterations, the
MindSpeed / setattr installs and the launcher's bad input."""

import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from adamspike.metrics import METRIC_NAMES
from adamspike.rundir import load_run
from fullscale import megatron_probe as mp
from fullscale.probe import wrapper as probe_wrapper

ROOT = Path(__file__).resolve().parents[2]


def _demo():
    spec = importlib.util.spec_from_file_location("probe_adamw", ROOT / "tests/compat/probe_adamw.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def demo():
    return _demo()


@pytest.mark.parametrize("plain", [False, True])
def test_adamw_probe_metrics_equal_numpy_reference(demo, tmp_path, plain):
    run_dir = demo.run(str(tmp_path), steps=5, plain=plain, skip=3)
    ref = json.loads((tmp_path / "reference.json").read_text())
    run = load_run(run_dir)
    parts = {p.suffix for p in (Path(run_dir) / "layers").iterdir()}
    assert parts == ({".jsonl"} if plain else {".parquet"})
    assert run.backend == "megatron" and list(run.steps["step"]) == [1, 2, 3, 4, 5]
    assert list(run.steps["skipped"]) == [False, False, True, False, False]
    assert run.steps["loss"].iloc[2] != run.steps["loss"].iloc[2]       # NaN: no loss printed
    gn = run.steps["grad_norm"].to_numpy()
    assert np.isfinite(gn[[0, 1, 3, 4]]).all() and np.isnan(gn[2])   # Megatron prints none
    assert list(run.steps["clipped"]) == list(gn > 1.0)
    assert sorted(set(run.layers["step"])) == [1, 2, 4, 5]               # none on the skip
    assert set(run.hists["step"]) == {2, 4}
    ev = run.events
    assert list(ev.loc[ev["type"] == "skip", "step"]) == [3]
    assert len(set(run.layers["name"])) == len(ref["names"]) == 14
    for step, rows in ref["steps"].items():
        got = run.layers[run.layers["step"] == int(step)].set_index("name")
        for name, want in rows.items():
            for k in METRIC_NAMES:
                g, w = float(got.loc[name, k]), want[k]
                if w is None or (isinstance(w, float) and np.isnan(w)):
                    assert np.isnan(g), (step, name, k)
                else:   # layers are stored as float32; m_prev reconstructed
                    tol = 2e-5 if k == "grad_mom_cos" else 1e-6
                    assert g == pytest.approx(w, rel=tol, abs=1e-30), (step, name, k, g, w)
    dk = run.layers.drop_duplicates("name").set_index("name")
    assert (dk.loc["embedding.word_embeddings.weight", ["depth", "kind"]] == [-1, "embed"]).all()
    assert (dk.loc["decoder.layers.1.mlp.linear_fc2.weight", ["depth", "kind"]] == [1, "w2"]).all()
    assert (dk.loc["output_layer.weight", ["depth", "kind"]] == [2, "output"]).all()


def test_plain_and_parquet_run_directories_read_the_same(demo, tmp_path):
    a = load_run(demo.run(str(tmp_path / "a"), steps=4, plain=False))
    b = load_run(demo.run(str(tmp_path / "b"), steps=4, plain=True))
    for t in ("steps", "layers"):
        x, y = getattr(a, t), getattr(b, t)
        assert list(x.columns) == list(y.columns)
        pd.testing.assert_frame_equal(x.drop(columns="step_time_s", errors="ignore"),
                                      y.drop(columns="step_time_s", errors="ignore"))
    np.testing.assert_array_equal(np.stack(a.hists["counts"]), np.stack(b.hists["counts"]))


def test_plain_writer_resume_truncates_and_refuses_a_used_directory(tmp_path):
    w = mp.PlainRunWriter(str(tmp_path / "r"), backend="megatron", config={}, env={})
    for s in (1, 2, 3):
        w.log_step(step=s, tokens=None, loss=1.0, lr=1e-3, grad_norm=float("nan"), clipped=False,
                   update_norm=float("nan"), step_time_s=0.1, skipped=False)
        w.flush()
    w.close()
    with pytest.raises(mp.ProbeError, match="not empty"):
        mp.PlainRunWriter(str(tmp_path / "r"), backend="megatron", config={}, env={})
    w = mp.PlainRunWriter(str(tmp_path / "r"), backend="megatron", config={}, env={},
                          resume_from_step=1)
    w.log_step(step=2, tokens=None, loss=5.0, lr=1e-3, grad_norm=1.0, clipped=False,
               update_norm=float("nan"), step_time_s=0.1, skipped=False)
    w.close()
    run = load_run(tmp_path / "r")
    assert list(run.steps["step"]) == [1, 2] and list(run.steps["loss"]) == [1.0, 5.0]
    assert list(run.events["type"]) == ["resume"]


def _fake_megatron(monkeypatch, calls):
    """A stand-in megatron.training.training module (megatron-core has no training loop)
    and a module that imported its train_step by name (like MindSpeed-LLM's training)."""
    def train_step(*a, **k):
        calls.append("orig")
        return {}, 0
    mod = types.ModuleType("megatron.training.training")
    mod.train_step = train_step
    user = types.ModuleType("user_training")
    user.train_step = train_step
    monkeypatch.setitem(sys.modules, "megatron.training.training", mod)
    monkeypatch.setitem(sys.modules, "user_training", user)
    return mod, user, train_step


def test_install_without_mindspeed_rewires_every_importer(monkeypatch, tmp_path):
    calls = []
    mod, user, orig = _fake_megatron(monkeypatch, calls)
    monkeypatch.setitem(sys.modules, "mindspeed", None)       # import mindspeed fails
    monkeypatch.setattr(probe_wrapper, "_train_step_module", lambda: mod)
    mp.install(str(tmp_path / "run"), every=1, hist_every=0)
    assert mod.train_step is not orig and user.train_step is mod.train_step
    assert mod.train_step.__wrapped__ is orig


def test_install_under_mindspeed_registers_a_stacked_wrapper(monkeypatch, tmp_path):
    calls, registered = [], []
    mod, _, orig = _fake_megatron(monkeypatch, calls)

    class Manager:   # records what the probe asks of mindspeed.patch_utils
        @staticmethod
        def register_patch(name, fn=None, force_patch=False, create_dummy=False):
            registered.append((name, fn))

        @staticmethod
        def apply_patches():
            for name, fn in registered:
                mod.train_step = fn(mod.train_step)
            registered.append("applied")

    pu = types.ModuleType("mindspeed.patch_utils")
    pu.MindSpeedPatchesManager = Manager
    monkeypatch.setitem(sys.modules, "mindspeed", types.ModuleType("mindspeed"))
    monkeypatch.setitem(sys.modules, "mindspeed.patch_utils", pu)
    monkeypatch.setattr(probe_wrapper, "_train_step_module", lambda: mod)
    mp.install(str(tmp_path / "run"))
    (name, fn), applied = registered
    assert name == "megatron.training.training.train_step" and applied == "applied"
    assert fn.__name__.endswith("_wrapper")      # MindSpeed stacks only *wrapper / *decorator
    assert mod.train_step.__wrapped__ is orig


def test_install_and_launcher_bad_input(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("ADAMSPIKE_PROBE_OUT", raising=False)
    with pytest.raises(mp.ProbeError, match="ADAMSPIKE_PROBE_OUT"):
        mp.install()
    monkeypatch.setenv("ADAMSPIKE_PROBE_EVERY", "ten")
    with pytest.raises(mp.ProbeError, match="ADAMSPIKE_PROBE_EVERY must be an integer"):
        mp.install(str(tmp_path))
    assert mp.main(["--out", str(tmp_path)]) == 2
    assert mp.main(["--out", str(tmp_path), "--", str(tmp_path / "missing.py")]) == 2
    assert "no such training script" in capsys.readouterr().err
    with pytest.raises(mp.ProbeError, match="every must be >= 1"):
        mp.MegatronProbe(str(tmp_path), every=0)


def test_launcher_runs_the_script_with_the_probe_installed(monkeypatch, tmp_path):
    calls = []
    mod, _, orig = _fake_megatron(monkeypatch, calls)
    monkeypatch.setitem(sys.modules, "mindspeed", None)
    monkeypatch.setattr(probe_wrapper, "_train_step_module", lambda: mod)
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("import sys\nt = sys.modules['megatron.training.training']\n"
                      "assert sys.argv[1:] == ['--num-layers', '2'], sys.argv\n"
                      "assert t.train_step.__wrapped__ is not None\n"
                      "open(sys.argv[0] + '.ran', 'w').write('ok')\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert mp.main(["--out", str(tmp_path / "run"), "--adaptor", "none", "--", str(script),
                    "--num-layers", "2"]) == 0
    assert (tmp_path / "pretrain_gpt.py.ran").read_text() == "ok"


def test_depth_kind_of_megatron_names():
    L = 80
    assert mp.depth_kind("embedding.word_embeddings.weight", L) == (-1, "embed")
    assert mp.depth_kind("language_model.embedding.word_embeddings.weight", L) == (-1, "embed")
    assert mp.depth_kind("decoder.layers.7.self_attention.linear_qkv.layer_norm_weight", L) == (7, "norm")
    assert mp.depth_kind("decoder.layers.7.self_attention.linear_qkv.weight", L) == (7, "wqkv")
    assert mp.depth_kind("decoder.layers.7.mlp.linear_fc1.layer_norm_weight", L) == (7, "norm")
    assert mp.depth_kind("decoder.layers.7.mlp.linear_fc1.weight", L) == (7, "w13")
    assert mp.depth_kind("decoder.layers.7.mlp.linear_fc1.weight", L, gated=False) == (7, "w1")
    assert mp.depth_kind("decoder.layers.79.mlp.linear_fc2.weight", L) == (79, "w2")
    assert mp.depth_kind("decoder.layers.0.self_attention.linear_proj.weight", L) == (0, "wo")
    assert mp.depth_kind("language_model.encoder.layers.3.self_attention.query_key_value.weight", L) == (3, "wqkv")
    assert mp.depth_kind("language_model.encoder.layers.3.mlp.dense_4h_to_h.weight", L) == (3, "w2")
    assert mp.depth_kind("decoder.final_layernorm.weight", L) == (80, "norm")
    assert mp.depth_kind("output_layer.weight", L) == (80, "output")


def test_wrapper_leaves_the_optimizer_step_as_it_found_it(demo, tmp_path):
    import torch

    for patched in (False, True):
        model = demo.Toy()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        calls = []
        if patched:     # another tool's instance-level patch of step
            inner = opt.step

            def other_step(*a, **k):
                calls.append(1)
                return inner(*a, **k)
            opt.step = other_step
        probe = mp.MegatronProbe(str(tmp_path / f"r{patched}"), every=1, hist_every=0, plain=True)
        wrapped = mp.make_train_step_wrapper(lambda: probe)(demo.train_step)
        data = iter([torch.randint(0, 32, (2, 9))])
        wrapped(None, data, [model], opt, None, {"clip": 1.0, "iteration": 1})
        probe.close()
        if patched:
            assert vars(opt)["step"] is other_step and calls == [1]
        else:
            assert "step" not in vars(opt)


def test_probe_actions_from_the_environment(tmp_path, monkeypatch):
    a = mp.ProbeActions.from_env({})
    assert a.rules == ("loss", "grad_norm") and a.skip and a.skip_budget == 10 and a.recipe
    assert a.alarms is None and a.spike_params.window == 50 and a.spike_params.k == 6.0
    a = mp.ProbeActions.from_env({"ADAMSPIKE_PROBE_RULES": "loss", "ADAMSPIKE_PROBE_SKIP": "0",
                                  "ADAMSPIKE_PROBE_SKIP_BUDGET": "3", "ADAMSPIKE_PROBE_RECIPE": "off",
                                  "ADAMSPIKE_PROBE_SPIKE_WINDOW": "8"})
    assert a.rules == ("loss",) and not a.skip and a.skip_budget == 3 and not a.recipe
    assert a.spike_params.window == 8 and "skip-step off" in a.describe()
    assert mp.ProbeActions.from_env({"ADAMSPIKE_PROBE_RULES": "0"}).describe().startswith("rules off")
    with pytest.raises(mp.ProbeError, match="unknown rule"):
        mp.ProbeActions.from_env({"ADAMSPIKE_PROBE_RULES": "loss,bogus"})
    with pytest.raises(mp.ProbeError, match="ADAMSPIKE_PROBE_SKIP_BUDGET"):
        mp.ProbeActions.from_env({"ADAMSPIKE_PROBE_SKIP_BUDGET": "many"})
    with pytest.raises(mp.ProbeError, match="ADAMSPIKE_PROBE_PREDICTIONS"):
        mp.ProbeActions.from_env({"ADAMSPIKE_PROBE_PREDICTIONS": str(tmp_path / "none.json")})
    # a node without pandas: the default rules turn off with a note, telemetry stays
    monkeypatch.setitem(sys.modules, "adamspike.spikes", None)
    a = mp.ProbeActions.from_env({})
    assert a.rules == () and "pip install -e .[cluster]" in a.describe()
    with pytest.raises(mp.ProbeError, match="RULES=0"):
        mp.ProbeActions.from_env({"ADAMSPIKE_PROBE_RULES": "loss"})


def test_restart_recipe_names_the_checkpoint_and_the_batches(tmp_path):
    save = tmp_path / "ckpt"
    for it in (500, 1000, 1400):
        (save / f"iter_{it:07d}").mkdir(parents=True)
    args = types.SimpleNamespace(save=str(save), load=None, iterations_to_skip=[], rerun_mode="disabled")
    a = mp.ProbeActions(("loss",))
    r = mp.restart_recipe(1450, args, a)      # 1400 is < 100 steps before: 1000
    assert r["ckpt_step"] == 1000 and r["skipped_iterations"] == [1001, 1450]
    assert r["iterations_to_skip"] == [1000, 1449] and r["stack_has_rerun_state_machine"]
    r = mp.restart_recipe(1100, args, a)      # PaLM's 200 batches at least
    assert r["ckpt_step"] == 1000 and r["skipped_iterations"] == [1001, 1200]
    info = mp.write_restart_recipe(str(tmp_path), 1450, "loss spike", args, a)
    text = Path(info["path"]).read_text()
    assert f"--load {save} --ckpt-step 1000 --iterations-to-skip $(seq -s ' ' 1000 1449)" in text
    assert "rerun-mode" in text and "THIS STACK HAS NO" not in text
    old = types.SimpleNamespace(save=str(save))      # Megatron before core_v0.12
    assert "THIS STACK HAS NO --iterations-to-skip" in Path(
        mp.write_restart_recipe(str(tmp_path), 1450, "x", old, a)["path"]).read_text()


def test_without_pandas_alarms_turn_off_but_the_probe_stays(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "adamspike.spikes", None)
    monkeypatch.setitem(sys.modules, "fullscale.alarms", None)
    a = mp.ProbeActions.from_env({"ADAMSPIKE_PROBE_PREDICTIONS": str(tmp_path / "p.json")})
    assert a.rules == () and a.alarms is None and "rules off" in a.describe()


def test_launcher_help_exits_0_and_a_bad_skip_list_stops_the_job(tmp_path, monkeypatch, capsys):
    assert mp.main(["--help"]) == 0
    assert "SCRIPT.py ARGS" in capsys.readouterr().out
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("raise SystemExit('must not run')\n")
    monkeypatch.setenv("ADAMSPIKE_PROBE_SKIP_ITERATIONS", "300-101")
    assert mp.main(["--out", str(tmp_path / "run"), "--", str(script)]) == 2
    assert "not a range of logged iterations" in capsys.readouterr().err


def test_skip_list_parsing():
    from fullscale.probe.settings import parse_iterations
    assert parse_iterations("3-5, 9 12") == {3, 4, 5, 9, 12}
    assert parse_iterations("") == frozenset()
    for bad in ("0", "x", "5-3"):
        with pytest.raises(mp.ProbeError, match="SKIP_ITERATIONS"):
            parse_iterations(bad)


def test_restart_recipe_gives_each_loop_its_own_skip_values(tmp_path):
    """0-based values on core_v0.12-0.16 loops, the logged numbers on core_v0.17+, none on
    MindSpeed-LLM (its loop has no --iterations-to-skip: the probe's list only)."""
    from fullscale.probe.loop import LoopFacts
    args = types.SimpleNamespace(save=None, load=None, iterations_to_skip=[], rerun_mode="disabled")
    a = mp.ProbeActions(("loss",))
    old = LoopFacts("m012", "while iteration < n:\n    if iteration in args.iterations_to_skip: pass\n"
                            "    a, b, should_checkpoint, should_exit, c, d, e = train_step(x)\n"
                            "    if should_exit: break\n")
    new = LoopFacts("m017", "while iteration < n:\n    if (iteration + 1) in args.iterations_to_skip: pass\n")
    ms = LoopFacts("ms", "while iteration < n:\n    a, b, should_checkpoint, should_exit, c, d, e = train_step(x)\n")
    r0, r1, rm = (mp.restart_recipe(150, args, a, loop) for loop in (old, new, ms))
    assert r0["skipped_iterations"] == r1["skipped_iterations"] == rm["skipped_iterations"] == [1, 200]
    assert r0["iterations_to_skip"] == [0, 199] and r1["iterations_to_skip"] == [1, 200]
    assert rm["iterations_to_skip"] is None and rm["probe_skip_iterations"] == "1-200"
    text = Path(mp.write_restart_recipe(str(tmp_path), 150, "x", args, a, ms)["path"]).read_text()
    assert 'export ADAMSPIKE_PROBE_SKIP_ITERATIONS="1-200"' in text
    assert "THIS STACK HAS NO --iterations-to-skip" in text and "--iterations-to-skip $(" not in text
    text = Path(mp.write_restart_recipe(str(tmp_path), 150, "x", args, a, new)["path"]).read_text()
    assert "--iterations-to-skip $(seq -s ' ' 1 200)" in text and "1-based" in text


def test_probe_writes_group_scalars_to_tensorboard(demo, tmp_path, monkeypatch):
    """TensorBoard out: RUN/tensorboard holds adamspike/KIND/METRIC scalars on the telemetry
    steps, each the median over the group's tensors in the layers table."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_dir = demo.run(str(tmp_path), steps=5, plain=False, skip=3)
    acc = EventAccumulator(str(Path(run_dir) / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    layers = load_run(run_dir).layers
    assert "adamspike/w2/rho" in tags and "adamspike/embed/update_rms" in tags
    got = {e.step: e.value for e in acc.Scalars("adamspike/w2/rho")}
    want = layers[layers["kind"] == "w2"].groupby("step")["rho"].median()
    assert sorted(got) == [1, 2, 4, 5] == list(want.index)
    np.testing.assert_allclose([got[s] for s in want.index], want.to_numpy(), rtol=1e-6)
    monkeypatch.setenv("ADAMSPIKE_TENSORBOARD", "0")
    off = demo.run(str(tmp_path / "off"), steps=2, plain=True)
    assert not (Path(off) / "tensorboard").exists()
