import subprocess
import sys

from study.cli import COMMANDS, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


def test_unknown_command(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_mistyped_command_suggests_the_close_one(capsys):
    """`adamspike asses x.log` (issue 39, item 5): the command it is close to."""
    assert main(["asses", "x.log"]) == 2
    assert "did you mean `adamspike assess`?" in capsys.readouterr().err
    assert main(["qqqqqqqq"]) == 2
    assert "did you mean" not in capsys.readouterr().err


def test_console_script_runs():
    res = subprocess.run([sys.executable, "-m", "study", "--version"], capture_output=True,
                         text=True)
    assert res.returncode == 0 and res.stdout.strip()


def test_sweep_and_replicate_are_routed_from_the_top_cli(tmp_path, capsys):
    """`adamspike sweep run|merge` gets the problems from the top CLI; `adamspike replicate`
    and `adamspike sweep replicate` are the same command; bad input exits 2."""
    grid = tmp_path / "g.toml"
    grid.write_text("[sweep]\nproblem = 'quadratic'\n[grid]\noptim.eps = [-1.0]\n")
    assert main(["sweep", "run", "--grid", str(grid), "--out", str(tmp_path / "o")]) == 2
    assert "grid.optim.eps[0]: must be >= 0.0" in capsys.readouterr().err
    for argv in (["replicate"], ["sweep", "replicate"]):
        assert main([*argv, "--out", str(tmp_path / "r"), "--seeds", "1"]) == 2
        assert "--seeds must be >= 2" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (tmp_path / "r").exists()
