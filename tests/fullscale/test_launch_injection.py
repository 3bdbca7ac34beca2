"""Hostile values in launch settings: generated scripts quote every value, refuse control
characters, take only a host name / IP as master_addr, and run (with stand-in launchers)
without running anything the values spell; the probe's restart recipe and report.html
links likewise (issue 40, defect 1)."""

from __future__ import annotations

import os
import subprocess
import tomllib
import types
from pathlib import Path

import pytest

from adamspike.report_html import markdown_to_html
from fullscale import megatron_probe as mp
from fullscale.launch import launch_main

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"
# each would create PWNED (in the working directory) if a shell ran it
HOSTILE = ["$(touch PWNED)", "`touch PWNED`", "a;touch PWNED", 'q"uo"te', "two words",
           "it's", "non-bmp-\U0001F600", "${HOME}", "a\\b"]


def _launch(out: Path, *extra: str) -> int:
    return launch_main(["--config", str(TINY), "--device", "cpu", "--nodes", "1",
                        "--devices-per-node", "2", "--out", str(out), *extra])


def _stand_ins(tmp: Path) -> Path:
    """A bin/ with `torchrun` printing one argument a line, then the probe's predictions path."""
    bin_ = tmp / "bin"
    bin_.mkdir()
    fake = bin_ / "torchrun"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n'
                    'printf "PRED=%s\\n" "${ADAMSPIKE_PROBE_PREDICTIONS:-}"\n')
    fake.chmod(0o755)
    return bin_


@pytest.mark.parametrize("value", HOSTILE + ["new\nline", "tab\there", "ctl\x1b[2J", "a b", "h;x"])
def test_master_addr_must_be_a_host(tmp_path, capsys, value):
    out = tmp_path / "l"
    assert _launch(out, "--master-addr", value) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a host name or IP address" in err, err
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("host", ["node-000", "10.0.0.7", "fe80::1", "gpu_01.cluster.local", "MASTER_HOST"])
def test_master_addr_hosts_accepted(tmp_path, host):
    out = tmp_path / "l"
    assert _launch(out, "--master-addr", host, "--engine", "fsdp") == 0
    r = subprocess.run(["bash", str(out / "train_torchrun.sh"), "0"], capture_output=True, text=True,
                       env={"PATH": f"{_stand_ins(tmp_path)}:/usr/bin:/bin", "TORCHRUN": "torchrun",
                            "ADAMSPIKE_HOME": str(tmp_path)}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    args = r.stdout.splitlines()
    assert args[args.index("--master-addr") + 1] == host


@pytest.mark.parametrize("value", ["new\nline", "car\rriage", "nul-free-but-\x07bell", "sep\u2028x"])
def test_control_characters_refused_in_paths(tmp_path, capsys, value):
    out = tmp_path / value
    assert _launch(out, "--master-addr", "h") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "control character" in err, err
    assert not list(tmp_path.iterdir())
    # the same through a config value that a script carries
    assert _launch(tmp_path / "ok", "--alarms.predictions", str(tmp_path / value)) == 2
    assert "alarms.predictions" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_hostile_paths_survive_and_nothing_runs(tmp_path):
    """Both scripts, generated under hostile --out / predictions paths, run with stand-in
    launchers: every path reaches the launcher intact and no PWNED appears."""
    bin_ = _stand_ins(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    home = tmp_path / "home"
    (home / "fullscale").mkdir(parents=True)
    (home / "fullscale" / "megatron_probe.py").write_text("")
    for i, value in enumerate(HOSTILE):
        out = tmp_path / f"{i}{value}" / "l"
        pred = tmp_path / f"{i}{value}" / "pred.json"
        assert _launch(out, "--master-addr", "h0", "--alarms.predictions", str(pred)) == 0, value
        # run.toml is valid TOML whatever the path holds (non-BMP: no JSON surrogate escapes)
        assert tomllib.loads((out / "run.toml").read_text())["alarms"]["predictions"] == str(pred)
        # the stack named: detecting it (python -m fullscale.stack) is not what is tested here
        env = {"PATH": f"{bin_}:/usr/bin:/bin", "TORCHRUN": "torchrun", "ADAMSPIKE_HOME": str(home),
               "MINDSPEED_LLM_DIR": str(work), "MEGATRON_STACK": "mindspeed-llm"}
        r = subprocess.run(["bash", str(out / "train_torchrun.sh"), "0"], capture_output=True,
                           text=True, env=env, cwd=work)
        assert r.returncode == 0, (value, r.stderr)
        args = r.stdout.splitlines()
        assert args[args.index("--config") + 1] == str(out / "run.toml")
        assert args[args.index("--out") + 1] == str(out / "run")
        r = subprocess.run(["bash", str(out / "train_mindspeed.sh"), "0"], capture_output=True,
                           text=True, env=env, cwd=work)
        assert r.returncode == 0, (value, r.stderr)
        args = r.stdout.splitlines()
        assert args[args.index("--save") + 1] == str(out / "run_megatron" / "checkpoints")
        assert f"PRED={pred}" in args
        assert (out / "run_megatron" / "logs").is_dir()
        # the comment lines stay comments: bash -x shows no command from them
        text = (out / "train_mindspeed.sh").read_text()
        assert all(l.startswith("#") for l in text.splitlines() if "adamspike analyze" in l)
    assert not list(tmp_path.rglob("PWNED")) and not (Path.cwd() / "PWNED").exists()


@pytest.mark.parametrize("save", ["$(touch PWNED)", "a b;touch PWNED", "new\ntouch PWNED", "q'\"x"])
def test_restart_recipe_quotes_the_checkpoint_path(tmp_path, save):
    ckpt = tmp_path / save
    (ckpt / "iter_0001000").mkdir(parents=True)
    args = types.SimpleNamespace(save=str(ckpt), load=None, iterations_to_skip=[], rerun_mode="x")
    info = mp.write_restart_recipe(str(tmp_path), 1450, "loss\nspike", args, mp.ProbeActions(("loss",)))
    r = subprocess.run(["bash", "-c", f'source {info["path"]!r} && printf "%s\\0" "${{RESTART_ARGS[@]}}"'],
                       capture_output=True, text=True, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    words = r.stdout.split("\0")[:-1]
    assert words[:4] == ["--load", str(ckpt), "--ckpt-step", "1000"]
    assert words[4:6] == ["--iterations-to-skip", "1000"] and words[-1] == "1449"
    assert not list(tmp_path.rglob("PWNED"))


def test_report_html_drops_script_links(tmp_path):
    md = ("# r\n\n[run](javascript:alert(1)) [x](JavaScript:x) [d](data:text/html;base64,PHNj) "
          "[v](vbscript:x) [ok](other/report.md) [web](https://example.org/a)\n")
    page = markdown_to_html(md, tmp_path, "t")
    assert "javascript:" not in page.lower() and "data:text" not in page and "vbscript" not in page
    assert 'href="other/report.html"' in page and 'href="https://example.org/a"' in page
