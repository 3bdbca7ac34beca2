"""Megatron / AscendSpeed log import on lines in the exact `training_log` formats."""

import math

import numpy as np
import pandas as pd
import pytest

from adamspike.rundir import STEP_COLUMNS, load_run
from analysis.megatron_log import (MegatronLogError, import_megatron_log, parse_megatron_log,
                                   read_megatron_log)


def megatron_line(it, loss, *, total=500000, ts="2024-06-01 12:00:01.123456", lr="1.500000E-04",
                  gbs=1024, grad_norm=1.234, skipped=0, nan=0, tflops=180.2, interval=1):
    """Megatron-LM core training_log (newer: microsecond timestamp, {:.6E} lr, throughput)."""
    s = f" [{ts}]" if ts else ""
    s += f" iteration {it:8d}/{total:8d} |"
    s += f" consumed samples: {it * gbs:12d} |"
    s += f" elapsed time per iteration (ms): {15234.5:.1f} |"
    if tflops is not None:
        s += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
    s += f" learning rate: {lr} |"
    s += f" global batch size: {gbs:5d} |"
    s += f" lm loss: {loss:.6E} |"
    s += f" loss scale: {1.0:.1f} |"
    if grad_norm is not None:
        s += f" grad norm: {grad_norm:.3f} |"
    s += f" number of skipped iterations: {skipped:3d} |"
    s += f" number of nan iterations: {nan:3d} |"
    return s


def ascendspeed_line(it, loss, *, gbs=1024, seq=4096, ts="2024-06-01 12:00:01"):
    """AscendSpeed (Megatron-DeepSpeed based): no microseconds, {:.3E} lr, consumed tokens,
    params norm / num zeros, and its trailing throughput fields."""
    return (f" [{ts}] iteration {it:8d}/{2000:8d} | consumed samples: {it * gbs:12d} |"
            f" consumed tokens: {it * gbs * seq:12d} |"
            f" elapsed time per iteration (ms): {16000.0 + it:.1f} | learning rate: 1.500E-04 |"
            f" global batch size: {gbs:5d} | lm loss: {loss:.6E} | loss scale: {4096.0:.1f} |"
            f" grad norm: {0.5 + it / 100:.3f} | num zeros: {0.0:.1f} | params norm: {512.25:.3f} |"
            f" number of skipped iterations: {0:3d} | number of nan iterations: {0:3d} |"
            f" actual seqlen: {seq:5d} | samples per second: {64.123:.3f} | TFLOPs: {175.33:.2f} |")


def test_megatron_core_lines_with_chatter_validation_and_truncated_tail():
    lines = [
        "> building train, validation, and test datasets ...",
        megatron_line(1, 10.5, grad_norm=30.0),
        "[after training is done] datetime: 2024-06-01 12:00:01",
        megatron_line(2, 10.25, skipped=1),
        megatron_line(3, 9.75),
        "-" * 80,
        " validation loss at iteration 3 | lm loss value: 9.800000E+00 | lm loss PPL: "
        "1.803988E+04 | ",
        megatron_line(4, 9.5)[:130],  # the job was killed mid-print
    ]
    p = parse_megatron_log(lines, clip=1.0)
    st = p.steps
    assert list(st.columns[:len(STEP_COLUMNS)]) == list(STEP_COLUMNS)
    assert list(st["step"]) == [1, 2, 3]
    np.testing.assert_allclose(st["loss"], [10.5, 10.25, 9.75])
    np.testing.assert_allclose(st["lr"], 1.5e-4)
    np.testing.assert_allclose(st["step_time_s"], 15.2345)
    np.testing.assert_allclose(st["tflops"], 180.2)
    np.testing.assert_allclose(st["grad_norm"], [30.0, 1.234, 1.234])
    assert list(st["clipped"]) == [True, True, True]
    assert list(st["skipped"]) == [False, True, False]
    assert st["update_norm"].isna().all() and st["tokens"].isna().all()
    assert st["timestamp"].iloc[0] == pytest.approx(1717243201.123456)
    assert not st["interval_avg"].any()
    assert p.stats["num_lines"] == 8 and p.stats["num_iteration_lines"] == 4
    assert p.stats["num_malformed"] == 1
    bad = p.stats["malformed"][0]
    assert bad["line"] == 8 and "truncated" in bad["reason"]
    v = p.validation
    assert list(v["step"]) == [3] and v["name"].iloc[0] == "lm loss"
    assert v["value"].iloc[0] == pytest.approx(9.8) and v["ppl"].iloc[0] == pytest.approx(18039.88)


def test_old_format_without_timestamp_and_optional_fields_missing():
    lines = [megatron_line(i, 3.0 - i / 100, ts=None, lr="1.500E-04", grad_norm=None,
                           tflops=None) for i in (10, 20, 30)]
    lines[1] = lines[1].replace("number of nan iterations:   0", "number of nan iterations:   2")
    p = parse_megatron_log(lines)
    st = p.steps
    assert st["timestamp"].isna().all() and st["grad_norm"].isna().all()
    assert not st["clipped"].any() and list(st["skipped"]) == [False, True, False]
    assert st["interval_avg"].all() and p.stats["log_interval"] == 10
    assert "tflops" not in st


def test_ascendspeed_variant_tokens_and_extras():
    lines = [ascendspeed_line(i, 2.0 + 1 / i) for i in range(1, 6)]
    p = parse_megatron_log(lines)
    st = p.steps
    assert list(st["tokens"]) == [i * 1024 * 4096 for i in range(1, 6)]
    assert p.stats["tokens_from"] == "consumed tokens"
    np.testing.assert_allclose(st["params_norm"], 512.25)
    np.testing.assert_allclose(st["samples_per_s"], 64.123)
    np.testing.assert_allclose(st["tflops"], 175.33)
    np.testing.assert_allclose(st["loss_scale"], 4096.0)
    assert (st["actual_seqlen"] == 4096).all() and (st["num_zeros"] == 0).all()
    p2 = parse_megatron_log(lines, seq_len=2048)
    assert list(p2.steps["tokens"]) == [i * 1024 * 2048 for i in range(1, 6)]


def test_unknown_keys_other_losses_and_bad_values_reported():
    good = megatron_line(1, 4.0).replace(" loss scale:", " mtp_1 loss: 4.100000E+00 |"
                                         " mem-allocated-bytes-avg(MB): 1234.50 | loss scale:")
    eta = megatron_line(2, 3.9) + " ETA Time: 1:02:03"  # a complete line with a trailing extra
    bad = megatron_line(3, 3.8).replace("lm loss: 3.800000E+00", "lm loss: nan%")
    nokey = megatron_line(4, 3.7).replace("| loss scale:", "| garbage | loss scale:")
    p = parse_megatron_log([good, eta, bad, nokey])
    assert list(p.steps["step"]) == [1, 2]
    assert p.steps["loss_mtp_1"].iloc[0] == pytest.approx(4.1)
    assert p.steps["mem_allocated_bytes_avg_mb"].iloc[0] == pytest.approx(1234.5)
    reasons = {m["line"]: m["reason"] for m in p.stats["malformed"]}
    assert set(reasons) == {3, 4}
    assert "non-numeric" in reasons[3] and "'lm loss'" in reasons[3]
    assert "key: value" in reasons[4]


def test_nan_loss_is_kept_and_duplicates_from_restart_keep_last():
    lines = [megatron_line(i, 2.0) for i in range(1, 5)]
    lines.append(megatron_line(3, 2.5))  # restarted from a step-2 checkpoint
    lines.append(megatron_line(4, 2.6).replace("2.600000E+00", "nan"))
    p = parse_megatron_log(lines)
    assert list(p.steps["step"]) == [1, 2, 3, 4]
    assert p.steps["loss"].iloc[2] == 2.5 and math.isnan(p.steps["loss"].iloc[3])
    assert p.stats["num_duplicate_steps"] == 2 and p.stats["duplicate_steps"] == [3, 4]


def test_no_iteration_lines_is_a_clear_error(tmp_path):
    log = tmp_path / "empty.log"
    log.write_text("using world size: 8\n> initializing torch distributed ...\n")
    with pytest.raises(MegatronLogError, match="no parseable iteration lines"):
        read_megatron_log(log)
    with pytest.raises(MegatronLogError, match="not found"):
        read_megatron_log(tmp_path / "missing.log")


def test_import_writes_a_megatron_run_directory(tmp_path):
    log = tmp_path / "train.log"
    lines = [megatron_line(i, 3.0 - i / 1000) for i in range(1, 201)]
    lines.insert(100, " validation loss at iteration 100 on validation set | lm loss value: "
                      "2.900000E+00 | lm loss PPL: 1.817415E+01 | ")
    lines.append(megatron_line(201, 2.0)[:50])
    log.write_text("\n".join(lines))
    parsed = import_megatron_log(log, tmp_path / "run", seq_len=4096, clip=1.0,
                                 optim={"b1": 0.9, "b2": 0.95, "eps": 1e-5})
    run = load_run(tmp_path / "run")
    assert run.backend == "megatron" and len(run.steps) == 200
    assert run.config["optim"] == {"grad_clip": 1.0, "b1": 0.9, "b2": 0.95, "eps": 1e-5}
    assert run.steps["tokens"].iloc[-1] == 200 * 1024 * 4096
    assert run.meta["import"]["num_malformed"] == 1
    assert run.meta["import"]["malformed_lines"] == [202]
    ev = run.events
    assert set(ev["type"]) == {"validation", "malformed_log_lines"}   # one per chunk
    bad = ev[ev["type"] == "malformed_log_lines"].iloc[0]
    assert bad["count"] == 1 and bad["lines"] == [202] and bad["examples"][0]["line"] == 202
    assert ev.loc[ev["type"] == "validation", "split"].iloc[0] == "validation set"
    assert parsed.stats["num_iteration_lines"] == 201 and run.config["train"]["num_steps"] == 500000
    with pytest.raises(Exception, match="not empty"):  # nothing already written is replaced
        import_megatron_log(log, tmp_path / "run")


# ---- CANN 7-era / MindSpeed-LLM edge cases, from the real format strings ---------------

def mindspeed_llm_line(it, loss, *, skipped=0, grad_norm=0.75, fix_router=False):
    """MindSpeed-LLM training_log (mindspeed_llm/training/training.py): timestamp without
    microseconds, losses only when their interval average is > 0, the test-only trailer."""
    s = f" [2024-06-01 12:00:01] iteration {it:8d}/{1000:8d} |"
    s += f" consumed samples: {it * 64:12d} |"
    s += f" elapsed time per iteration (ms): {900.5:.1f} |"
    s += f" learning rate: {1.5e-4:.6E} |"
    s += f" global batch size: {64:5d} |"
    if loss > 0.0:
        s += f" lm loss: {loss:.6E} |"
    s += f" loss scale: {65536.0:.1f} |"
    if grad_norm is not None:
        s += f" grad norm: {grad_norm:.3f} |"
    s += f" number of skipped iterations: {skipped:3d} |"
    s += f" number of nan iterations: {0:3d} |"
    if fix_router:
        s += " fix-router or fix-sub-seq-length is set, current loss is not reliable, only for test |"
    return s


def test_fully_skipped_intervals_have_no_loss_and_are_not_spikes(tmp_path):
    # Megatron-LM main: avg = 0 / max(1, 0) printed as 0.000000E+00 ('if avg >= 0.0');
    # MindSpeed-LLM: omitted ('if avg > 0.0'); both without grad norm (None on overflow)
    lines = []
    for i in range(1, 121):
        if i in (60, 61):
            lines.append(megatron_line(i, 0.0, grad_norm=None, skipped=1))
        elif i == 90:
            lines.append(mindspeed_llm_line(i, 0.0, skipped=1, grad_norm=None))
        else:
            lines.append(megatron_line(i, 3.0 - i / 1000, grad_norm=0.8 + 0.01 * (i % 3)))
    p = parse_megatron_log(lines)
    st = p.steps.set_index("step")
    assert st.loc[[60, 61, 90], "skipped"].all() and st.loc[[60, 61, 90], "loss"].isna().all()
    assert st.loc[[60, 61, 90], "grad_norm"].isna().all()
    assert p.stats["num_skipped_without_loss"] == 3
    log = tmp_path / "fp16.log"
    log.write_text("\n".join(lines) + "\n")
    import_megatron_log(log, tmp_path / "run", seq_len=2048)
    from analysis.report import analyze_run

    ra = analyze_run(tmp_path / "run")
    assert ra.spikes.empty, ra.spikes           # skipped steps are not non-finite spikes
    assert ra.grad_spikes.empty or not ra.grad_spikes["nonfinite"].any()


def test_partly_skipped_interval_keeps_its_average_and_nan_loss_unskipped_is_a_spike():
    lines = [megatron_line(i * 10, 2.5, skipped=3 if i == 2 else 0, interval=10)
             for i in range(1, 4)]
    p = parse_megatron_log(lines)
    assert list(p.steps["skipped"]) == [False, True, False]
    assert p.steps["loss"].iloc[1] == 2.5          # 7 advanced iterations: a real average
    from adamspike.spikes import loss_spikes
    steps = pd.DataFrame({"step": range(80), "loss": [2.0] * 70 + [np.nan] + [2.0] * 9,
                          "skipped": [False] * 80})
    sp, _ = loss_spikes(steps)
    assert list(sp["start"]) == [70] and sp["nonfinite"].all()   # divergence: still a spike
    steps.loc[70, "skipped"] = True
    assert loss_spikes(steps)[0].empty


def test_validation_line_variants_from_the_real_prefixes():
    lines = [
        megatron_line(100, 2.0),
        # Megatron-LM main, --multiple-validation-sets without names: f'-{index}'
        " validation-0 loss at iteration 100 | lm loss value: 2.100000E+00 | lm loss PPL: "
        "8.166170E+00 | ",
        " validation-1 loss at iteration 100 | lm loss value: 2.200000E+00 | lm loss PPL: "
        "9.025013E+00 | ",
        # --validation-set-names wiki code, after training: 'iteration N on validation set'
        " validation-wiki loss at iteration 100 on validation set | lm loss value: "
        "2.300000E+00 | lm loss PPL: 9.974182E+00 | ",
        " validation loss at iteration 100 on test set | lm loss value: 2.400000E+00 | "
        "lm loss PPL: 1.102318E+01 | ",
        # Megatron-DeepSpeed / AscendSpeed, compression training
        " validation loss at the end of training and after model cleaning for val data | "
        "lm loss value: 2.500000E+00 | lm loss PPL: 1.218249E+01 | ",
        " validation loss at the end of training for val data | lm loss value: 2.600000E+00 |"
        " lm loss PPL: 1.346374E+01 | ",
        " validation-2 loss at iteration 100 | lm loss value: 2.7",    # cut off: reported
    ]
    p = parse_megatron_log(lines)
    v = p.validation
    assert list(v["dataset"]) == ["0", "1", "wiki", "", "", ""]
    assert list(v["split"]) == ["validation", "validation", "validation set", "test set",
                                "val", "val"]
    assert list(v["step"]) == [100, 100, 100, 100, -1, -1]
    np.testing.assert_allclose(v["value"], [2.1, 2.2, 2.3, 2.4, 2.5, 2.6])
    assert p.stats["num_validation_lines"] == 7 and p.stats["num_malformed"] == 1
    assert p.stats["malformed"][0]["line"] == 8


def test_mindspeed_llm_test_only_trailer_is_a_flag_not_malformed():
    lines = [mindspeed_llm_line(i, 2.0 + i / 10, fix_router=i > 2) for i in range(1, 5)]
    lines.append(mindspeed_llm_line(5, 2.5).replace(" | number of skipped", " | bogus text |"
                                                    " number of skipped"))
    p = parse_megatron_log(lines)
    assert list(p.steps["step"]) == [1, 2, 3, 4]
    assert list(p.steps["loss_unreliable"]) == [False, False, True, True]
    assert p.stats["num_loss_unreliable"] == 2
    assert p.stats["num_malformed"] == 1 and "key: value" in p.stats["malformed"][0]["reason"]


def _onsets(log, tmp_path):
    from adamspike.spikes import SpikeParams, loss_spikes
    import_megatron_log(log, tmp_path / "run")
    run = load_run(tmp_path / "run")
    spikes, rule = loss_spikes(run.steps, SpikeParams(), config=run.config)
    return spikes["start"].tolist(), rule


def test_a_log_excerpt_is_judged_from_its_second_line(tmp_path):
    """A log that starts mid-run (an excerpt, a resume) has no earlier lines: the default
    history (25 steps) would judge nothing in 8 lines; an imported log is judged from its
    second valued line, and the rule says so."""
    losses = [2.21, 2.23, 2.20, 5.10, 3.90, 2.60, 2.30, 2.25]
    log = tmp_path / "excerpt.log"
    log.write_text("".join(megatron_line(31215 + i, x) + "\n" for i, x in enumerate(losses)))
    starts, rule = _onsets(log, tmp_path)
    assert starts == [31218] and rule.history == 1
    assert "judged once 1 earlier normal step(s) exist" in rule.describe()
    calm = tmp_path / "calm.log"   # the same excerpt without the spike: nothing flagged
    calm.write_text("".join(megatron_line(31215 + i, 2.2 + 0.02 * (i % 3)) + "\n"
                            for i in range(8)))
    assert _onsets(calm, tmp_path / "c")[0] == []


REALLOGS = __import__("pathlib").Path(__file__).resolve().parents[3] / "shared" / "reallogs"
# spike onsets of ../shared/reallogs (INDEX.md), and the no-spike control
REAL_ONSETS = {"01_bigscience_tr11_bloom176b.log": 31219, "02_bigscience_tr1_13b.log": 29050,
               "03_bigscience_tr8_104b_exp12.log": 8741,
               "04_bigscience_tr8b_104b_embnorm.log": 17062,
               "05_bigscience_megatronlm_gpt2_n4.log": 30,
               "06_bigscience_megds3d_gpt2_dsoff.log": 3, "07_bigscience_megds3d_gpt2_dson.log": 3,
               "08_msft_megds_random_ltd_gpt3_125m_nospike_control.log": None}


@pytest.mark.skipif(not REALLOGS.is_dir(), reason="../shared/reallogs not present")
@pytest.mark.parametrize("name", sorted(REAL_ONSETS))
def test_real_log_onsets_are_found(name, tmp_path):
    starts, _ = _onsets(REALLOGS / name, tmp_path)
    want = REAL_ONSETS[name]
    assert (starts[:1] == [want]) if want is not None else starts == []


# ---- missing is missing: what a framework prints when it did not measure ----------------

def megds_line(it, loss, *, loss_key="lm loss", loss_scale=65536.0, grad_norm=0.5, skipped=0,
               total=159576):
    """BigScience Megatron-DeepSpeed training_log (no timestamp, {:.3E} lr, num zeros);
    loss None: the line carries no loss field."""
    s = (f" iteration {it:8d}/{total:8d} | consumed samples: {it * 176:12d} |"
         f" elapsed time per iteration (ms): {61947.6:.1f} | learning rate: 6.000E-05 |"
         f" global batch size: {176:5d} |")
    if loss is not None:
        s += f" {loss_key}: {loss:.6E} |"
    s += f" loss scale: {loss_scale:.1f} | grad norm: {grad_norm:.3f} | num zeros: {0.0:.1f} |"
    s += f" number of skipped iterations: {skipped:3d} | number of nan iterations: {0:3d} |"
    return s


def deepspeed_overflow(attempted, reduced):
    return ("[2022-01-19 13:16:17,683] [INFO] [stage_1_and_2.py:1644:step] [deepscale] "
            f"OVERFLOW! Rank 0 Skipping step. Attempted loss scale: {attempted:.1f}, reducing "
            f"to {reduced:.1f}")


def test_pipeline_engine_placeholders_are_missing_not_frozen(tmp_path):
    """DeepSpeed's pipeline engine prints `loss scale: -1.0 | grad norm: 0.000` on every
    line (07_bigscience_megds3d_gpt2_dson.log): NaN, no grad-norm series, no regime even
    with N given (it was called frozen: rho_bar 0)."""
    lines = [megds_line(i, 12.4 - i / 10, loss_key="lm-loss", loss_scale=-1.0, grad_norm=0.0)
             for i in range(1, 31)]
    p = parse_megatron_log(lines)
    assert p.steps["grad_norm"].isna().all() and p.steps["loss_scale"].isna().all()
    assert p.steps["grad_norm_missing"].all()
    assert p.stats["num_grad_norm_zero"] == 30 and p.stats["num_loss_scale_unmeasured"] == 30
    log = tmp_path / "dson.log"
    log.write_text("\n".join(lines) + "\n")
    import_megatron_log(log, tmp_path / "run", clip=1.0, optim={"eps": 1e-8})
    from analysis.report import analyze_run, render_markdown

    ra = analyze_run(tmp_path / "run", num_params=52_000_000_000, num_params_source="test")
    assert ra.grad_spikes.empty and ra.regime_card.groups.empty
    assert any("no measured grad norm" in n for n in ra.regime_card.notes)
    md = render_markdown(ra)
    assert "grad norm printed as 0.000 on 30 line(s)" in md and "-1.0: not measured" in md
    assert "frozen" not in md.split("## Regime card")[1].replace("a frozen verdict", "")


def test_line_without_loss_is_missing_and_stale_grad_norm_is_dropped(tmp_path):
    """tr8-104B iteration 9027: no `lm loss` field, counters 0, the loss scale halved and
    the previous grad norm printed again: no non-finite spike (it printed `+-% at step -`),
    the stale grad norm NaN."""
    lines = [megds_line(8700 + i, 3.3 + 0.01 * (i % 3), grad_norm=2e5 + 1e3 * i)
             for i in range(30)]
    lines.append(megds_line(8730, 3.31, loss_scale=16384.0, grad_norm=20609.780))
    lines.append(megds_line(8731, None, loss_scale=8192.0, grad_norm=20609.780))
    lines.append(megds_line(8732, 3.30, loss_scale=8192.0, grad_norm=21000.0))
    p = parse_megatron_log(lines)
    st = p.steps.set_index("step")
    assert st.loc[8731, "loss_missing"] and math.isnan(st.loc[8731, "loss"])
    assert st.loc[8731, "grad_norm_stale"] and math.isnan(st.loc[8731, "grad_norm"])
    assert st.loc[8730, "grad_norm"] == pytest.approx(20609.78)
    assert p.stats["num_loss_missing"] == 1 and p.stats["loss_missing_steps"] == [8731]
    log = tmp_path / "104b.log"
    log.write_text("\n".join(lines) + "\n")
    import_megatron_log(log, tmp_path / "run")
    from analysis.report import analyze_run, render_markdown

    ra = analyze_run(tmp_path / "run")
    assert ra.spikes.empty, ra.spikes
    assert "without a loss value that no counter calls skipped (step 8731)" in \
        render_markdown(ra)


def test_deepspeed_overflow_lines_belong_to_the_next_iteration():
    lines = [megds_line(17060, 2.665, loss_scale=1048576.0, grad_norm=453082.517),
             megds_line(17061, 2.667, loss_scale=1048576.0, grad_norm=464441.887),
             deepspeed_overflow(1048576.0, 1048576.0),
             megds_line(17062, 4.374, loss_scale=1048576.0, grad_norm=464441.887),
             deepspeed_overflow(1048576.0, 524288.0),
             megds_line(17063, 4.366, loss_scale=524288.0, grad_norm=464441.887),
             megds_line(17064, 4.391, loss_scale=524288.0, grad_norm=879946.622),
             deepspeed_overflow(524288.0, 262144.0)]
    p = parse_megatron_log(lines)
    st = p.steps.set_index("step")
    assert list(st["overflow_lines"]) == [0, 0, 1, 1, 0]
    assert list(st["skipped"]) == [False, False, True, True, False]
    assert list(st["grad_norm_stale"]) == [False, False, True, True, False]
    assert st.loc[17064, "grad_norm"] == pytest.approx(879946.622)
    assert p.stats["num_overflow_lines"] == 3
    assert p.stats["num_overflow_lines_after_last_iteration"] == 1


def test_trailer_on_every_line_and_num_params_in_scientific_notation(tmp_path):
    """Tracebacks of issue 25: the MindSpeed-LLM test-only trailer on every line (its flag
    column was taken for a loss column: TypeError under pandas 3); --num-params 176e9; a
    log without grad norm with --num-params (IndexError in analysis/regime.py)."""
    from analysis.cli import main

    log = tmp_path / "mindspeed.log"
    log.write_text("".join(mindspeed_llm_line(i, 2.0 + (i % 3) / 100, fix_router=True) + "\n"
                           for i in range(1, 40)))
    assert main(["--log", str(log), "--out", str(tmp_path / "a"), "--num-params", "176e9"]) == 0
    summary = __import__("json").loads(
        (tmp_path / "a" / "mindspeed.log.run" / "summary.json").read_text())
    assert summary["regime_card"]["log"]["num_params"] == 176_000_000_000
    nogn = tmp_path / "nogn.log"
    nogn.write_text("".join(megatron_line(i, 3.0, grad_norm=None) + "\n" for i in range(1, 9)))
    assert main(["--log", str(nogn), "--out", str(tmp_path / "b"), "--num-params",
                 "1.76e11"]) == 0
    with pytest.raises(SystemExit):
        main(["--log", str(nogn), "--out", str(tmp_path / "c"), "--num-params", "1.5"])


def test_import_streams_in_chunks_with_one_malformed_event_per_chunk(tmp_path):
    """Bounded memory (issue 27, defect 10): the import parses `chunk_rows` iteration lines
    at a time, writes each chunk as one steps part and its malformed lines as one event
    (count, line numbers, the first examples), not one fsynced event per line; the run
    reads back the same table as the in-memory parse, a restart's repeated iterations
    (across chunks) keeping their last line."""
    lines = []
    for i in range(1, 261):
        lines.append(megatron_line(i, 3.0 - i / 1000))
        if i % 20 == 0:
            lines.append(megatron_line(i + 1, 2.0)[:90])          # cut off
    lines += [megatron_line(i, 2.5) for i in range(151, 161)]       # restart from 150
    log = tmp_path / "big.log"
    log.write_text("\n".join(lines) + "\n")
    res = import_megatron_log(log, tmp_path / "run", chunk_rows=100)
    run = load_run(tmp_path / "run")
    parts = sorted((tmp_path / "run" / "steps").glob("part-*"))
    assert len(parts) == 3 and res.stats["num_rows"] == 270
    ev = run.events[run.events["type"] == "malformed_log_lines"]
    assert list(ev["count"]) == [4, 5, 4] and ev["count"].sum() == res.stats["num_malformed"]
    assert all(len(x) <= 5 for x in ev["examples"]) and ev["lines"].iloc[0][0] == 21
    whole = parse_megatron_log(lines)
    assert list(run.steps["step"]) == list(range(1, 261))
    np.testing.assert_allclose(run.steps["loss"], whole.steps["loss"])
    assert (run.steps.set_index("step").loc[151:160, "loss"] == 2.5).all()
    assert res.stats["num_duplicate_steps"] == 10 == whole.stats["num_duplicate_steps"]


def test_grad_norm_is_a_second_leading_series_and_unjudged_steps_are_named(tmp_path):
    """BLOOM-176B-like excerpt: the grad norm leaves its band 4 lines before the loss; the
    report names the lead and, per series, the steps it could not judge and why."""
    from analysis.report import analyze_run, render_markdown

    loss = [2.199, 2.220, 2.595, 2.242, 2.345, 5.098, 3.492, 3.213, 2.805, 2.4, 2.3]
    gn = [0.242, 0.947, 2.390, 15.886, 145.119, 960.351, 653.0, 353.0, 20.0, 1.0, 0.3]
    lines = [megatron_line(31214 + i, x, grad_norm=g) for i, (x, g) in enumerate(zip(loss, gn))]
    lines.insert(3, megatron_line(31217, 2.2, grad_norm=None, skipped=1).replace(
        "lm loss: 2.200000E+00 |", ""))
    lines = lines[:3] + lines[3:4] + [ln for ln in lines[4:] if "31217/" not in ln]
    log = tmp_path / "bloom.log"
    log.write_text("\n".join(lines) + "\n")
    import_megatron_log(log, tmp_path / "run")
    ra = analyze_run(tmp_path / "run")
    assert list(ra.spikes["start"]) == [31219]
    assert list(ra.grad_spikes["start"]) == [31215]
    assert ra.grad_lead.set_index("start").loc[31219, "lead"] == 4
    md = render_markdown(ra)
    # the skipped step two lines before the onset decides the verdict; the lead is named
    assert "- loss spike at step 31219: **numerics**: 1 skipped iteration(s)" in md
    assert "grad norm: grad norm left its band at iteration 31215" in md
    assert "4 iteration(s) before" in md
    cov = ra.coverage
    assert {r["reason"].split(" (")[0]: r["steps"] for r in cov["loss"]["reasons"]} == {
        "skipped step without a value": [31217], "too little history": [31214]}
    assert "grad_norm: 9 of 11 logged steps judged" in md


@pytest.mark.skipif(not REALLOGS.is_dir(), reason="../shared/reallogs not present")
def test_real_bloom_grad_norm_leads_its_loss_spike_by_4_steps(tmp_path):
    from analysis.report import analyze_run

    import_megatron_log(REALLOGS / "01_bigscience_tr11_bloom176b.log", tmp_path / "run")
    lead = analyze_run(tmp_path / "run").grad_lead.set_index("start")
    assert lead.loc[31219, "grad_start"] == 31215 and lead.loc[31219, "lead"] == 4
