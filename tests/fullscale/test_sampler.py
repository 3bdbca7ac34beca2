"""fullscale.sampler: exact global-batch coverage across ranks and micro-batches, determinism,
poison / skip hooks keyed as documented, clear errors for batch splits that do not divide."""

from __future__ import annotations

import pytest
import torch

from adamspike.config import ConfigError
from adamspike.order import sample_indices
from adamspike.synthdata import SyntheticTokens
from adamspike.train_config import RunConfig
from fullscale.sampler import (POISON_TOKEN, DataPosition, batch_plan, is_poisoned, local_batch)


def _cfg(gbs=8, mbs=2, seq_len=16, **data):
    cfg = RunConfig()
    cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.train.seq_len = gbs, mbs, seq_len
    cfg.train.seed = 3
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


SRC = SyntheticTokens(vocab_size=50, seq_len=16, num_samples=40, seed=1)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_and_micro_batches_cover_the_global_batch(world):
    cfg = _cfg()
    for step, offset in [(1, 0), (5, 0), (5, 3), (11, 0)]:   # step 11 wraps an epoch (N=40)
        idx = sample_indices(step, 8, len(SRC), cfg.train.seed, offset=offset)
        want = torch.from_numpy(SRC.batch(idx))
        got = [mb for r in range(world) for mb in local_batch(SRC, step, cfg, r, world, offset)]
        assert len(got) == world * batch_plan(cfg, world).num_micro_batches
        inputs = torch.cat([mb.inputs for mb in got])
        targets = torch.cat([mb.targets for mb in got])
        assert inputs.dtype == torch.long and inputs.shape == (8, 16)
        assert torch.equal(inputs, want[:, :-1]) and torch.equal(targets, want[:, 1:])


def test_deterministic_and_offset_moves_the_stream():
    cfg = _cfg()
    a = local_batch(SRC, 4, cfg, 1, 2, offset=0)
    b = local_batch(SRC, 4, cfg, 1, 2, offset=0)
    assert all(torch.equal(x.inputs, y.inputs) for x, y in zip(a, b))
    # step 4 at offset 2 reads the batch step 6 reads at offset 0
    c = local_batch(SRC, 4, cfg, 1, 2, offset=2)
    d = local_batch(SRC, 6, cfg, 1, 2, offset=0)
    assert all(torch.equal(x.inputs, y.inputs) for x, y in zip(c, d))


def test_poison_is_a_property_of_the_batch_and_skip_of_the_step():
    cfg = _cfg(poison_steps=[5], skip_batches=[2])
    clean = _cfg()
    poisoned = local_batch(SRC, 5, cfg, 0, 2)
    assert all((mb.targets == POISON_TOKEN).all() for mb in poisoned)
    assert torch.equal(poisoned[0].inputs, local_batch(SRC, 5, clean, 0, 2)[0].inputs)
    assert is_poisoned(3, 2, cfg) and not is_poisoned(5, 2, cfg)
    assert not any((mb.targets == POISON_TOKEN).all() for mb in local_batch(SRC, 5, cfg, 0, 2, 2))
    assert local_batch(SRC, 2, cfg, 0, 2) == []
    assert local_batch(SRC, 3, cfg, 0, 2) != []


def test_batch_split_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"train.global_batch_size: 8 is not divisible by the "
                                          r"world size 3"):
        batch_plan(_cfg(), 3)
    with pytest.raises(ConfigError, match=r"train.micro_batch_size: 3 does not divide the "
                                          r"per-rank batch 4"):
        batch_plan(_cfg(mbs=3), 2)
    assert batch_plan(_cfg(mbs=0), 2).num_micro_batches == 1
    with pytest.raises(ValueError, match=r"train.seq_len \+ 1 = 33"):
        local_batch(SRC, 1, _cfg(seq_len=32), 0, 1)


def test_data_position_state():
    pos = DataPosition(step=12, offset=0)
    pos.skip(200)
    assert pos.offset == 200
    other = DataPosition()
    other.load_state_dict(pos.state_dict())
    assert other == pos
    with pytest.raises(ValueError, match="integer step and offset"):
        other.load_state_dict({"step": 1})
    with pytest.raises(ValueError, match="negative"):
        other.skip(-1)
