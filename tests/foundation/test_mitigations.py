"""adamspike.mitigations: the registry builds RunConfig's mitigation section, resolves a
config into the StepPlan both trainers implement (through adamspike.depth_groups), and
says which mitigations Megatron cannot express."""

import pandas as pd
import pytest

from adamspike import mitigations as M
from adamspike.config import ConfigError, flatten, to_dict
from adamspike.llama import preset, spec_by_name
from adamspike.train_config import RunConfig

DEPTHS_70B = {n: s.depth for n, s in spec_by_name(preset("llama2-70b")).items()}


def test_the_section_is_the_registrys_fields_and_neutral():
    keys = {k for k in flatten(to_dict(RunConfig())) if k.startswith("mitigation.")}
    assert keys == M.all_keys()
    assert M.active(RunConfig()) == []
    plan = M.plan(RunConfig(), DEPTHS_70B, 80)
    assert plan.update_clip is False and plan.v_reset == {}
    assert plan.model_options == {"embed_grad_shrink": 1.0}
    assert {m.hook for m in M.REGISTRY.values()} <= set(M.HOOKS)


def test_group_eps_and_v_reset_follow_the_depth_groups():
    cfg = RunConfig.from_dict({"mitigation.eps_embed": 1e-4, "mitigation.eps_shallow": 1e-6,
                               "mitigation.v_reset_steps": [10, 20],
                               "mitigation.v_reset_groups": ["shallow", "head"]})
    plan = M.plan(cfg, DEPTHS_70B, 80)
    eps = plan.tensor_eps
    assert eps["tok_embeddings.weight"] == 1e-4
    assert eps["layers.7.attention.wq.weight"] == 1e-6            # shallow: blocks 0..7
    assert eps["layers.8.attention.wq.weight"] == 1e-8            # deep: optim.eps
    assert eps["output.weight"] == 1e-8                           # head takes eps_deep
    reset = set(plan.v_reset[10])
    assert plan.v_reset[10] == plan.v_reset[20]
    assert "layers.0.feed_forward.w1.weight" in reset and "output.weight" in reset
    assert "tok_embeddings.weight" not in reset and "layers.8.ffn_norm.weight" not in reset
    assert [m.name for m in M.active(cfg)] == ["group_eps", "v_reset"]
    assert M.needs_explicit_m_prev(cfg)
    assert not M.needs_explicit_m_prev(RunConfig.from_dict({"mitigation.eps_deep": 1e-6}))


def test_eps_head_overrides_the_head_only():
    cfg = RunConfig.from_dict({"mitigation.eps_deep": 1e-6, "mitigation.eps_head": 3e-4})
    eps = M.plan(cfg, DEPTHS_70B, 80).tensor_eps
    assert eps["output.weight"] == 3e-4 and eps["norm.weight"] == 3e-4
    assert eps["layers.79.attention.wq.weight"] == 1e-6
    assert eps["tok_embeddings.weight"] == 1e-8 and eps["layers.0.ffn_norm.weight"] == 1e-8
    assert "mitigation.eps_head = 0.0003" in " ".join(M.megatron_gaps(cfg))


def test_megatron_gaps_and_args():
    assert M.megatron_gaps(RunConfig()) == [] and M.megatron_args(RunConfig()) == []
    cfg = RunConfig.from_dict({"mitigation.update_clip": True,
                               "mitigation.eps_embed": 1e-8})   # == optim.eps: expressible
    (gap,) = M.megatron_gaps(cfg)
    assert gap.startswith("mitigation.update_clip = True") and "no Megatron flag" in gap
    cfg = RunConfig.from_dict({"mitigation.eps_deep": 1e-6})
    assert "mitigation.eps_deep = 1e-06" in M.megatron_gaps(cfg)[0]


def test_require_hooks_names_the_keys():
    cfg = RunConfig.from_dict({"mitigation.v_reset_steps": [3], "mitigation.update_clip": True})
    M.require_hooks(RunConfig.from_dict({"mitigation.update_clip": True}), ("direction",), "x")
    with pytest.raises(ConfigError, match="mitigation.v_reset_steps, mitigation.v_reset_groups: "
                                          "not supported by the mlp"):
        M.require_hooks(cfg, ("direction",), "the mlp")


def test_neutral_mask_keeps_runs_without_mitigations():
    t = pd.DataFrame({"mitigation.update_clip": [False, True, False],
                      "mitigation.eps_embed": [None, None, 1e-3], "num_spikes": [1, 2, 3]})
    assert t[M.neutral_mask(t)]["num_spikes"].tolist() == [1]
    assert M.neutral_mask(pd.DataFrame({"num_spikes": [1, 2]})).tolist() == [True, True]


def test_freeze_groups_resolves_by_depth_group_and_step_range():
    cfg = RunConfig.from_dict({"mitigation.freeze_groups": ["embed", "shallow"],
                               "mitigation.freeze_from": 100, "mitigation.freeze_until": 150})
    plan = M.plan(cfg, DEPTHS_70B, 80)
    frozen = set(plan.freeze)
    assert "tok_embeddings.weight" in frozen and "layers.7.ffn_norm.weight" in frozen
    assert "layers.8.attention.wq.weight" not in frozen and "output.weight" not in frozen
    assert plan.frozen_at(99) == () and plan.frozen_at(151) == ()
    assert set(plan.frozen_at(100)) == frozen == set(plan.frozen_at(150))
    assert [m.name for m in M.active(cfg)] == ["freeze_groups"]
    assert not M.needs_explicit_m_prev(cfg)      # no optimizer state is edited
    assert M.REGISTRY["freeze_groups"].hook == "update"
    (gap,) = M.megatron_gaps(cfg)
    assert "freeze_groups" in gap and "no Megatron flag" in gap
    to_end = M.plan(RunConfig.from_dict({"mitigation.freeze_groups": ["head"]}), DEPTHS_70B, 80)
    assert set(to_end.frozen_at(1)) == set(to_end.frozen_at(10**6)) == {"norm.weight", "output.weight"}
    assert M.plan(RunConfig(), DEPTHS_70B, 80).frozen_at(5) == ()
    with pytest.raises(ConfigError, match="mitigation.freeze_groups\\[0\\]"):
        RunConfig.from_dict({"mitigation.freeze_groups": ["middle"]})
    with pytest.raises(ConfigError, match="mitigation.freeze_until"):
        RunConfig.from_dict({"mitigation.freeze_groups": ["embed"], "mitigation.freeze_from": 10,
                             "mitigation.freeze_until": 5})
    with pytest.raises(ConfigError, match="mitigation.freeze_groups: empty"):
        RunConfig.from_dict({"mitigation.freeze_from": 10})
    with pytest.raises(ConfigError, match="mitigation.freeze_groups"):
        M.require_hooks(cfg, ("direction",), "the mlp problem")
