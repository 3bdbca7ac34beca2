"""Bad input to the trainer: each case is a clear error naming the problem, exit status 2,
no traceback, and nothing already written is changed (an existing run directory keeps
every file byte-identical; a new --out is not created).

Most cases call `fullscale.train.main(argv)` in-process (the CLI contract: it returns the
exit status); the real process exit code and stderr are checked through subprocesses for
a config error, the corrupt checkpoint on --resume, and a world size that does not divide
the batch (2 gloo ranks).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fullscale.data import write_indexed

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
[model]
preset = "tiny"
[train]
num_steps = 3
global_batch_size = 4
seq_len = 16
[telemetry]
every = 1
hist_every = 0
[checkpoint]
every = 0
keep = 1
"""


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A finished run, copies of it with corrupt / missing checkpoints, and data files."""
    d = tmp_path_factory.mktemp("bad_inputs")
    cfg = d / "run.toml"
    cfg.write_text(CONFIG)
    done = d / "done"
    # in this process: a finished run is all a case needs of it (not its process)
    from tests.fullscale.trainers import main_here

    proc = main_here(["--config", str(cfg), "--out", str(done)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    corrupt = d / "corrupt"
    shutil.copytree(done, corrupt)
    for shard in corrupt.glob("checkpoints/step-*/*.distcp"):
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    nockpt = d / "nockpt"
    shutil.copytree(done, nockpt)
    shutil.rmtree(nockpt / "checkpoints")

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 64, size=40) for _ in range(20)]
    good = d / "good_text_document"
    write_indexed(good, docs)
    magic = d / "magic_text_document"
    write_indexed(magic, docs)
    raw = bytearray(Path(f"{magic}.idx").read_bytes())
    raw[:9] = b"NOTANIDX\x00"
    Path(f"{magic}.idx").write_bytes(bytes(raw))
    trunc = d / "trunc_text_document"
    write_indexed(trunc, docs)
    b = Path(f"{trunc}.bin")
    b.write_bytes(b.read_bytes()[:-10])
    vocab = d / "vocab_text_document"
    write_indexed(vocab, docs[:-1] + [np.full(40, 100)])
    unknown = d / "unknown.toml"
    unknown.write_text(CONFIG + "\n[optim]\nbogus_knob = 1\n")
    return {"dir": d, "cfg": cfg, "done": done, "corrupt": corrupt, "nockpt": nockpt,
            "good": good, "magic": magic, "trunc": trunc, "vocab": vocab, "unknown": unknown,
            "snapshot": _snapshot(d)}


# (id, argv builder, substrings the message must contain)
CASES = [
    ("unknown-key", lambda w, out: ["--config", str(w["unknown"]), "--out", out],
     ["optim.bogus_knob"]),
    ("unknown-override", lambda w, out: ["--config", str(w["cfg"]), "--out", out,
                                         "--train.nope", "1"], ["train.nope"]),
    ("b2>=1", lambda w, out: ["--config", str(w["cfg"]), "--out", out, "--optim.b2", "1.0"],
     ["optim.b2", "< 1.0"]),
    ("eps<0", lambda w, out: ["--config", str(w["cfg"]), "--out", out, "--optim.eps", "-1e-8"],
     ["optim.eps", ">= 0.0"]),
    ("not-a-number", lambda w, out: ["--config", str(w["cfg"]), "--out", out,
                                     "--train.num_steps", "many"], ["train.num_steps", "many"]),
    ("seq_len>max", lambda w, out: ["--config", str(w["cfg"]), "--out", out,
                                    "--train.seq_len", "128"],
     ["train.seq_len", "128", "max_seq_len=64"]),
    ("micro-batch", lambda w, out: ["--config", str(w["cfg"]), "--out", out,
                                    "--train.micro_batch_size", "3"],
     ["train.micro_batch_size", "3"]),
    ("no-config-file", lambda w, out: ["--config", str(w["dir"] / "nope.toml"), "--out", out],
     ["nope.toml"]),
    ("missing-data", lambda w, out: ["--config", str(w["cfg"]), "--out", out,
                                     "--data.source", "indexed", "--data.path",
                                     str(w["dir"] / "absent_text_document")],
     ["absent_text_document.", "file not found"]),
    ("bad-idx-magic", lambda w, out: ["--config", str(w["cfg"]), "--out", out,
                                      "--data.source", "indexed", "--data.path", str(w["magic"])],
     ["magic_text_document.idx", "magic"]),
    ("truncated-bin", lambda w, out: ["--config", str(w["cfg"]), "--out", out,
                                      "--data.source", "indexed", "--data.path", str(w["trunc"])],
     ["trunc_text_document.bin", "truncated"]),
    ("token>=vocab", lambda w, out: ["--config", str(w["cfg"]), "--out", out,
                                     "--data.source", "indexed", "--data.path", str(w["vocab"])],
     ["vocab_text_document.bin", "token id 100", "[0, 64)"]),
    ("existing-run-dir", lambda w, out: ["--config", str(w["cfg"]), "--out", str(w["done"])],
     ["/done: run directory exists and is not empty"]),
    ("resume-no-checkpoint", lambda w, out: ["--config", str(w["cfg"]), "--out",
                                             str(w["nockpt"]), "--resume"],
     ["no complete checkpoint to resume from"]),
    ("resume-corrupt-checkpoint", lambda w, out: ["--config", str(w["cfg"]), "--out",
                                                  str(w["corrupt"]), "--resume"],
     ["no loadable checkpoint", "step-00000003", "sha256"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_in_process(world, case, capsys):
    from fullscale.train import main

    name, argv, needles = case
    out = world["dir"] / f"new-{name}"
    rc = main(argv(world, str(out)))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and err.startswith("adamspike train: error:"), err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not out.exists(), f"{out} was created by a failed run"
    assert _snapshot(world["dir"]) == world["snapshot"], "an existing file was changed"


@pytest.mark.parametrize("name", ["b2>=1", "resume-corrupt-checkpoint"])
def test_bad_input_process_exit_status(world, name):
    _, argv, needles = next(c for c in CASES if c[0] == name)
    out = world["dir"] / f"new-proc-{name}"
    proc = subprocess.run([sys.executable, "-m", "fullscale.train", *argv(world, str(out))],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert all(n in proc.stderr for n in needles), proc.stderr
    assert _snapshot(world["dir"]) == world["snapshot"]


@pytest.mark.slow
def test_world_size_not_dividing_the_batch(world):
    """2 gloo ranks, global batch 5: both ranks exit 2 naming the key and the world size."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = world["dir"] / "new-world"
    procs = [subprocess.Popen([sys.executable, "-m", "fullscale.train", "--config",
                               str(world["cfg"]), "--out", str(out),
                               "--train.global_batch_size", "5"],
                              env={**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2 and "Traceback" not in err, err[-3000:]
        assert "train.global_batch_size: 5 is not divisible by the world size 2" in err, err
    assert not out.exists()
    assert _snapshot(world["dir"]) == world["snapshot"]
