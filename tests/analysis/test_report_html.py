"""The self-contained HTML report: written beside every report.md, rewritten by `adamspike
figures --analysis` with the run figures inline (base64 PNG), readable offline; checked
structurally here and, where a headless Chromium exists on the machine, rendered."""

import base64
import re
import shutil
import subprocess
import warnings

import numpy as np
import pytest

from analysis.cli import main as analyze
from figures.cli import generate
from tests.analysis.test_megatron_log import megds_line

IMG = re.compile(r'<img alt="([^"]*)" src="([^"]*)">')


def _log(tmp_path):
    """A log with a spike, a line without a loss and a jump of the iteration numbers (two
    excerpts of one run, as 03_bigscience_tr8_104b_exp12.log)."""
    lines = [megds_line(8700 + i, 3.3 + 0.01 * (i % 3), grad_norm=2e5 + 1e3 * i)
             for i in range(30)]
    lines[20] = megds_line(8720, 7.2, grad_norm=3e6)
    lines += [megds_line(9026, 3.2, grad_norm=2.1e5), megds_line(9027, None, grad_norm=2.2e5)]
    lines += [megds_line(9028 + i, 3.2, grad_norm=2.1e5 + i) for i in range(10)]
    log = tmp_path / "a_rather_long_run_name_from_a_real_cluster_job_tr8_104b_exp12.log"
    log.write_text("\n".join(lines) + "\n")
    return log


def _pngs(html):
    out = []
    for alt, src in IMG.findall(html):
        assert src.startswith("data:image/png;base64,"), src[:40]
        data = base64.b64decode(src.split(",", 1)[1], validate=True)
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
        out.append((alt, data))
    return out


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable",
                 "chrome", "headless_shell"):
        path = shutil.which(name)
        if path:
            return path
    for path in sorted(__import__("pathlib").Path.home().glob(
            ".cache/ms-playwright/chromium*/chrome-linux/chrome")):
        return str(path)
    return None


def test_html_report_is_self_contained_with_the_figures_inline(tmp_path, capsys):
    log = _log(tmp_path)
    out = tmp_path / "rep"
    assert analyze(["--log", str(log), "--out", str(out)]) == 0
    run = out / (log.name + ".run")
    html = (run / "report.html").read_text()
    assert "<h2>Numerics health</h2>" in html and "<table>" in html
    assert (out / "report.html").is_file()
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # no library warning leaks from the figures
        files, outcomes = generate([run], tmp_path / "fig", theory=False, analysis=out,
                                   registry=[("figures.fig_loss_spikes", "run"),
                                             ("figures.fig_grad_norm", "run")])
    assert all("warning" not in o.detail for o in outcomes), [o.detail for o in outcomes]
    html = (run / "report.html").read_text()
    pngs = _pngs(html)
    assert [alt for alt, _ in pngs] == ["grad_norm", "loss_spikes"]
    assert "src=\"figures/" not in html and "file:" not in html   # nothing outside the file
    page = tmp_path / "copy.html"            # readable alone, away from every figure file
    page.write_text(html)
    shutil.rmtree(tmp_path / "fig")
    assert len(_pngs(page.read_text())) == 2
    chrome = _chromium()
    if chrome is None:
        pytest.skip("no headless Chromium on this machine (chromium, chrome, playwright): "
                    "the HTML was checked structurally (every <img> inline, decodable PNG)")
    probe = page.with_name("probe.html")
    probe.write_text(page.read_text().replace(
        "</body>", "<script>window.addEventListener('load',()=>{const i=[...document.images];"
                   "document.body.setAttribute('data-loaded',i.filter(x=>x.complete&&"
                   "x.naturalWidth>0).length+'/'+i.length)});</script></body>"))
    # a fresh profile, and no background traffic: the CI machines have no network, and
    # Chromium's refused connections at start-up otherwise slow it down
    flags = [chrome, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    res = subprocess.run(flags + ["--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert 'data-loaded="2/2"' in res.stdout, res.stderr[-2000:]
    shot = tmp_path / "shot.png"
    subprocess.run(flags + [f"--screenshot={shot}", "--window-size=1200,3000", page.as_uri()],
                   capture_output=True, timeout=120)
    assert shot.is_file() and shot.stat().st_size > 10_000


def test_a_gap_in_the_log_breaks_the_line_and_long_titles_wrap():
    import matplotlib.pyplot as plt

    from figures import style
    from figures._common import break_gaps

    x, y = break_gaps([1, 2, 3, 4, 300, 301], [1.0, 2, 3, 4, 5, 6])
    assert len(x) == 7 and np.isnan(y[4]) and 4 < x[4] < 300
    x2, y2 = break_gaps([10, 20, 30, 40], [1.0, np.nan, 3, 4])
    assert len(x2) == 4                      # a NaN breaks the line already; no gap here
    style.apply()
    fig, ax = plt.subplots()
    title = "a_rather_long_run_name_from_a_real_cluster_job_tr8_104b_exp12.log.run: " * 2
    ax.set_title(title)
    style.wrap_titles(fig)
    fig.canvas.draw()
    box = ax.title.get_window_extent(fig.canvas.get_renderer())
    assert "\n" in ax.title.get_text()
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width
    plt.close(fig)
