"""sqrt(v_hat)/eps histograms of the torch trainer (fullscale.telemetry.telemetry_vhists)
equal adamspike.metrics.vhistogram on the same AdamW state, and the trainer writes them to
the vhists table on histogram steps only. (The 2-process FSDP2 check is in
test_telemetry.py::test_sharded_two_processes_equal_reference_and_unsharded.)"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from adamspike.llama import PRESETS, spec_by_name
from adamspike.metrics import NUM_VHIST_BINS, VHIST_EDGES, vhistogram
from adamspike.train_config import OptimSection
from fullscale.model import Transformer
from fullscale.optim import build_optimizer, clip_gradients
from fullscale.telemetry import Telemetry, telemetry_vhists, vhist_counts

pytestmark = pytest.mark.usefixtures("one_thread")


def test_vhist_counts_equal_numpy_on_edges_tails_and_nan():
    rng = np.random.default_rng(0)
    x = 10.0 ** rng.uniform(-6, 8, 5000)          # beyond both ends too
    x = np.concatenate([x, VHIST_EDGES, [0.0, np.inf, np.nan]])
    eps = 1e-3
    v = (x * eps) ** 2
    got = vhist_counts(torch.tensor(v, dtype=torch.float64), eps,
                       torch.tensor(VHIST_EDGES, dtype=torch.float64)).numpy()
    np.testing.assert_array_equal(got, vhistogram(v, eps))
    assert got.sum() == len(v) and got.shape == (NUM_VHIST_BINS,)


def test_trainer_state_vhists_equal_reference_on_hist_steps_only():
    cfg = PRESETS["tiny"]
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    optim = OptimSection(lr=1e-2, b1=0.9, b2=0.95, eps=1e-6, weight_decay=0.1, grad_clip=0.5)
    opt = build_optimizer(model, optim)
    tel = Telemetry(opt, spec_by_name(cfg), every=1, hist_every=2, precision="float64",
                    compile="off")
    gen = torch.Generator().manual_seed(1)
    for step in (1, 2, 3, 4):
        x = torch.randint(0, cfg.vocab_size, (4, 17), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        clip_gradients(model.parameters(), optim.grad_clip)
        tel.before_step(step)
        opt.step()
        tel.after_step(step)
        got = telemetry_vhists(tel, step)
        if step % 2:
            assert got is None
            continue
        names = dict(model.named_parameters())
        for i, n in enumerate(tel.names):
            st = opt.state[names[n]]
            v_hat = st["exp_avg_sq"].numpy().astype(np.float64) / (1 - optim.b2 ** int(st["step"]))
            np.testing.assert_array_equal(got[i, :NUM_VHIST_BINS], vhistogram(v_hat, optim.eps),
                                          err_msg=n)
            g = names[n].grad.numpy().astype(np.float64)   # consumed: after the clip
            assert got[i, NUM_VHIST_BINS] == np.sum(np.abs(g) < optim.eps), n
        # the spread is real: the embedding's rows see different token counts
        emb = got[tel.names.index("tok_embeddings.weight")]
        assert np.count_nonzero(emb[:NUM_VHIST_BINS]) >= 3
        assert emb[NUM_VHIST_BINS] > 0      # rows of tokens absent from the batch: g = 0
