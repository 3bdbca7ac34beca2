"""fullscale.telemetry equals adamspike.metrics.reference_metrics computed in numpy from the
same AdamW state, unsharded and sharded over 2 gloo processes (FSDP2), and the histograms
equal adamspike.metrics.histogram exactly."""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from adamspike.llama import PRESETS, spec_by_name
from adamspike.metrics import (HIST_EDGES, METRIC_NAMES, SAT_THRESHOLD, SUM_FIELDS, histogram,
                               reference_metrics, update_direction)
from adamspike.train_config import OptimSection
from fullscale.model import Transformer
from fullscale.optim import build_optimizer, clip_gradients
from fullscale.telemetry import DEFAULT_MAX_ELEMENTS, Telemetry, TensorBoardScalars, plan_chunks

TINY = PRESETS["tiny"]


pytestmark = pytest.mark.usefixtures("one_thread")


OPTIM = OptimSection(lr=1e-2, b1=0.9, b2=0.95, eps=1e-4, weight_decay=0.1, grad_clip=0.5)


U32 = 2.0 ** -24


def _reference(opt, named, m_prev, eps, b1, b2):
    """Per tensor: the numpy metrics, histogram, and what the tolerances need (float64)."""
    out = {}
    for name, p in named:
        st = opt.state[p]
        t = int(st["step"])
        m_t = st["exp_avg"].numpy().astype(np.float64)
        m_hat = m_t / (1 - b1 ** t)
        v_hat = st["exp_avg_sq"].numpy().astype(np.float64) / (1 - b2 ** t)
        g = p.grad.numpy().astype(np.float64)
        r = update_direction(m_hat, v_hat, eps)
        out[name] = dict(metrics=reference_metrics(g, m_hat, v_hat, m_prev[name], p.detach().numpy(), eps),
                         hist=histogram(r), r=r, g=g, m_t=m_t, m_prev=m_prev[name], b1=b1,
                         sqrt_v=np.sqrt(v_hat), eps=eps)
        out[name]["cos_bound"] = _cos_bound(out[name])
    return out


def _cos_bound(ref) -> float:
    """|error| of grad_mom_cos from recovering m_prev = (m_t - (1 - b1) g) / b1 out of the
    fp32-rounded m_t (lerp: 3 roundings of <= u (|m_t| + (1 - b1)(|g| + |m_prev|)) each),
    by Cauchy-Schwarz on <g, dm>, plus the fp32 compute of the sums."""
    g, m_t, m_prev, b1 = ref["g"], ref["m_t"], ref["m_prev"], ref["b1"]
    ng, nm = np.linalg.norm(g), np.linalg.norm(m_prev)
    if ng == 0 or nm == 0:
        return 0.0
    dm = 3 * U32 * (np.linalg.norm(m_t) + (1 - b1) * (ng + nm)) / b1
    return 2 * dm / nm + 1e-6


def _near(x, points, rel) -> int:
    """Elements of x within rel * max(|x|, |point|) of one of points (rounding can flip
    their side)."""
    x = np.asarray(x).ravel()[:, None]
    points = np.asarray(points, dtype=np.float64)[None, :]
    return int((np.abs(x - points) <= rel * np.maximum(np.abs(x), np.abs(points))).any(axis=1).sum())


def check_against_reference(columns, hists, i, ref, precision, where=""):
    """Telemetry row i vs the numpy reference of the same tensor, at the precision's
    tolerance: float64 computes the reference's own operations (1e-6 relative, identical
    histograms); float32 rounds each element to ~1e-7 relative (1e-5 on sums of positive
    terms; signed sums to 1e-5 of the mean of the magnitudes; threshold counts and bins may
    flip for elements within float32 rounding of the threshold / edge)."""
    want, r = ref["metrics"], ref["r"]
    n = r.size
    for k in METRIC_NAMES:
        got, exp = columns[k][i], want[k]
        if k == "grad_mom_cos":
            np.testing.assert_allclose(got, exp, rtol=0, atol=ref["cos_bound"], err_msg=f"{where} {k}")
        elif precision == "float64":
            np.testing.assert_allclose(got, exp, rtol=1e-6, atol=0, err_msg=f"{where} {k}")
        elif k in ("r_mean", "r_m3"):
            scale = np.mean(np.abs(r) ** (1 if k == "r_mean" else 3))
            np.testing.assert_allclose(got, exp, rtol=0, atol=1e-5 * scale + 1e-30, err_msg=f"{where} {k}")
        elif k == "sat_frac":
            flips = _near(np.abs(r), [SAT_THRESHOLD], 1e-5)
            np.testing.assert_allclose(got, exp, rtol=0, atol=flips / n, err_msg=f"{where} {k}")
        elif k == "eps_frac":
            flips = _near(ref["sqrt_v"], [ref["eps"]], 1e-5)
            np.testing.assert_allclose(got, exp, rtol=0, atol=flips / n, err_msg=f"{where} {k}")
        else:
            np.testing.assert_allclose(got, exp, rtol=1e-5, atol=0, err_msg=f"{where} {k}")
    if hists is not None:
        assert hists[i].sum() == n
        if precision == "float64":
            np.testing.assert_array_equal(hists[i], ref["hist"], err_msg=where)
        else:
            moved = np.abs(hists[i] - ref["hist"]).sum()
            assert moved <= 2 * _near(r, HIST_EDGES, 1e-5), (where, moved)


# 1000: tensors split across chunks and chunks shared by tensors (bounded temporaries)
# compile "on" on cpu: sums by the native kernel (fullscale.cpu_kernel), or with native
# False by the inductor kernels (what cuda runs, and cpu when the native kernel is missing)
@pytest.mark.parametrize("precision,compile,native", [
    ("float32", "on", True), ("float32", "on", False), ("float32", "off", False),
    ("float64", "on", True), ("float64", "off", False)])
@pytest.mark.parametrize("max_elements", [DEFAULT_MAX_ELEMENTS, 1000])
def test_metrics_equal_numpy_reference_unsharded(max_elements, precision, compile, native):
    torch.manual_seed(0)
    model = Transformer(TINY)
    model.init_weights(torch.Generator().manual_seed(0))
    opt = build_optimizer(model, OPTIM)
    tel = Telemetry(opt, spec_by_name(TINY), every=1, hist_every=2, max_elements=max_elements,
                    precision=precision, compile=compile)
    assert (tel._native is not None) == (compile == "on")
    if not native:
        tel._native = None
    named = list(model.named_parameters())
    gen = torch.Generator().manual_seed(1)
    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # a failed compile would warn
        for step in range(1, 5):
            x = torch.randint(0, TINY.vocab_size, (4, 17), generator=gen)
            opt.zero_grad()
            F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
            clip_gradients(model.parameters(), OPTIM.grad_clip)
            m_prev = {n: (opt.state[p]["exp_avg"].numpy().astype(np.float64).copy()
                          if p in opt.state else np.zeros(p.shape)) for n, p in named}
            tel.before_step(step)
            opt.step()
            out = tel.after_step(step)
            ref = _reference(opt, named, m_prev, OPTIM.eps, OPTIM.b1, OPTIM.b2)
            assert out.columns["name"] == [n for n, _ in named]
            assert (out.hists is not None) == (step % 2 == 0)
            for i, (name, _) in enumerate(named):
                check_against_reference(out.columns, out.hists, i, ref[name], precision,
                                        f"step {step} {name}")
                checked += 1
    assert checked == 4 * len(named)
    assert (tel._tensor_sums.compiled is not None) == (compile == "on")
    if native:   # sums and histograms never went through the inductor kernels
        assert tel._native is not None and not tel._tensor_sums.compiled
        assert not tel._bin_index.compiled
    # the run exercised the interesting regimes, not only one corner
    sat, eps_frac = out.columns["sat_frac"], out.columns["eps_frac"]
    assert 0 < sat.max() and sat.min() < 1 and eps_frac.max() > 0
    assert np.isnan(out.columns["grad_mom_cos"]).sum() == 0


def _trained_tiny(eps=OPTIM.eps, steps=3):
    model = Transformer(TINY)
    model.init_weights(torch.Generator().manual_seed(0))
    opt = build_optimizer(model, OptimSection(lr=1e-2, eps=eps, grad_clip=0.5))
    x = torch.randint(0, TINY.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("precision", ["float64", "float32"])
@pytest.mark.parametrize("eps", [1e-4, 0.0])
def test_native_kernel_equals_inductor_kernel(eps, precision):
    """The native multi-tensor kernels perform the inductor kernels' operations per element:
    the same r, so the same histograms, bit for bit; the counts of the sums exactly; the
    other sums to rounding (the two add a block's elements in a different order: float64
    measured <= 5e-15 relative)."""
    model, opt = _trained_tiny(eps)
    kw = dict(precision=precision, compile="on", hist_every=1)
    native = Telemetry(opt, spec_by_name(TINY), **kw)
    inductor = Telemetry(opt, spec_by_name(TINY), **kw)
    inductor._native = None
    for tel in (native, inductor):
        tel.before_step(4)
    opt.step()
    a, b = native.after_step(4), inductor.after_step(4)
    assert native._native is not None and inductor._tensor_sums.compiled
    np.testing.assert_array_equal(a.hists, b.hists)
    assert (a.hists.sum(1) == native.numel).all()
    finite = np.isfinite(b.sums)
    np.testing.assert_array_equal(np.isfinite(a.sums), finite)
    rtol = 1e-12 if precision == "float64" else 1e-5
    np.testing.assert_allclose(a.sums[finite], b.sums[finite], rtol=rtol, atol=0)
    counts = [SUM_FIELDS.index(f) for f in ("n", "sat", "eps_small")]
    np.testing.assert_array_equal(a.sums[:, counts], b.sums[:, counts])


def test_native_kernel_declines_what_it_cannot_read():
    """Non-contiguous, mixed-dtype or mis-sized tensors, a missing gradient or steps that
    are not tensors: the native kernel returns None (the trainer then copies into the
    inductor / eager kernels' buffer)."""
    from fullscale import cpu_kernel

    model, opt = _trained_tiny()
    tel = Telemetry(opt, spec_by_name(TINY), compile="on")
    params = tel.params
    sts = [opt.state[p] for p in params]
    sources = [[p.grad for p in params], [s["exp_avg"] for s in sts],
               [s["exp_avg_sq"] for s in sts], params]
    steps = [s["step"] for s in sts]
    call = lambda src, st=steps: tel._native(src, st, tel._native_base, 0.9, 0.95, 1e-4)  # noqa: E731
    assert call(sources) is not None
    w = next(i for i, p in enumerate(params) if p.ndim == 2)
    for k, bad in ((0, sources[0][w].t()), (1, sources[1][w].double()), (0, None),
                   (2, sources[2][w][:1])):
        src = [list(x) for x in sources]
        src[k][w] = bad
        assert call(src) is None
    assert call(sources, [torch.tensor([float(s)]) for s in range(len(steps))]) is not None
    assert call(sources, [int(s) for s in steps]) is None
    assert isinstance(tel._native, cpu_kernel.NativeSums)


def test_native_kernel_unavailable_is_a_warning_and_the_other_kernels_run(tmp_path, monkeypatch):
    from fullscale import cpu_kernel

    monkeypatch.setenv("ADAMSPIKE_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(cpu_kernel, "_LOADED", {})
    model, opt = _trained_tiny()
    with pytest.warns(RuntimeWarning, match="native CPU sums kernel is unavailable"):
        tel = Telemetry(opt, spec_by_name(TINY), compile="on")
    assert tel._native is None and tel._tensor_sums.compiled is not None
    assert not list((tmp_path / "kernels").glob("*.so"))


def test_plan_chunks_covers_every_element_once_within_the_bound():
    sizes = [5, 0, 12, 3, 12, 7]
    for max_elements in (1, 4, 12, 100):
        chunks = plan_chunks(sizes, max_elements)
        assert all(sum(hi - lo for _, lo, hi in c) <= max_elements for c in chunks)
        covered = {i: [] for i in range(len(sizes))}
        for c in chunks:
            for i, lo, hi in c:
                assert 0 <= lo < hi <= sizes[i]
                covered[i].append((lo, hi))
        for i, n in enumerate(sizes):   # contiguous pieces tiling [0, n) in order
            pieces = covered[i]
            starts = [lo for lo, _ in pieces]
            assert starts == ([0] + [hi for _, hi in pieces[:-1]] if n else [])
            assert (pieces[-1][1] if pieces else 0) == n
    with pytest.raises(ValueError, match="max_elements"):
        Telemetry(build_optimizer(Transformer(TINY), OPTIM), spec_by_name(TINY), max_elements=0)


def test_before_step_is_required_and_every_is_honoured():
    model = Transformer(TINY)
    model.init_weights(torch.Generator().manual_seed(0))
    opt = build_optimizer(model, OPTIM)
    tel = Telemetry(opt, spec_by_name(TINY), every=3, hist_every=0)
    x = torch.randint(0, TINY.vocab_size, (2, 9))
    model(x).sum().backward()
    tel.before_step(1)
    opt.step()
    assert tel.after_step(1) is None            # not a logged step
    opt.step()
    with pytest.raises(RuntimeError, match="before_step"):
        tel.after_step(3)


def test_tensorboard_missing_is_a_warning_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)    # import -> ImportError
    with pytest.warns(RuntimeWarning, match="TensorBoard is unavailable"):
        tb = TensorBoardScalars(tmp_path / "tb")
    tb.log(1, {"loss": 1.0})
    tb.close()


def test_tensorboard_scalars_carry_the_probes_group_medians(tmp_path):
    """The trainer's TensorBoard scalars include adamspike/KIND/METRIC, the per-group medians
    the Megatron probe writes (fullscale.probe.tensorboard.group_medians)."""
    pytest.importorskip("tensorboard")
    import types
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from adamspike.metrics import METRIC_NAMES
    cols = {"name": ["a", "b", "c"], "kind": ["wq", "wq", "w2"],
            **{m: np.array([1.0, 3.0, 5.0]) for m in METRIC_NAMES}}
    cols["rho"] = np.array([0.1, 0.3, np.nan])
    tb = TensorBoardScalars(tmp_path / "tb")
    tb.log(4, {"loss": 2.0}, types.SimpleNamespace(columns=cols))
    tb.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert acc.Scalars("adamspike/wq/rho")[0].value == pytest.approx(0.2)
    assert "adamspike/w2/rho" not in tags and acc.Scalars("adamspike/w2/update_rms")[0].value == 5.0
    assert "train/loss" in tags and "rho/a" in tags


WORKER = textwrap.dedent('''
    import json, os, sys
    import numpy as np, torch, torch.distributed as dist, torch.multiprocessing as mp
    import torch.nn.functional as F
    from adamspike.llama import PRESETS, spec_by_name
    from adamspike.metrics import (HIST_EDGES, METRIC_NAMES, SAT_THRESHOLD, histogram,
                               reference_metrics, update_direction)
    from adamspike.train_config import OptimSection
    from fullscale.model import Transformer
    from fullscale.optim import build_optimizer, clip_gradients
    from fullscale.parallelize import parallelize
    from fullscale.telemetry import Telemetry, telemetry_vhists
    from adamspike.metrics import vhistogram

    def cos_bound(g, m_t, m_prev, b1):
        # as tests/fullscale/test_telemetry.py::_cos_bound (this script runs on its own)
        ng, nm = np.linalg.norm(g), np.linalg.norm(m_prev)
        if ng == 0 or nm == 0:
            return 0.0
        dm = 3 * 2.0 ** -24 * (np.linalg.norm(m_t) + (1 - b1) * (ng + nm)) / b1
        return 2 * dm / nm + 1e-6

    def step_loss(model, x):
        return F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())

    def run(rank, world, port, out, optim):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        cfg = PRESETS["tiny"]
        # rank 0 also trains an unsharded replica on the whole batch (before the group exists)
        if rank == 0:
            plain = Transformer(cfg)
            plain.init_weights(torch.Generator().manual_seed(0))
            plain_opt = build_optimizer(plain, optim)
            plain_tel = Telemetry(plain_opt, spec_by_name(cfg), every=1, hist_every=1,
                                  precision="float64")
        dist.init_process_group("gloo", rank=rank, world_size=world)
        with torch.device("meta"):
            model = Transformer(cfg)
        parallelize(model, world, activation_checkpointing=False, mixed_precision="fp32",
                    device=torch.device("cpu"))
        model.to_empty(device="cpu")
        model.init_weights(torch.Generator().manual_seed(0))
        opt = build_optimizer(model, optim)
        tel = Telemetry(opt, spec_by_name(cfg), every=1, hist_every=1, precision="float64")
        named = list(model.named_parameters())
        gen = torch.Generator().manual_seed(1)
        result = {}
        for step in (1, 2, 3):
            x = torch.randint(0, cfg.vocab_size, (4, 17), generator=gen)
            opt.zero_grad()
            step_loss(model, x[rank * 4 // world:(rank + 1) * 4 // world]).backward()
            clip_gradients(model.parameters(), optim.grad_clip)
            m_prev = {n: opt.state[p]["exp_avg"].full_tensor().numpy().astype(np.float64)
                      if p in opt.state else np.zeros(p.shape) for n, p in named}
            tel.before_step(step)
            opt.step()
            o = tel.after_step(step)
            vh = telemetry_vhists(tel, step)   # local shards' counts, all-reduced
            # numpy reference on the gathered full tensors (what one process would see)
            ref, hist, bound, vref = {}, [], {}, []
            for n, p in named:
                st = opt.state[p]
                t = int(st["step"])
                m_t = st["exp_avg"].full_tensor().numpy().astype(np.float64)
                m_hat = m_t / (1 - optim.b1 ** t)
                v_hat = st["exp_avg_sq"].full_tensor().numpy().astype(np.float64) / (1 - optim.b2 ** t)
                g = p.grad.full_tensor().numpy().astype(np.float64)
                r = reference_metrics(g, m_hat, v_hat, m_prev[n], p.detach().full_tensor().numpy(),
                                      optim.eps)
                ref[n] = [r[k] for k in METRIC_NAMES]
                bound[n] = cos_bound(g, m_t, m_prev[n], optim.b1)
                hist.append(histogram(update_direction(m_hat, v_hat, optim.eps)).tolist())
                vref.append(vhistogram(v_hat, optim.eps).tolist()
                            + [int(np.sum(np.abs(g) < optim.eps))])
            result[step] = {"got": {k: np.asarray(o.columns[k]).tolist() for k in METRIC_NAMES},
                            "vhist": vh.tolist(), "ref_vhist": vref,
                            "hist": o.hists.tolist(), "ref": ref, "ref_hist": hist, "bound": bound,
                            "names": o.columns["name"]}
            if rank == 0:
                plain_opt.zero_grad()
                step_loss(plain, x).backward()
                clip_gradients(plain.parameters(), optim.grad_clip)
                plain_tel.before_step(step)
                plain_opt.step()
                po = plain_tel.after_step(step)
                result[step]["plain"] = {k: np.asarray(po.columns[k]).tolist() for k in METRIC_NAMES}
        if rank == 0:
            with open(out, "w") as fh:
                json.dump(result, fh)
        dist.destroy_process_group()

    if __name__ == "__main__":
        optim = OptimSection(**json.loads(sys.argv[2]))
        # fork: the children reuse the parent's imports (2 cores; spawn re-imports torch)
        mp.start_processes(run, args=(2, int(sys.argv[3]), sys.argv[1], optim), nprocs=2,
                           start_method=os.environ.get("START", "fork"))
''')


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sharded_two_processes_equal_reference_and_unsharded(tmp_path):
    script, out = tmp_path / "worker.py", tmp_path / "out.json"
    script.write_text(WORKER)
    optim = json.dumps({"lr": 1e-2, "eps": 1e-4, "weight_decay": 0.1, "grad_clip": 0.5})
    p = subprocess.run([sys.executable, str(script), str(out), optim, str(_free_port())],
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    res = json.loads(out.read_text())
    assert sorted(res) == ["1", "2", "3"]
    for step, r in res.items():
        got = np.array([r["got"][k] for k in METRIC_NAMES]).T
        ref = np.array([r["ref"][n] for n in r["names"]])
        cos = METRIC_NAMES.index("grad_mom_cos")
        exact = [j for j in range(len(METRIC_NAMES)) if j != cos]
        np.testing.assert_allclose(got[:, exact], ref[:, exact], rtol=1e-6, err_msg=f"step {step}")
        # m_prev recovered from the fp32 m_t: within the rounding bound
        bound = np.array([r["bound"][n] for n in r["names"]])
        both_nan = np.isnan(got[:, cos]) & np.isnan(ref[:, cos])   # step 1: m_prev = 0
        assert (both_nan | (np.abs(got[:, cos] - ref[:, cos]) <= bound)).all(), (step, got[:, cos] - ref[:, cos], bound)
        np.testing.assert_array_equal(np.array(r["hist"]), np.array(r["ref_hist"]))
        np.testing.assert_array_equal(np.array(r["vhist"]), np.array(r["ref_vhist"]))
        # unsharded replica on the whole batch: gradients differ only by fp32 summation order
        for k in METRIC_NAMES:
            x, y = np.array(r["got"][k]), np.array(r["plain"][k])
            if k in ("sat_frac", "eps_frac"):   # threshold counts: allow a flipped element
                np.testing.assert_allclose(x, y, atol=2 / 64, err_msg=k)
            else:
                np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-7, err_msg=f"{step} {k}")


def test_trainer_with_compiled_kernels_logs_what_eager_logs(tmp_path):
    """The trainer's default on cpu (telemetry.compile = auto -> compiled kernels) writes
    the layers and histograms the eager kernels write, to float32 rounding."""
    from adamspike.rundir import load_run
    from fullscale.train import main

    args = ["--model.preset", "tiny", "--train.global_batch_size", "4", "--train.seq_len", "16",
            "--train.num_steps", "6", "--telemetry.hist_every", "3", "--telemetry.flush_every_s", "0"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # a failed compile would warn
        assert main(["--out", str(tmp_path / "on"), *args, "--telemetry.compile", "on"]) == 0
    assert main(["--out", str(tmp_path / "off"), *args, "--telemetry.compile", "off"]) == 0
    on, off = load_run(tmp_path / "on"), load_run(tmp_path / "off")
    np.testing.assert_array_equal(on.steps["loss"], off.steps["loss"])   # telemetry only reads
    assert len(on.layers) == len(off.layers) == 6 * len(spec_by_name(TINY))
    for k in METRIC_NAMES:
        np.testing.assert_allclose(on.layers[k], off.layers[k], rtol=1e-4, atol=1e-6, err_msg=k)
    h_on, h_off = np.stack(on.hists["counts"]), np.stack(off.hists["counts"])
    assert (h_on.sum(1) == h_off.sum(1)).all() and np.abs(h_on - h_off).sum() <= 4


@pytest.mark.parametrize("compile,native", [("on", True), ("off", False)])
def test_group_eps_and_explicit_m_prev_after_moment_edits(compile, native):
    """Per-group eps (adamspike.mitigations' plan: one param group per eps) enters each
    tensor's metrics, and with explicit_m_prev the momentum the step read is copied in
    before_step: after edits of both moments (v reset by fullscale.optim, and m scaled, as
    a momentum-editing mitigation would), grad_mom_cos is cos(g_t, m_{t-1}) of the edited
    m, on the native and the eager path alike."""
    from adamspike import mitigations
    from adamspike.train_config import RunConfig
    from fullscale.optim import reset_second_moment

    cfg = RunConfig.from_dict({"mitigation.eps_embed": 1e-3, "mitigation.eps_shallow": 1e-5,
                               "mitigation.v_reset_steps": [3]})
    specs = spec_by_name(TINY)
    plan = mitigations.plan(cfg, {n: s.depth for n, s in specs.items()}, TINY.num_layers)
    torch.manual_seed(0)
    model = Transformer(TINY)
    model.init_weights(torch.Generator().manual_seed(0))
    opt = build_optimizer(model, OPTIM, plan)
    assert len(opt.param_groups) == 3
    tel = Telemetry(opt, specs, every=1, compile=compile, explicit_m_prev=True)
    if not native:
        tel._native = None
    named = list(model.named_parameters())
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 5):
        x = torch.randint(0, TINY.vocab_size, (4, 17), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        if step in plan.v_reset:
            assert reset_second_moment(opt, plan.v_reset[step]) > 0
            for p in model.parameters():                 # a momentum edit
                opt.state[p]["exp_avg"].mul_(0.5)
        m_prev = {n: (opt.state[p]["exp_avg"].numpy().astype(np.float64).copy()
                      if p in opt.state else np.zeros(p.shape)) for n, p in named}
        tel.before_step(step)
        opt.step()
        out = tel.after_step(step)
        for i, (name, p) in enumerate(named):
            eps = plan.tensor_eps[name]
            ref = _reference(opt, [(name, p)], m_prev, eps, OPTIM.b1, OPTIM.b2)[name]
            check_against_reference(out.columns, None, i, ref, "float32", f"step {step} {name}")
            assert out.columns["rho"][i] == pytest.approx(out.columns["grad_rms"][i] / eps, rel=1e-12)
    assert (tel._native is not None) == native
