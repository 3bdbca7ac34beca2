"""Every command that writes refuses a read-only or unwritable --out in one line naming the
path, exit 2, before it computes anything, and never overwrites an existing file it did
not write (issue 40, defect 7): one rule for all, adamspike.rundir.check_out.

The read-only place is a real read-only tmpfs mount (root: file modes do not stop root,
a read-only file system does); the commands run in-process through study.cli.main.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from adamspike.rundir import OutputPathError, check_out
from study.cli import main

ROOT = Path(__file__).resolve().parents[2]
GRID = str(ROOT / "configs" / "sweep_quadratic.toml")


@pytest.fixture(scope="module")
def read_only(tmp_path_factory):
    d = tmp_path_factory.mktemp("ro") / "mnt"
    d.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs",
                                            str(d)], capture_output=True).returncode:
        pytest.skip("mounting a read-only tmpfs needs root")
    yield d
    subprocess.run(["umount", str(d)], check=True)


def _commands(ro: Path, log: Path) -> dict[str, list[str]]:
    return {
        "analyze": ["analyze", "--log", str(log), "--out", str(ro / "a")],
        "assess": ["assess", str(log), "--out", str(ro / "a")],
        "figures": ["figures", "--only-theory", "--out", str(ro / "f")],
        "predict": ["predict", "--profile", "llama2-70b", "--out", str(ro / "p.json")],
        "reproduce": ["reproduce", "--only", "theory", "--out", str(ro / "s")],
        "science4": ["science4", "--out", str(ro / "s4")],
        "sweep": ["sweep", "run", "--grid", GRID, "--set", "sweep.seeds=1", "--out", str(ro / "sw")],
        "simulate quadratic": ["simulate", "quadratic", "--steps", "10", "--out", str(ro / "q")],
        "simulate streams": ["simulate", "streams", "--out", str(ro / "st.json")],
        "simulate mlp": ["simulate", "mlp", "--kind", "sin", "--out", str(ro / "m")],
        "simulate llama": ["simulate", "llama", "--config", str(ROOT / "configs" / "tiny.toml"),
                           "--out", str(ro / "l")],
        "simulate ladder": ["simulate", "ladder", "--out", str(ro / "ld")],
        "simulate batch-sharpness": ["simulate", "batch-sharpness", "--out",
                                     str(ro / "bs")],
        "simulate matched": ["simulate", "matched", "--runs", str(log), "--predictions",
                             str(log), "--out", str(ro / "mt")],
    }


@pytest.mark.parametrize("name", list(_commands(Path("/"), Path("/"))))
def test_a_read_only_out_is_refused_in_one_line_before_computing(read_only, tmp_path, capsys,
                                                                 name):
    log = tmp_path / "job.log"
    log.write_text(" iteration        1/     100 | lm loss: 4.0E+00 |\n")
    argv = _commands(read_only, log)[name]
    t0 = time.monotonic()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "read-only file system" in err[0] and str(read_only) in err[0], err[0]
    assert time.monotonic() - t0 < 60          # nothing computed (the sweep alone: minutes)
    assert list(read_only.iterdir()) == []


def test_check_out_rules(tmp_path):
    """New or empty (a folder), absent (a file); an existing folder kept only when asked;
    a file on the way named."""
    assert check_out(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    (tmp_path / "empty").mkdir()
    check_out(tmp_path / "empty")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    with pytest.raises(OutputPathError, match="exists and is not an empty directory"):
        check_out(tmp_path / "full")
    check_out(tmp_path / "full", keep_existing=True)
    with pytest.raises(OutputPathError, match=r"--pred .*p\.json: exists \(nothing was overwritten"):
        (tmp_path / "p.json").write_text("{}")
        check_out(tmp_path / "p.json", flag="--pred", kind="file")
    with pytest.raises(OutputPathError, match="is a file, not a directory"):
        check_out(tmp_path / "p.json" / "out")
    assert (tmp_path / "full" / "x").read_text() == "mine" and (tmp_path / "p.json").read_text() == "{}"


@pytest.mark.parametrize("argv", [["simulate", "streams", "--steps", "5", "--out", "{f}"],
                                  ["predict", "--profile", "llama2-70b", "--out", "{f}"]])
def test_an_existing_output_file_is_never_overwritten(tmp_path, capsys, argv):
    f = tmp_path / "mine.json"
    f.write_text("not theirs")
    assert main([a.replace("{f}", str(f)) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(f) in err[0] and "exists" in err[0], err
    assert f.read_text() == "not theirs"


@pytest.mark.parametrize("argv", [["figures", "--only-theory", "--out", "{d}"],
                                  ["science4", "--out", "{d}"]])
def test_a_folder_another_command_wrote_is_never_written_into(tmp_path, capsys, argv):
    """figures and science4 rewrite their own files in a folder they claimed (their next
    run, the study's two figure stages); a non-empty folder they did not claim is refused
    before anything is computed, and what it holds is untouched."""
    d = tmp_path / "theirs"
    d.mkdir()
    (d / "loss_spikes.png").write_bytes(b"someone's figure")
    assert main([a.replace("{d}", str(d)) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(d) in err[0] and "not an empty directory that `adamspike" in err[0]
    assert sorted(p.name for p in d.iterdir()) == ["loss_spikes.png"]
    assert (d / "loss_spikes.png").read_bytes() == b"someone's figure"


def test_claimed_folders_and_study_folders_are_their_owners(tmp_path, monkeypatch):
    from adamspike.rundir import OWNER_FILE, claim_out
    d = claim_out(check_out(tmp_path / "f", owner="figures"), "figures")
    (d / "a.png").write_bytes(b"png")
    assert (d / OWNER_FILE).read_text() == "figures\n"
    check_out(d, owner="figures")                         # its next run: allowed
    with pytest.raises(OutputPathError, match="that `adamspike science4` wrote"):
        check_out(d, owner="science4")
    other = tmp_path / "study" / "figures"
    other.mkdir(parents=True)
    (other / "theory.png").write_bytes(b"png")            # a stage of an older study
    with pytest.raises(OutputPathError):
        check_out(other, owner="figures")
    monkeypatch.setenv("ADAMSPIKE_STUDY", str(tmp_path / "study"))
    check_out(other, owner="figures")                     # reproduce's stage: its folder
    with pytest.raises(OutputPathError):
        check_out(other)                                  # no owner: never
