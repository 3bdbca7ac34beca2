"""fullscale.telemetry equals adamspike.metrics.reference_metrics computed in numpy from the
same AdamW state, unsharded and sharded over 2 gloo processes (FSDP2), and the histograms
equal adamspike.metrics.histogram exactly."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from adamspike.llama import PRESETS, spec_by_name
from adamspike.metrics import METRIC_NAMES, histogram, reference_metrics, update_direction
from adamspike.train_config import OptimSection
from fullscale.model import Transformer
from fullscale.optim import build_optimizer, clip_gradients
from fullscale.telemetry import DEFAULT_MAX_ELEMENTS, Telemetry, TensorBoardScalars, plan_chunks

TINY = PRESETS["tiny"]


pytestmark = pytest.mark.usefixtures("one_thread")


OPTIM = OptimSection(lr=1e-2, b1=0.9, b2=0.95, eps=1e-4, weight_decay=0.1, grad_clip=0.5)


def _reference(opt, named, m_prev, eps, b1, b2):
    out = {}
    for name, p in named:
        st = opt.state[p]
        t = int(st["step"])
        m_hat = st["exp_avg"].numpy().astype(np.float64) / (1 - b1 ** t)
        v_hat = st["exp_avg_sq"].numpy().astype(np.float64) / (1 - b2 ** t)
        g = p.grad.numpy()
        out[name] = (reference_metrics(g, m_hat, v_hat, m_prev[name], p.detach().numpy(), eps),
                     histogram(update_direction(m_hat, v_hat, eps)))
    return out


# 1000: tensors split across chunks and chunks shared by tensors (bounded temporaries)
@pytest.mark.parametrize("max_elements", [DEFAULT_MAX_ELEMENTS, 1000])
def test_metrics_equal_numpy_reference_unsharded(max_elements):
    torch.manual_seed(0)
    model = Transformer(TINY)
    model.init_weights(torch.Generator().manual_seed(0))
    opt = build_optimizer(model, OPTIM)
    tel = Telemetry(opt, spec_by_name(TINY), every=1, hist_every=2, max_elements=max_elements)
    named = list(model.named_parameters())
    gen = torch.Generator().manual_seed(1)
    checked = 0
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
            metrics, hist = ref[name]
            for k in METRIC_NAMES:
                np.testing.assert_allclose(out.columns[k][i], metrics[k], rtol=1e-6, atol=0,
                                           err_msg=f"step {step} {name} {k}")
            if out.hists is not None:
                np.testing.assert_array_equal(out.hists[i], hist)
                assert out.hists[i].sum() == out.columns["numel"][i]
            checked += 1
    assert checked == 4 * len(named)
    # the run exercised the interesting regimes, not only one corner
    sat, eps_frac = out.columns["sat_frac"], out.columns["eps_frac"]
    assert 0 < sat.max() and sat.min() < 1 and eps_frac.max() > 0
    assert np.isnan(out.columns["grad_mom_cos"]).sum() == 0


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


def test_tensorboard_missing_is_a_warning_not_a_crash(tmp_path):
    try:
        import tensorboard  # noqa: F401
        pytest.skip("tensorboard is installed here; the missing-package path cannot be exercised")
    except ImportError:
        pass
    with pytest.warns(RuntimeWarning, match="TensorBoard is unavailable"):
        tb = TensorBoardScalars(tmp_path / "tb")
    tb.log(1, {"loss": 1.0})
    tb.close()


WORKER = textwrap.dedent('''
    import json, os, sys
    import numpy as np, torch, torch.distributed as dist, torch.multiprocessing as mp
    import torch.nn.functional as F
    from adamspike.llama import PRESETS, spec_by_name
    from adamspike.metrics import METRIC_NAMES, histogram, reference_metrics, update_direction
    from adamspike.train_config import OptimSection
    from fullscale.model import Transformer
    from fullscale.optim import build_optimizer, clip_gradients
    from fullscale.parallelize import parallelize
    from fullscale.telemetry import Telemetry

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
            plain_tel = Telemetry(plain_opt, spec_by_name(cfg), every=1, hist_every=1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        with torch.device("meta"):
            model = Transformer(cfg)
        parallelize(model, world, activation_checkpointing=False, mixed_precision="fp32",
                    device=torch.device("cpu"))
        model.to_empty(device="cpu")
        model.init_weights(torch.Generator().manual_seed(0))
        opt = build_optimizer(model, optim)
        tel = Telemetry(opt, spec_by_name(cfg), every=1, hist_every=1)
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
            # numpy reference on the gathered full tensors (what one process would see)
            ref, hist = {}, []
            for n, p in named:
                st = opt.state[p]
                t = int(st["step"])
                m_hat = st["exp_avg"].full_tensor().numpy().astype(np.float64) / (1 - optim.b1 ** t)
                v_hat = st["exp_avg_sq"].full_tensor().numpy().astype(np.float64) / (1 - optim.b2 ** t)
                r = reference_metrics(p.grad.full_tensor().numpy(), m_hat, v_hat, m_prev[n],
                                      p.detach().full_tensor().numpy(), optim.eps)
                ref[n] = [r[k] for k in METRIC_NAMES]
                hist.append(histogram(update_direction(m_hat, v_hat, optim.eps)).tolist())
            result[step] = {"got": {k: np.asarray(o.columns[k]).tolist() for k in METRIC_NAMES},
                            "hist": o.hists.tolist(), "ref": ref, "ref_hist": hist,
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
        np.testing.assert_allclose(got, ref, rtol=1e-6, err_msg=f"step {step}")
        np.testing.assert_array_equal(np.array(r["hist"]), np.array(r["ref_hist"]))
        # unsharded replica on the whole batch: gradients differ only by fp32 summation order
        for k in METRIC_NAMES:
            x, y = np.array(r["got"][k]), np.array(r["plain"][k])
            if k in ("sat_frac", "eps_frac"):   # threshold counts: allow a flipped element
                np.testing.assert_allclose(x, y, atol=2 / 64, err_msg=k)
            else:
                np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-7, err_msg=f"{step} {k}")
