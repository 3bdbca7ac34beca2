"""The numerics-health section: loss-scale changes, overflowed / skipped / NaN iterations
and stale grad norms of an imported log, each placed against the spike timeline."""

import pytest

from analysis.megatron_log import import_megatron_log
from analysis.report import analyze_run, render_markdown
from tests.analysis.test_megatron_log import (REAL_ONSETS, REALLOGS, deepspeed_overflow,
                                              megds_line)


def _analyze(lines, tmp_path):
    log = tmp_path / "train.log"
    log.write_text("\n".join(lines) + "\n")
    import_megatron_log(log, tmp_path / "run")
    ra = analyze_run(tmp_path / "run")
    return ra, render_markdown(ra)


def test_loss_scale_cascade_next_to_a_spike_is_a_numerics_event(tmp_path):
    """tr1-13B-like: log interval 10, grad norm 0.000, the loss scale 65536 -> 8192 -> 4096
    at the spike; a second, later spike with a clean loss scale."""
    scales = [32768.0] * 10 + [65536.0, 8192.0, 4096.0] + [4096.0] * 27
    losses = [2.77] * 11 + [7.34, 7.9] + [2.76] * 17 + [6.0] + [2.75] * 9
    lines = [megds_line(29000 + 10 * i, x, loss_scale=s, grad_norm=0.0)
             for i, (x, s) in enumerate(zip(losses, scales))]
    ra, md = _analyze(lines, tmp_path)
    assert list(ra.spikes["start"]) == [29110, 29300]
    h = ra.numerics
    assert h.loss_scale["cuts"] == 2 and h.loss_scale["raises"] == 1
    cuts = h.events[h.events["kind"] == "loss_scale_cut"]
    assert list(cuts["step"]) == [29110, 29120]
    assert list(cuts["position"]) == ["during", "during"]
    assert "## Numerics health" in md and "Loss scale 32768 -> 4096" in md
    assert "spike at step 29110: next to fp16 overflow activity (2 loss-scale cut(s)" in md
    assert "spike at step 29300: no loss-scale cut, overflow, skip or NaN iteration" in md


def test_deepspeed_overflow_lines_and_stale_grad_norms_are_placed(tmp_path):
    lines = [megds_line(17030 + i, 2.66 + 0.003 * (i % 3), loss_scale=1048576.0,
                        grad_norm=4.5e5 + 1e3 * i) for i in range(30)]
    scale = 1048576.0
    for i in range(4):
        lines.append(deepspeed_overflow(scale, scale / 2))
        lines.append(megds_line(17060 + i, 4.37, loss_scale=scale, grad_norm=9e5))
        scale /= 2
    lines.append(megds_line(17064, 2.7, loss_scale=scale, grad_norm=4.7e5))
    ra, md = _analyze(lines, tmp_path)
    assert list(ra.spikes["start"]) == [17060]
    kinds = ra.numerics.events["kind"].value_counts().to_dict()
    assert kinds["overflow"] == 4 and kinds["loss_scale_cut"] == 4
    assert kinds["stale_grad_norm"] == 3             # 17061-17063 repeat 17060's value
    assert "4 overflowed step(s)" in md
    assert "1 DeepSpeed OVERFLOW line(s): step skipped" in md


def test_a_run_without_numerics_signals_says_so(tmp_path):
    from tests.analysis.test_megatron_log import megatron_line

    lines = [megatron_line(i, 2.2 if i != 20 else 5.0) for i in range(1, 31)]
    lines = [ln.replace(" loss scale: 1.0 |", "") for ln in lines]
    ra, md = _analyze(lines, tmp_path)
    assert ra.numerics.signals == ["skipped / nan counters"]
    assert "spike at step 20: no loss-scale cut, overflow, skip or NaN iteration" in md


REAL_HEALTH = {  # file: (spike onset, what the health section must say about it)
    "02_bigscience_tr1_13b.log": (29050, "Loss scale 32768 -> 4096 (min 4096 at step 29060): "
                                         "2 cut(s), 1 raise(s)."),
    "03_bigscience_tr8_104b_exp12.log": (8743, "| 9027 | loss_scale_cut | loss scale 16384 -> "
                                               "8192 (x0.5) |"),
    "04_bigscience_tr8b_104b_embnorm.log": (17062, "6 overflowed step(s)"),
}


@pytest.mark.skipif(not REALLOGS.is_dir(), reason="../shared/reallogs not present")
@pytest.mark.parametrize("name", sorted(REAL_HEALTH))
def test_real_13b_and_104b_logs_show_their_health_lines(name, tmp_path):
    import_megatron_log(REALLOGS / name, tmp_path / "run")
    ra = analyze_run(tmp_path / "run")
    md = render_markdown(ra)
    onset, line = REAL_HEALTH[name]
    assert REAL_ONSETS[name] in list(ra.spikes["start"])
    assert line in md, md.split("## Numerics health")[1][:2000]
    per = ra.numerics.per_spike.set_index("start")
    assert per.loc[onset, "verdict"].startswith("next to fp16 overflow activity")
