"""`watch` on a Megatron TensorBoard log directory while the job writes it: event files
written by torch.utils.tensorboard's SummaryWriter with Megatron's tags (the analyze round
trip's writer, tests/analysis/test_megatron_tb.py), appended in pieces and then continued
in a new events file (a restarted job), give the same spikes as the equivalent text log,
the same events as reading the finished directory at once, and one --on-event hook per
episode, as the text log's watch does."""

import threading
import time

import pytest

pytest.importorskip("tensorboard")
SummaryWriter = pytest.importorskip("torch.utils.tensorboard").SummaryWriter

from analysis.watch import _Stop, watch  # noqa: E402
from tests.analysis.test_megatron_tb import N, megatron_series, text_log, write_tb  # noqa: E402
from tests.analysis.test_watch import offline  # noqa: E402
from tests.analysis.test_watch_faults import hook_cmd, hooked  # noqa: E402

SPIKES = ("loss_spike", "grad_norm_spike")


def _starts(evs):
    return {k: [e["step"] for e in evs if e["kind"] == k] for k in SPIKES}


def test_watch_follows_a_tensorboard_dir_as_the_job_writes_it(tmp_path):
    series = megatron_series(cuts=(100,))           # an fp16 overflow at 100: a scale cut
    tb = tmp_path / "tb"
    first = SummaryWriter(str(tb))                  # Megatron creates its writer at start
    stop, live, hooks = _Stop(), [], tmp_path / "live.hooks"
    th = threading.Thread(target=lambda: live.extend(
        watch(tb, poll=0.02, stop=stop, quiet=True, on_event=hook_cmd(hooks))))
    th.start()
    try:
        write_tb(first, series, range(1, 121))
        time.sleep(0.6)
        write_tb(first, series, range(121, 201))
        t0 = time.monotonic()       # the hooks say what was reported while the file grew
        while 151 not in [e["step"] for e in hooked(hooks)] and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        hooked_before_restart = [e["step"] for e in hooked(hooks)]
        first.close()
        second = SummaryWriter(str(tb))             # a restarted job: a new events file,
        write_tb(second, series, range(181, N + 1))  # from its checkpoint at 180
        second.close()
        time.sleep(1.0)
    finally:
        stop.flag = True
        th.join(20)
    assert not th.is_alive()
    assert len(list(tb.glob("events.out.tfevents.*"))) == 2
    # the first file's spike was reported while the file was written, before the restart
    assert 151 in hooked_before_restart and 241 not in hooked_before_restart
    # the same spikes as the text log, offline and watched
    text = text_log(series, tmp_path / "train.log")
    want = offline(text, tmp_path / "out")
    got = _starts(live)
    assert got == {k: want[k] for k in SPIKES} == _starts(watch(text, once=True, quiet=True))
    assert got["loss_spike"] == [151, 241] and 151 in got["grad_norm_spike"]
    # the same events as the finished directory read at once; the overflow as its scale cut
    at_once_hooks = tmp_path / "once.hooks"
    at_once = watch(tb, once=True, quiet=True, on_event=hook_cmd(at_once_hooks))
    key = [(e["kind"], e["step"]) for e in live]
    assert key == [(e["kind"], e["step"]) for e in at_once]
    assert ("loss_scale_cut", 100) in key
    # hooks: once per episode, at the same steps as the text log's watch
    text_hooks = tmp_path / "text.hooks"
    watch(text, once=True, quiet=True, on_event=hook_cmd(text_hooks))
    steps = [e["step"] for e in hooked(hooks)]
    assert steps == [e["step"] for e in hooked(at_once_hooks)]
    assert steps == [e["step"] for e in hooked(text_hooks)]
    assert len(steps) == len({e["episode"] for e in live}) < len(live)


def test_a_tensorboard_dir_without_events_is_waited_for_and_once_refuses_it(tmp_path):
    from adamspike.megatron_log import MegatronLogError
    tb = tmp_path / "tb"
    tb.mkdir()
    with pytest.raises(MegatronLogError):
        watch(tb, once=True, quiet=True)
    stop, live = _Stop(), []
    th = threading.Thread(target=lambda: live.extend(watch(tb, poll=0.02, stop=stop,
                                                           quiet=True)))
    th.start()
    try:
        time.sleep(0.3)                              # no events file yet: waiting
        w = SummaryWriter(str(tb))
        write_tb(w, megatron_series(), range(1, 201))
        w.close()
        time.sleep(1.0)
    finally:
        stop.flag = True
        th.join(20)
    assert _starts(live)["loss_spike"] == [151]      # 241 not written


def test_the_cli_refuses_a_folder_with_neither_run_json_nor_events(tmp_path, capsys):
    from analysis.watch import main
    assert main([str(tmp_path), "--once"]) == 2
    assert "nor a TensorBoard log directory" in capsys.readouterr().err


def test_a_restarted_job_in_a_new_events_file_rewinds_as_its_text_log_does(tmp_path):
    """The first job writes iterations 1-260 (spikes at 151 and 241); a restarted job
    writes a new events file from its checkpoint at 230 without the spike at 241: watch on
    the directory reports what the text log of the same two jobs (appended) gives: the
    same spikes and restart, and analyze keeps the restarted job's lines."""
    first, second = megatron_series(), megatron_series()
    second["loss"][240] = second["loss"][239]          # the re-run does not spike at 241
    second["grad_norm"][240] = second["grad_norm"][239]
    tb = tmp_path / "tb"
    for series, steps in ((first, range(1, 261)), (second, range(231, N + 1))):
        w = SummaryWriter(str(tb))
        write_tb(w, series, steps)
        w.close()
    text = tmp_path / "train.log"
    a = text_log(first, tmp_path / "a.log").read_text().splitlines(keepends=True)
    b = text_log(second, tmp_path / "b.log").read_text().splitlines(keepends=True)
    text.write_text("".join(a[:260] + b[230:]))
    key = ("loss_spike", "grad_norm_spike", "restart")
    got, want = (
        [(e["kind"], e["step"]) for e in watch(p, once=True, quiet=True) if e["kind"] in key]
        for p in (tb, text))
    assert got == want
    # 231-240 are re-run with the same values (taken as repeated prints, as in the text
    # log); 241 differs: the restart, after the first job's spike at 241 was reported live
    assert got.index(("loss_spike", 241)) < got.index(("restart", 241))
    assert offline(tb, tmp_path / "o1")["loss_spike"] == offline(text, tmp_path / "o2")[
        "loss_spike"] == [151]                                         # the later lines win
