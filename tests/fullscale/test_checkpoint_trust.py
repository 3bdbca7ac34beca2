"""A checkpoint is input, not code (issue 40, defect 2): DCP's `.metadata` is unpickled with
only DCP's metadata classes admitted, byte entries load weights_only, and a crafted file is
refused in one line naming it (never skipped for an older checkpoint), even when the
manifest was rewritten to match."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import pickletools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fullscale import checkpoint as ck
from tests.fullscale.test_checkpoint import _model, _train

ROOT = Path(__file__).resolve().parents[2]


class _Payload:
    """Unpickling this runs `touch MARK`."""

    def __init__(self, mark: Path):
        self.mark = str(mark)

    def __reduce__(self):
        return (os.system, (f"touch {self.mark}",))


def _forge(ckpt: Path, data: bytes) -> None:
    """Replace `.metadata` and rewrite the manifest to match, as a writer of the directory can."""
    (ckpt / ".metadata").write_bytes(data)
    m = json.loads((ckpt / "COMPLETE").read_text())
    m["files"][".metadata"].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    (ckpt / "COMPLETE").write_text(json.dumps(m))


def _saved(tmp_path: Path) -> tuple[Path, Path]:
    m, opt, sched = _model()
    _train(m, opt, sched, range(2))
    old = ck.CheckpointManager(tmp_path).save(2, m, opt, sched, {"which": 2})
    _train(m, opt, sched, range(2))
    return old, ck.CheckpointManager(tmp_path).save(4, m, opt, sched, {"which": 4})


def test_real_metadata_loads_and_names_only_admitted_globals(tmp_path):
    old, new = _saved(tmp_path)
    md = ck.read_metadata(new)
    assert type(md).__name__ == "Metadata" and md.state_dict_metadata
    globals_ = {arg for op, arg, _ in pickletools.genops((new / ".metadata").read_bytes())
                if op.name in ("GLOBAL", "SHORT_BINUNICODE", "BINUNICODE")}
    assert "torch.distributed.checkpoint.metadata" in globals_
    m2, opt2, sched2 = _model(seed=3)
    assert ck.load(new, m2, opt2, sched2)["which"] == 4      # byte entries: weights_only


@pytest.mark.parametrize("payload", ["system", "eval", "not-metadata", "garbage"])
def test_crafted_metadata_is_refused_not_skipped(tmp_path, payload):
    old, new = _saved(tmp_path / "ck")
    mark = tmp_path / "PWNED"
    data = {"system": pickle.dumps(_Payload(mark)),
            "eval": b"cbuiltins\neval\n(V__import__('os').system('touch " + str(mark).encode() + b"')\ntR.",
            "not-metadata": pickle.dumps({"a": 1}),
            "garbage": b"\x80\x04not a pickle"}[payload]
    _forge(new, data)
    m2, opt2, sched2 = _model(seed=3)
    with pytest.raises(ck.UntrustedCheckpointError) as err:
        ck.load(new, m2, opt2, sched2)
    msg = str(err.value)
    assert str(new / ".metadata") in msg and "refusing" in msg and "\n" not in msg
    # a crafted checkpoint is an attack, not corruption: no quiet fallback to step 2
    with pytest.raises(ck.UntrustedCheckpointError):
        ck.CheckpointManager(tmp_path / "ck").load_latest_valid(m2, opt2, sched2)
    assert not mark.exists()


def test_byte_entries_load_weights_only(tmp_path):
    mark = tmp_path / "PWNED"
    buf = io.BytesIO()
    torch.save({"lr": _Payload(mark)}, buf)
    buf.seek(0)
    planner = ck._WeightsOnlyPlanner()
    planner.flatten_state_dict = False
    planner.state_dict = {}
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(type("R", (), {"dest_index": type("I", (), {"fqn": "x"})()})(), buf)
    assert not mark.exists()


def test_train_resume_refuses_a_crafted_metadata(tmp_path):
    """Real processes: train with checkpoints, forge the newest .metadata (manifest rewritten),
    then `train --resume`: exit 2, one line naming the file, the payload never ran."""
    cfg = tmp_path / "t.toml"
    cfg.write_text('[model]\npreset = "tiny"\n[train]\nnum_steps = 4\nglobal_batch_size = 4\n'
                   'seq_len = 16\nseed = 1\n[checkpoint]\nevery = 2\n')
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "study", "train", "--config", str(cfg), "--out", str(run)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    newest = run / "checkpoints" / "step-00000004"
    mark = tmp_path / "PWNED"
    _forge(newest, pickle.dumps(_Payload(mark)))
    r = subprocess.run(cmd + ["--resume", "--train.num_steps", "6"], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 2
    err = [l for l in r.stderr.splitlines() if "error" in l]
    assert len(err) == 1 and str(newest / ".metadata") in err[0] and "posix.system" in err[0], r.stderr
    assert "Traceback" not in r.stderr and not mark.exists()


def test_the_allowlist_admits_every_global_the_installed_torch_writes(tmp_path, monkeypatch):
    """A real DCP checkpoint written by the installed torch (every kind of entry the trainer
    saves): each global its `.metadata` names is admitted and the restricted read equals
    DCP's own; the allowlist is this torch's (derived at import), and a global it lacks is
    named with the torch version (the same script runs on torch 2.1: .ci/compat.sh py38)."""
    from fullscale import dcp_metadata as dm
    from tests.compat import dcp_metadata_check as chk

    problems, used = chk.check(tmp_path / "ok")
    assert problems == [], "\n".join(problems)
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in used
    assert not dm.admitted("torch.distributed.checkpoint.metadata", "Enum")   # imported there
    assert not dm.admitted("builtins", "eval") and not dm.admitted("torch", "load")
    monkeypatch.setattr(dm, "OTHER_GLOBALS", dm.OTHER_GLOBALS - {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo")})
    problems, _ = chk.check(tmp_path / "lacking")
    assert len(problems) == 1 and f"torch {torch.__version__} writes torch.distributed." \
        "checkpoint.filesystem._StorageInfo into .metadata" in problems[0]
