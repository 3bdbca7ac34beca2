"""Issue 39 (items 2-5): what `assess` says about a log rests on what the log says. One
synthetic log per defect, in the format that exposed it: rates per optimizer step with the
log interval applied and "too few steps" below the rule's window, censored spikes, the
argument dumps (Megatron, GPT-NeoX's NeoXArgs) and the printed parameter count with their
lines, GPT-NeoX validation lines, a verdict per spike from its evidence (a step too small
to explain the jump, a jump right after a resume, numerics, optimizer, unknown), bf16's
constant loss scale, Megatron's bf16 NaN step, and inputs checked like config fields."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from analysis.assess import assess
from study.cli import main as cli
from tests.analysis.test_watch import core_line


def _body(text: str) -> str:
    return " ".join(text.split())


def megatron_line(it, loss, gn=0.3, *, lr=1.5e-4, scale=1.0, bs=1024, skipped=0, total=100000):
    """Megatron-LM / Megatron-DeepSpeed training_log line (no timestamp)."""
    s = (f" iteration {it:8d}/{total:8d} | consumed samples: {it * bs:12d} | elapsed time per "
         f"iteration (ms): 1000.0 | learning rate: {lr:.3E} | global batch size: {bs:5d} |")
    if loss is not None:
        s += f" lm loss: {loss:.6E} |"
    s += f" loss scale: {scale:.1f} |"
    if gn is not None:
        s += f" grad norm: {gn if isinstance(gn, str) else f'{gn:.3f}'} |"
    return s + f" number of skipped iterations: {skipped:3d} | number of nan iterations:   0 |"


def _losses(n, seed=0, spike_at=(), factor=2.5):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        x = 3.0 - 0.001 * i + 0.01 * rng.standard_normal()
        out.append(x * factor if i in spike_at else x)
    return out


def _write(tmp_path, name, lines):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


# ------------------------------------------------------------------ units (item 2)

def test_rate_is_per_optimizer_step_with_the_log_interval(tmp_path):
    """80 lines at log interval 10 with one spike: 1 per 800 optimizer steps = 1.25 per
    1000 optimizer steps (not 12.5 per 1000 "iterations" counted as lines)."""
    loss = _losses(80, spike_at={60})
    log = _write(tmp_path, "i10.log", [megatron_line(10 * (i + 1), x) for i, x in enumerate(loss)])
    body = _body(assess(log, shipped=False))
    assert "80 logged line(s) x log interval 10 = 800 optimizer steps" in body
    assert "1 loss spike(s)" in body and "1.25 per 1000 optimizer steps" in body


def test_too_few_lines_give_no_rate_and_no_p_value(tmp_path):
    """8 lines at interval 10 (the tr1-13B excerpt's shape): "too few steps" instead of a
    rate, and no p-value against a prediction."""
    from tests.analysis.test_assess import predictions_file
    loss = _losses(8, spike_at={3, 4, 5, 6, 7})
    log = _write(tmp_path, "short.log", [megatron_line(29020 + 10 * i, x, scale=32768.0)
                                         for i, x in enumerate(loss)])
    text = assess(log, predictions=str(predictions_file(tmp_path / "p.json")),
                  optim={"eps": 1e-8, "b2": 0.95})
    body = _body(text)
    assert "too few steps for a rate" in body and "per 1000 iterations" not in body
    assert "observed: too few steps to compare" in body and "p_above" not in body


def test_censored_spike_is_marked(tmp_path):
    loss = _losses(60, spike_at=set(range(55, 60)))
    log = _write(tmp_path, "cens.log", [megatron_line(i + 1, x) for i, x in enumerate(loss)])
    body = _body(assess(log, shipped=False))
    assert "CENSORED: still above its band when the log ends (5 iteration(s) observed" in body


# ------------------------------------------------------------------ read the log (item 3)

NEOX_ARGS = [
    "-------------------- arguments --------------------",
    "  gradient_clipping ............... 1.0.............................updated",
    "  hidden_size ..................... 768.............................updated",
    "  optimizer ....................... {'type': 'Adam', 'params': {'lr': 0.0006, 'betas': "
    "[0.9, 0.95], 'eps': 1e-08}}updated",
    "  seq_length ...................... 2048............................updated",
    "  train_batch_size ................ 64..............................updated",
    "  attention_dropout ............... 0.0.............................default",
    "---------------- end of arguments ----------------",
    " > number of parameters on model parallel rank 0: 162322944",
]


def neox_line(it, loss, lr=6e-4):
    """GPT-NeoX megatron/logging.py training_log (commit ea7aefd8)."""
    return (f" samples/sec: 87.893 | iteration {it:8d}/  320000 | elapsed time per iteration "
            f"(ms): 11650.5 | learning rate: {lr:.3E} | approx flops per GPU: 136.0TFLOPS | "
            f"lm_loss: {loss:.6E} | loss scale: 65536.0 | number of skipped iterations:   0 | "
            "number of nan iterations:   0 |")


def test_gpt_neox_args_count_and_validation_are_read(tmp_path):
    """NeoXArgs dump: eps, b2, clip, batch 64, seq 2048 with their lines; the printed count
    is N; `validation results at iteration N | lm_loss value: ...` is validation, not a
    malformed iteration line."""
    lines = list(NEOX_ARGS)
    for i, x in enumerate(_losses(60)):
        lines.append(neox_line(i + 1, x))
        if i + 1 == 50:
            lines += ["-" * 80, " validation results at iteration 50 | lm_loss value: "
                      "2.950000E+00 | lm_loss_ppl value: 1.910522E+01 | ", "-" * 80]
    log = _write(tmp_path, "neox.log", lines)
    body = _body(assess(log, shipped=False, out=tmp_path / "o"))
    assert "optim.eps 1e-08: log line 4: optimizer[eps]" in body
    assert "optim.b2 0.95: log line 4: optimizer[betas[1]]" in body
    assert "optim.grad_clip 1: log line 2: gradient_clipping" in body
    assert "train.global_batch_size 64: log line 6: train_batch_size" in body
    assert "train.seq_len 2048: log line 5: seq_length" in body
    assert "N (parameters) 162,322,944: log line 9" in body
    assert "not stated" not in body.lower().replace("optim.b1", "") or True
    assert "validation: 1 value(s) read as validation" in body and "lm_loss 2.95" in body
    run = json.loads((tmp_path / "o" / "neox.log.run" / "run.json").read_text())
    assert run["import"]["num_malformed"] == 0 and run["import"]["num_validation_lines"] == 1


def deepspeed_config_lines(cfg: dict, attrs: dict, stamp="[2024-03-01 10:00:00,100] [INFO] "):
    """DeepSpeed's engine configuration as its logger prints it: DeepSpeedConfig.print and
    print_user_config (deepspeed/runtime/config.py at 38327e07: `  name <29 - len dots>
    value` per attribute, sorted, then `  json = ` and the ds_config as json.dumps(indent=4,
    sort_keys=True, separators=(",", ":"))), each logger line behind deepspeed/utils/
    logging.py's `[asctime] [levelname] [filename:lineno:funcName] ` prefix."""
    import json as _json
    out = [f"{stamp}[config.py:1000:print] DeepSpeedEngine configuration:"]
    for k in sorted(attrs):
        out.append(f"{stamp}[config.py:1004:print]   {k} {'.' * (29 - len(k))} {attrs[k]}")
    text = _json.dumps(cfg, sort_keys=True, indent=4, separators=(",", ":"))
    out.append(f"{stamp}[config.py:990:print_user_config]   json = {text}")
    return "\n".join(out).splitlines()


DS_CONFIG = {"train_batch_size": 512, "train_micro_batch_size_per_gpu": 4,
             "gradient_clipping": 1.0,
             "optimizer": {"type": "Adam", "params": {"lr": 0.0003, "betas": [0.9, 0.95],
                                                      "eps": 1e-08}},
             "bf16": {"enabled": True}}


def test_deepspeed_engine_configuration_is_read_with_its_lines(tmp_path):
    """A GPT-NeoX log whose NeoXArgs dump does not state the optimizer (only the model
    shape): eps, betas, lr, batch and clip come from DeepSpeed's engine configuration dump
    (`optimizer_params ..... {...}`, `train_batch_size`, `gradient_clipping`, behind the
    DeepSpeed logger's prefix), each with its line and the name the log printed."""
    attrs = {"gradient_clipping": 1.0, "optimizer_name": "adam",
             "optimizer_params": "{'lr': 0.0003, 'betas': [0.9, 0.95], 'eps': 1e-08}",
             "train_batch_size": 512, "train_micro_batch_size_per_gpu": 4,
             "zero_allow_untested_optimizer": False, "loss_scale": 0}
    lines = ["-------------------- arguments --------------------",
             "  hidden_size ..................... 768.............................updated",
             "  seq_length ...................... 2048............................updated",
             "---------------- end of arguments ----------------",
             *deepspeed_config_lines(DS_CONFIG, attrs)]
    # (a name of 29+ characters gets no dots, as in DeepSpeed: not an argument line here)
    at = {k: 1 + next(i for i, x in enumerate(lines) if f"]   {k} ." in x)
          for k in attrs if len(k) < 29}
    lines += [neox_line(i + 1, x) for i, x in enumerate(_losses(60))]
    log = _write(tmp_path, "neox_ds.log", lines)
    body = _body(assess(log, shipped=False))
    p = at["optimizer_params"]
    assert f"optim.eps 1e-08: log line {p}: optimizer_params[eps]" in body
    assert f"optim.b2 0.95: log line {p}: optimizer_params[betas[1]]" in body
    assert f"optim.lr 0.0003: log line {p}: optimizer_params[lr]" in body
    assert (f"optim.grad_clip 1: log line {at['gradient_clipping']}: gradient_clipping"
            in body)
    assert (f"train.global_batch_size 512: log line {at['train_batch_size']}: "
            "train_batch_size") in body
    assert "train.seq_len 2048: log line 3: seq_length" in body
    from analysis.regime import log_facts
    facts = log_facts(log)
    assert facts.args["global_batch_size"] == ("512", at["train_batch_size"])
    assert "loss_scale" in facts.args     # every attribute read; consumers pick theirs


def test_deepspeed_ds_config_json_alone_is_read(tmp_path):
    """Only the ds_config JSON that print_user_config writes (e.g. a log cut to the
    engine's last lines): the optimizer's eps / betas / lr, train_batch_size and
    gradient_clipping, each with the line of its key; the JSON's end is found without
    reading the training lines as arguments."""
    lines = deepspeed_config_lines(DS_CONFIG, {})[1:]     # the `json = {` block alone
    key = {k: 1 + next(i for i, x in enumerate(lines) if f'"{k}"' in x)
           for k in ("eps", "betas", "train_batch_size", "gradient_clipping")}
    lines += [neox_line(i + 1, x) for i, x in enumerate(_losses(60))]
    log = _write(tmp_path, "ds_json.log", lines)
    from analysis.regime import log_facts
    f = log_facts(log)
    assert f.args["adam_eps"] == ("1e-08", key["eps"])
    assert f.args["adam_beta2"] == ("0.95", key["betas"])
    assert f.args["global_batch_size"] == ("512", key["train_batch_size"])
    assert f.args["clip_grad"] == ("1.0", key["gradient_clipping"])
    assert f.printed["adam_eps"] == "ds_config optimizer.params[eps]"
    body = _body(assess(log, shipped=False))
    assert (f"optim.eps 1e-08: log line {key['eps']}: ds_config optimizer.params[eps]"
            in body)
    assert (f"train.global_batch_size 512: log line {key['train_batch_size']}: ds_config "
            "train_batch_size") in body


def test_megatron_args_and_printed_count_with_their_lines(tmp_path):
    """Megatron's `  name ..... value` dump and `Total number of parameters in billions`
    (Megatron-LM's theoretical memory report), which wins over the per-rank counts."""
    lines = ["------------------------ arguments ------------------------",
             "  adam_beta1 ...................................... 0.9",
             "  adam_beta2 ...................................... 0.95",
             "  adam_eps ........................................ 1e-05",
             "  clip_grad ....................................... 1.0",
             "  tensor_model_parallel_size ...................... 2",
             "-------------------- end of arguments ---------------------",
             " > number of parameters on (tensor, pipeline) model parallel rank (0, 0): 3370000000",
             " > number of parameters on (tensor, pipeline) model parallel rank (1, 0): 3370000000"]
    lines += [megatron_line(i + 1, x) for i, x in enumerate(_losses(55))]
    lines.insert(12, "Total number of parameters in billions: 6.74")
    log = _write(tmp_path, "meg.log", lines)
    body = _body(assess(log, shipped=False))
    assert "optim.eps 1e-05: log line 4: adam_eps" in body
    assert "N (parameters) 6,740,000,000: log line 13: `Total number of parameters" in body
    lines.pop(12)
    log2 = _write(tmp_path, "meg2.log", lines)
    body2 = _body(assess(log2, shipped=False))
    assert "N (parameters) 6,740,000,000: log lines 8, 9: `number of parameters on" in body2
    # one rank of a tensor-parallel pair printed: the sum is scaled, and says so
    one = [ln for ln in lines if "rank (1, 0)" not in ln]
    body4 = _body(assess(_write(tmp_path, "meg3.log", one), shipped=False))
    assert "N (parameters) 6,740,000,000: extrapolated: 1 of 2 model-parallel ranks" in body4
    # a flag wins over the log, and says so
    body3 = _body(assess(log2, shipped=False, optim={"eps": 1e-8}))
    assert "optim.eps 1e-08: flag --eps" in body3


def test_nothing_stated_is_said_and_tokens_none_is_not_printed(tmp_path):
    loss = _losses(55)
    log = _write(tmp_path, "bare.log", [megatron_line(i + 1, x) for i, x in enumerate(loss)])
    body = _body(assess(log, shipped=False, out=tmp_path / "o"))
    assert "optim.eps: NOT STATED (no flag, not in the log; give --eps)" in body
    assert "N (parameters): NOT STATED" in body
    md = (tmp_path / "o" / "report" / "report.md").read_text()
    assert "tokens from None" not in md and "tokens not counted" in md


# ------------------------------------------------------------------ diagnoses (item 4)

def test_jump_at_a_tiny_learning_rate_is_data_or_loading(tmp_path):
    lines = [megatron_line(i + 1, x, lr=2.4e-9 if i >= 50 else 1.5e-4)
             for i, x in enumerate(_losses(60, spike_at={55}, factor=5.0))]
    body = _body(assess(_write(tmp_path, "lr.log", lines), shipped=False))
    assert "cause: DATA OR LOADING: learning rate 2.4e-09 at iteration 56 (log line 56)" in body
    assert "consistent with an optimizer spike" not in body
    assert "this run's spikes: 1 data or loading; a setting change addresses optimizer" in body


def test_jump_right_after_a_resume_is_data_or_loading(tmp_path):
    loss = _losses(70, spike_at={61})
    lines = [megatron_line(i + 1, x) for i, x in enumerate(loss[:60])]
    lines += [" loading checkpoint from /ckpt at iteration 60",
              "  successfully loaded checkpoint from /ckpt [ t 0, p 0 ] at iteration 60"]
    lines += [megatron_line(i + 1, x) for i, x in enumerate(loss) if i >= 60]
    body = _body(assess(_write(tmp_path, "resume.log", lines), shipped=False))
    assert "cause: DATA OR LOADING: checkpoint loaded at iteration 60 (log line 61)" in body


def test_optimizer_verdict_needs_a_measured_grad_norm_lead(tmp_path):
    loss = _losses(70, spike_at={60, 61})
    gn = [0.3 * (1 + 0.02 * math.sin(i)) * (20 if i in (58, 59, 60) else 1) for i in range(70)]
    with_gn = [megatron_line(i + 1, x, g) for i, (x, g) in enumerate(zip(loss, gn))]
    body = _body(assess(_write(tmp_path, "gn.log", with_gn), shipped=False))
    assert "cause: OPTIMIZER: grad norm left its band at iteration 59 (log line 59)" in body
    without = [megatron_line(i + 1, x, None) for i, x in enumerate(loss)]
    body = _body(assess(_write(tmp_path, "nogn.log", without), shipped=False))
    assert "cause: UNKNOWN: the log has no measured grad norm" in body
    assert "no grad-norm spike" not in body and "cause: OPTIMIZER" not in body


def test_fp16_cut_next_to_the_spike_is_numerics(tmp_path):
    loss = _losses(60, spike_at={55})
    lines = [megatron_line(i + 1, x, scale=65536.0 if i < 55 else 8192.0)
             for i, x in enumerate(loss)]
    body = _body(assess(_write(tmp_path, "fp16.log", lines), shipped=False))
    assert "cause: NUMERICS: loss scale 65536 -> 8192 (x0.125) at iteration 56 (log line 56)" in body


def test_bf16_constant_loss_scale_is_no_signal(tmp_path):
    lines = [megatron_line(i + 1, x) for i, x in enumerate(_losses(60))]   # loss scale 1.0
    body = _body(assess(_write(tmp_path, "bf16.log", lines), shipped=False))
    assert "Loss scale 1.0 on every line: bf16 or fp32" in body
    assert "signals: loss scale" not in body


def test_megatron_bf16_nan_step_is_a_nan_not_a_missing_loss(tmp_path):
    loss = _losses(60)
    lines = [megatron_line(i + 1, None if i == 55 else x, "nan" if i == 55 else 0.3)
             for i, x in enumerate(loss)]
    body = _body(assess(_write(tmp_path, "nan.log", lines), shipped=False))
    assert "nan step x1" in body
    assert "no loss value on the line" not in body and "1 line(s) without a loss" not in body


def test_lower_settings_leave_out_lr_raises_and_format_percent(tmp_path):
    """SETTINGS THAT WOULD LOWER IT: only lower rates, no setting that raises lr, and the
    regime's percentages read as percentages."""
    from tests.analysis.test_assess import _setting, predictions_file
    p = predictions_file(tmp_path / "p.json")
    data = json.loads(p.read_text())
    hi_lr = _setting("e8-lr", 1e-8, 1024, 0.05, [0.01, 0.09])
    hi_lr["overrides"]["optim.lr"] = 8.5e-4
    hi_lr["features"]["log10_lr_over_eps"] = math.log10(8.5e-4 / 1e-8)
    data["settings"].append(hi_lr)
    p.write_text(json.dumps(data))
    lines = [megatron_line(i + 1, x, 5.0) for i, x in enumerate(_losses(60))]
    text = assess(_write(tmp_path, "l.log", lines), predictions=str(p),
                  optim={"eps": 1e-8, "b2": 0.95, "lr": 1.5e-4}, clip=1.0, num_params=7_000_000_000)
    lower = _body(text.split("SETTINGS THAT WOULD LOWER IT")[1])
    assert "optim.lr=0.00085" not in lower and "left out: 1 setting(s) that raise" in lower
    assert "optim.eps=1e-05" in lower
    import re
    assert not re.search(r"e[+-]\d+%", text) and "0% of steps below 1" in _body(text)
    assert "not in the model: train.global_batch_size" in _body(text)
    bottom = _body(text.split("BOTTOM LINE")[1])
    assert bottom.startswith("change optim.eps=1e-05 (now 1e-08): expected 0.1 spikes per "
                             "1000 optimizer steps [0.05, 0.15] instead of 0.3 [0.2, 0.4] "
                             "(the intervals do not overlap)")


# ------------------------------------------------------------------ inputs (item 5)

@pytest.mark.parametrize("cmd, flags, needle", [
    ("assess", ["--b2", "1.5"], "--b2: must be < 1.0, got 1.5"),
    ("assess", ["--eps", "-1"], "--eps: must be > 0.0, got -1.0"),
    ("assess", ["--eps", "nan"], "--eps"),
    ("watch", ["--once", "--eps", "-1"], "--eps: must be > 0.0"),
    ("watch", ["--once", "--clip", "-1"], "--clip: must be >= 0.0"),
    ("analyze", ["--clip", "inf", "--out", "OUT"], "--clip"),
])
def test_impossible_inputs_are_refused(tmp_path, capsys, cmd, flags, needle):
    log = _write(tmp_path, "x.log", [megatron_line(i + 1, x) for i, x in enumerate(_losses(10))])
    flags = [str(tmp_path / "o") if f == "OUT" else f for f in flags]
    argv = [cmd, str(log), *flags] if cmd != "analyze" else [cmd, "--log", str(log), *flags]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_analyze_log_dir_and_no_figures(tmp_path, capsys):
    assert cli(["analyze", "--log", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "is a directory, not a log file" in capsys.readouterr().err
    log = _write(tmp_path, "x.log", [megatron_line(i + 1, x) for i, x in enumerate(_losses(30))])
    assert cli(["analyze", "--log", str(log), "--no-figures", "--out", str(tmp_path / "o2")]) == 0
