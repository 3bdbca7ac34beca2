"""TensorBoard in: a Megatron TensorBoard log dir, written by torch.utils.tensorboard with
Megatron's training_log tag names, gives `analyze --log` and `assess` the same steps and the
same spikes as the equivalent text log (analysis.megatron_tb feeds the text log's parser)."""

import numpy as np
import pytest

pytest.importorskip("tensorboard")
SummaryWriter = pytest.importorskip("torch.utils.tensorboard").SummaryWriter

from adamspike.megatron_log import MegatronLogError  # noqa: E402
from adamspike.rundir import load_run  # noqa: E402
from analysis.megatron_tb import tensorboard_lines  # noqa: E402

N = 300


def megatron_series(n=N, seed=0, cuts=()):
    """n logged iterations of a bf16-like run with loss spikes at 151 and 241 (grad-norm
    spikes with them); `cuts`: iterations whose update an fp16 overflow skipped (the loss
    scale halves there and stays halved; no grad norm)."""
    rng = np.random.default_rng(seed)
    loss = 3.0 * np.exp(-np.arange(n) / 400) + 0.02 * rng.standard_normal(n)
    loss[150:154] += [1.5, 0.9, 0.4, 0.1]
    loss[240] += 2.0
    gn = 0.5 + 0.05 * rng.standard_normal(n)
    gn[150], gn[240] = 4.0, 6.0
    lr = np.minimum(1e-4, 1e-4 * np.arange(1, n + 1) / 50)
    scale = np.full(n, 1.0 if not cuts else 65536.0)
    for c in cuts:
        scale[c - 1:] /= 2
    gn[[c - 1 for c in cuts]] = np.nan
    return {"loss": loss, "grad_norm": gn, "lr": lr, "loss_scale": scale}


def write_tb(writer, series, steps):
    """Iterations `steps` (1-based) through a SummaryWriter as Megatron's training_log
    writes them (its tag order, the `vs samples` twins; no grad-norm when it is None)."""
    for s in steps:
        i = s - 1
        for tag, v in (("learning-rate", series["lr"][i]), ("batch-size", 1024),
                       ("lm loss", series["loss"][i]), ("loss-scale", series["loss_scale"][i]),
                       ("grad-norm", series["grad_norm"][i])):
            if np.isnan(v):
                continue
            writer.add_scalar(tag, v, s)
            writer.add_scalar(tag + " vs samples", v, s * 1024)
    writer.flush()


def text_log(series, path):
    """The same iterations as Megatron's text log prints them (float32 values: what
    TensorBoard stores); a skipped iteration with the counters and no loss / grad norm, as
    training_log prints an interval of skipped iterations only."""
    n = len(series["loss"])
    lines = []
    for i in range(n):
        s = i + 1
        lv, gv, lrv = (float(np.float32(series[k][i])) for k in ("loss", "grad_norm", "lr"))
        skipped = np.isnan(gv)
        lines.append(f" iteration {s:8d}/{n:8d} | consumed samples: {s * 1024:12d} | "
                     f"learning rate: {lrv!r} | global batch size:  1024 | "
                     + ("" if skipped else f"lm loss: {lv!r} | ")
                     + f"loss scale: {float(series['loss_scale'][i])!r} | "
                     + ("" if skipped else f"grad norm: {gv!r} | ")
                     + f"number of skipped iterations: {int(skipped):3d} | "
                     "number of nan iterations:   0 |\n")
    path.write_text("".join(lines))
    return path


def _logs(tmp_path):
    """The same 300 iterations as TensorBoard events (Megatron's tags, with the `vs samples`
    twins) and as a Megatron text log."""
    series = megatron_series()
    w = SummaryWriter(str(tmp_path / "tb"))
    write_tb(w, series, range(1, N + 1))
    w.close()
    return tmp_path / "tb", text_log(series, tmp_path / "train.log")


def test_tensorboard_dir_gives_the_text_logs_steps_and_spikes(tmp_path):
    from analysis.cli import main as analyze_main
    tb, text = _logs(tmp_path)
    assert analyze_main(["--log", str(tb), "--out", str(tmp_path / "a")]) == 0
    assert analyze_main(["--log", str(text), "--out", str(tmp_path / "b")]) == 0
    (ra,), (rb,) = (list((tmp_path / d).glob("*.run")) for d in ("a", "b"))
    sa, sb = load_run(ra).steps, load_run(rb).steps
    for c in ("step", "loss", "lr", "grad_norm", "skipped", "loss_scale"):
        np.testing.assert_array_equal(sa[c].to_numpy(), sb[c].to_numpy())
    spikes_a, spikes_b = ((r / "spikes.csv").read_text() for r in (ra, rb))
    assert spikes_a == spikes_b and spikes_a.count("\n") == 3          # two spikes: 151, 241
    assert (ra / "grad_norm_spikes.csv").read_text() == (rb / "grad_norm_spikes.csv").read_text()


def test_assess_reads_a_tensorboard_dir(tmp_path, capsys):
    from analysis.assess import main as assess_main
    tb, text = _logs(tmp_path)
    assert assess_main([str(tb)]) == 0
    a = capsys.readouterr().out
    assert assess_main([str(text)]) == 0
    b = capsys.readouterr().out
    body = [x for x in a.splitlines()[2:] if "signals:" not in x]
    assert body == [x for x in b.splitlines()[2:] if "signals:" not in x]


def test_a_tensorboard_dir_without_megatron_tags_is_refused(tmp_path):
    w = SummaryWriter(str(tmp_path / "tb"))
    w.add_scalar("train/loss", 1.0, 1)
    w.close()
    with pytest.raises(MegatronLogError, match="no 'lm loss' scalars"):
        tensorboard_lines(tmp_path / "tb")


def test_a_run_directory_with_its_own_tensorboard_scalars_is_not_a_log(tmp_path):
    from analysis.megatron_tb import is_tensorboard_dir
    tb, _ = _logs(tmp_path)
    assert is_tensorboard_dir(tb) and is_tensorboard_dir(tmp_path)
    (tmp_path / "run.json").write_text("{}")
    assert not is_tensorboard_dir(tmp_path)
