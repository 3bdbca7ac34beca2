"""The probe without shared storage (MindSpeed-LLM's --no-shared-storage, or
ADAMSPIKE_PROBE_NO_SHARED_STORAGE=1): the writer rank writes the run directory on its own
node and says where (run.json, the start event, one printed line); the restart recipe takes
its checkpoint from Megatron's --save-interval schedule, not from a listing of the node's
--save (which holds only the shards written there)."""

import json
import socket
import sys
import types
from pathlib import Path

import pytest

from fullscale import megatron_probe as mp
from fullscale.probe.writer import storage_info
from tests.fullscale.test_megatron_probe_plain import _demo


def test_storage_info_follows_the_flag_and_the_environment():
    assert storage_info(types.SimpleNamespace(), 7, {})["shared"]
    assert storage_info(None, 7, {})["shared"]
    s = storage_info(types.SimpleNamespace(no_shared_storage=True), 7, {})
    assert s == {"shared": False, "host": socket.gethostname(), "rank": 7}
    assert not storage_info(None, 0, {"ADAMSPIKE_PROBE_NO_SHARED_STORAGE": "1"})["shared"]


def test_recipe_without_shared_storage_follows_the_save_schedule(tmp_path):
    save = tmp_path / "ckpt"
    (save / "iter_0000500").mkdir(parents=True)      # the only shard written on this node
    args = types.SimpleNamespace(save=str(save), load=None, save_interval=250,
                                 iterations_to_skip=[], rerun_mode="disabled")
    a = mp.ProbeActions(("loss",))
    shared = mp.restart_recipe(1450, args, a)
    assert shared["ckpt_step"] == 500 and shared["checkpoints_from"] == "this node's --save"
    local = {"shared": False, "host": "node-127", "rank": 1023, "start_iteration": 0}
    r = mp.restart_recipe(1450, args, a, storage=local)
    # saved at 250, 500, ..., 1250; the newest >= 100 steps before the spike is 1250
    assert r["ckpt_step"] == 1250 and r["skipped_iterations"] == [1251, 1450]
    assert r["checkpoints_from"].startswith("--save-interval schedule")
    # a job that loaded iteration 1100: that checkpoint, then 1250
    resumed = {**local, "start_iteration": 1100}
    assert mp.restart_recipe(1300, args, a, storage=resumed)["ckpt_step"] == 1100
    assert mp.restart_recipe(1450, args, a, storage=resumed)["ckpt_step"] == 1250
    # no --save: nothing was saved, only the loaded checkpoint is known
    nosave = types.SimpleNamespace(save=None, load=str(save), save_interval=250)
    assert mp.restart_recipe(1450, nosave, a, storage=resumed)["ckpt_step"] == 1100
    text = Path(mp.write_restart_recipe(str(tmp_path), 1450, "loss spike", args, a,
                                        storage=local)["path"]).read_text()
    assert "no shared storage: this file is on node node-127 only" in text
    assert f"--load {save} --ckpt-step 1250" in text
    assert "no shared storage" not in Path(
        mp.write_restart_recipe(str(tmp_path), 1450, "x", args, a)["path"]).read_text()


@pytest.mark.parametrize("no_shared", [False, True])
def test_the_writer_says_where_its_run_directory_is(tmp_path, monkeypatch, capsys, no_shared):
    """Through the train_step wrapper with Megatron's get_args() (a stand-in module)."""
    import torch

    demo = _demo()
    margs = types.SimpleNamespace(no_shared_storage=no_shared, save=str(tmp_path / "ckpt"),
                                  save_interval=250, curr_iteration=1000)
    fake = types.ModuleType("megatron.training")
    fake.get_args = lambda: margs
    monkeypatch.setitem(sys.modules, "megatron.training", fake)
    torch.manual_seed(0)
    model = demo.Toy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = tmp_path / "run"
    probe = mp.MegatronProbe(str(run), every=1, hist_every=0, plain=True)
    wrapped = mp.make_train_step_wrapper(lambda: probe)(demo.train_step)
    data = iter([torch.randint(0, 32, (2, 9)) for _ in range(2)])
    for _ in range(2):
        wrapped(None, data, [model], opt, None, {"clip": 1.0, "iteration": margs.curr_iteration + 1})
        margs.curr_iteration += 1
    probe.close()
    meta = json.loads((run / "run.json").read_text())
    assert meta["storage"]["shared"] is (not no_shared)
    assert meta["storage"]["host"] == socket.gethostname() and meta["storage"]["start_iteration"] == 1000
    start = json.loads((run / "events.jsonl").read_text().splitlines()[0])
    assert start["type"] == "start" and start["storage"]["shared"] is (not no_shared)
    said = capsys.readouterr()
    line = f"the run directory {run} is on node {socket.gethostname()} (rank 0) only"
    assert (line in said.out + said.err) is no_shared


def test_the_script_passes_no_shared_storage_where_the_stack_has_it(tmp_path):
    from fullscale.launch import OPTIONS_FILE, STACKS, launch_main
    from tests.fullscale.test_launch_mindspeed import BASE, _cluster, _run_script

    vendored = json.loads(OPTIONS_FILE.read_text())
    out = tmp_path / "l"
    assert launch_main(["--config", str(BASE), "--cluster", str(_cluster(tmp_path)), "--master-addr", "n0",
                        "--out", str(out)]) == 0
    script = out / "train_mindspeed.sh"
    for stack in STACKS:
        code, argv, err = _run_script(script, tmp_path, MEGATRON_STACK=stack, NO_SHARED_STORAGE="1")
        assert code == 0, err
        assert ("--no-shared-storage" in argv) == (stack == "mindspeed-llm")
        assert not set(a for a in argv if a.startswith("--")) - set(vendored["stacks"][stack]["options"])
        code, argv, err = _run_script(script, tmp_path, MEGATRON_STACK=stack)
        assert code == 0 and "--no-shared-storage" not in argv
    # the probe learns it from the environment on the stacks without the flag
    text = script.read_text()
    assert 'export ADAMSPIKE_PROBE_NO_SHARED_STORAGE=1' in text
