"""Issue 39 item 7: `adamspike analyze` draws the run's own figures into its report (no
second command), the HTML is self-contained from a relative --out, `--no-figures` skips
them, and `adamspike figures RUN --analysis DIR` draws only the run figures."""

from __future__ import annotations

import numpy as np

from study.cli import main as cli
from tests.analysis.test_watch import core_line


def _log(path):
    rng = np.random.default_rng(0)
    lines = []
    for i in range(1, 81):
        loss = (3.0 - 0.002 * i + 0.01 * rng.standard_normal()) * (2.0 if i in (60, 61) else 1)
        lines.append(core_line(i, loss, 0.3 * (30 if i in (58, 59, 60) else 1)))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_analyze_draws_the_run_figures_into_the_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    log = _log(tmp_path / "m.log")
    assert cli(["analyze", "--log", str(log), "--out", "rel"]) == 0     # a relative --out
    run = tmp_path / "rel" / "m.log.run"
    assert (run / "figures" / "loss_spikes.png").is_file()
    md = (run / "report.md").read_text()
    html = (run / "report.html").read_text()
    assert "Not drawn yet" not in md and "](figures/loss_spikes.png)" in md
    assert html.count("data:image/png;base64,") >= 2 and 'src="figures/' not in html
    # --no-figures: nothing drawn, the report says how to draw them
    assert cli(["analyze", "--log", str(log), "--out", "rel2", "--no-figures"]) == 0
    assert not (tmp_path / "rel2" / "m.log.run" / "figures").exists()
    assert "Not drawn yet" in (tmp_path / "rel2" / "m.log.run" / "report.md").read_text()


def test_figures_does_only_what_it_is_asked(tmp_path, capsys):
    log = _log(tmp_path / "m.log")
    assert cli(["analyze", "--log", str(log), "--out", str(tmp_path / "an"), "--no-figures"]) == 0
    capsys.readouterr()
    assert cli(["figures", str(tmp_path / "an" / "m.log.run"), "--analysis",
                str(tmp_path / "an"), "--out", str(tmp_path / "f"), "--formats", "png"]) == 0
    err = capsys.readouterr().err
    assert "fig_loss_spikes" in err and "[theory]" not in err and "fig_regime_map" not in err
    assert "no sweep table" not in err
    assert not (tmp_path / "f" / "theory").exists()
