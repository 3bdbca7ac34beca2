import subprocess
import sys

from adamspike.cli import COMMANDS, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


def test_unknown_command(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_console_script_runs():
    res = subprocess.run([sys.executable, "-m", "adamspike", "--version"], capture_output=True,
                         text=True)
    assert res.returncode == 0 and res.stdout.strip()
