"""simulate.seeds: the seeds of one arm as one vmapped program, paired across arms."""

import numpy as np
import pytest

from adamspike.config import ConfigError
from adamspike.rundir import load_run
from adamspike.train_config import RunConfig
from simulate.llama_train import train
from simulate.seeds import run_arm

SETTINGS = {"model.preset": "tiny", "model.vocab_size": 64, "model.dim": 32, "model.num_layers": 2,
            "model.num_heads": 4, "model.num_kv_heads": 2, "model.max_seq_len": 16,
            "train.seq_len": 16, "train.global_batch_size": 4, "train.num_steps": 25,
            "optim.lr": 3e-3, "optim.warmup_steps": 5, "optim.schedule": "cosine",
            "optim.b2": 0.95, "optim.eps": 1e-6, "optim.grad_clip": 1.0,
            "optim.weight_decay": 0.1, "data.task": "zipf", "data.zipf_exponent": 1.1,
            "mitigation.eps_embed": 1e-4, "mitigation.eps_deep": 1e-5,
            "telemetry.every": 1, "telemetry.hist_every": 0}


def cfg(**over):
    return RunConfig.from_dict({**SETTINGS, **over})


SEEDS = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def base():
    """run_arm(cfg(), SEEDS), shared by the tests that read its lanes: one compiled program
    of width 4 (each lane count is a program of its own; seed k is lane k)."""
    return run_arm(cfg(), SEEDS)


def test_a_vmapped_seed_is_the_trainers_run(base, tmp_path):
    res = base
    for j, seed in ((0, 0), (3, 3)):
        run = load_run(train(cfg(**{"train.seed": seed}), tmp_path / f"s{seed}", progress=False))
        st = run.steps.sort_values("step")
        np.testing.assert_allclose(res["loss"][j], st["loss"], rtol=PROGRAMS_RTOL)
        np.testing.assert_allclose(res["grad_norm"][j], st["grad_norm"], rtol=PROGRAMS_RTOL)
        # group rho of the consumed gradient = the telemetry's per-tensor rho, pooled by group
        lay = run.layers
        last = lay[lay["step"] == 25]
        shallow = last[last["depth"] == 0]
        rms = np.sqrt((shallow["grad_rms"] ** 2 * shallow["numel"]).sum() / shallow["numel"].sum())
        k = list(res["groups"]).index("shallow")
        np.testing.assert_allclose(res["rho"][j, -1, k], rms / 1e-6, rtol=1e-3)
    assert res["group_eps"][list(res["groups"]).index("embed")] == 1e-4


def test_arms_are_paired_and_eps_only_arms_share_the_program(base):
    a = base
    b = run_arm(cfg(**{"optim.eps": 1e-3}), SEEDS)
    # same seeds: same first batch and init, so step 1's loss is identical across arms
    np.testing.assert_array_equal(a["loss"][:, 0], b["loss"][:, 0])
    assert not np.allclose(a["loss"][:, -1], b["loss"][:, -1])
    assert len({tuple(np.round(a["loss"][i, :3], 6)) for i in SEEDS}) == 4   # seeds differ
    seq = run_arm(cfg(), SEEDS, vmapped=False)   # lane width 1 vs 4: other programs
    np.testing.assert_allclose(seq["loss"], a["loss"], rtol=PROGRAMS_RTOL)


# run_arm and the trainer run the same step function as two XLA programs (lax.scan +
# vmap vs one jitted step per call), whose fp32 roundings differ (~1e-7 relative per op);
# 25 Adam steps amplify that: the measured worst relative loss difference is below 2e-6
# (AVX-512 and XLA_FLAGS=--xla_cpu_max_isa=AVX2), bounded here at 1e-4.
PROGRAMS_RTOL = 1e-4


def test_every_control_matches_the_trainer(tmp_path):
    """v reset, poison, skipped batches and freezing: the controls of the one program."""
    over = {"mitigation.v_reset_steps": [3], "mitigation.v_reset_groups": ["embed", "shallow"],
            "data.poison_steps": [12], "data.skip_batches": [6, 7],
            "mitigation.freeze_groups": ["embed"], "mitigation.freeze_from": 15}
    res = run_arm(cfg(**over), [1])
    run = load_run(train(cfg(**over, **{"train.seed": 1}), tmp_path / "r", progress=False))
    st = run.steps.sort_values("step")
    np.testing.assert_allclose(res["loss"][0], st["loss"], rtol=PROGRAMS_RTOL)
    # The v reset at step 3 makes that step's v_hat one gradient's square, so its update is
    # m / (|g| + eps) per coordinate: the relative rounding of each small coordinate of g (not
    # of the norm) reaches the update. Measured 1.5e-4 and 2.6e-4 at steps 3 and 4 on an AMD
    # EPYC (AVX2), < 4e-5 at the other steps; bounded at 1e-3.
    np.testing.assert_allclose(res["update_norm"][0], st["update_norm"], rtol=1e-3, atol=0)
    assert (res["update_norm"][0, [5, 6]] == 0).all()            # skipped steps 6, 7
    # (the poison control's spike: tests/simulate/test_llama_train.py, same program)


def test_the_guard_is_refused():
    with pytest.raises(ConfigError, match="guard"):
        run_arm(cfg(**{"guard.enabled": True, "checkpoint.every": 5}), [0])


def test_per_lane_controls_run_each_arm_in_one_program():
    """Arms as lanes (Program.run per_lane): lane j with arm j's controls equals run_arm of
    arm j (another XLA program: PROGRAMS_RTOL)."""
    from simulate.program import Controls, program
    from simulate.seeds import arm_tokens
    arms = [cfg(), cfg(**{"optim.eps": 1e-3, "optim.lr": 1e-3})]
    prog = program(arms[0])
    steps = range(1, 26)
    ctl = Controls(*(np.stack(x) for x in zip(*(prog.controls(a, steps) for a in arms))))
    toks = np.concatenate([arm_tokens(arms[0], [2])] * 2)
    both = prog.run([2, 2], toks, ctl, per_lane=True)
    for j, arm in enumerate(arms):
        np.testing.assert_allclose(both["loss"][j], run_arm(arm, [2])["loss"][0],
                                   rtol=PROGRAMS_RTOL)
    assert not np.allclose(both["loss"][0], both["loss"][1])
