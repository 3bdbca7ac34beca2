"""train_mindspeed.sh for the stacks users run: --rotary-base and MindSpeed's fused-kernel
flags gated by MEGATRON_STACK, the probe enabled, per-setting log names and an analyze
hint that works (also for two settings into one report)."""

import shlex
import subprocess
from pathlib import Path


from analysis.cli import log_run_names
from analysis.cli import main as analyze_main
from fullscale.launch import launch_main

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "configs" / "llama2-70b.toml"
CLUSTER = ROOT / "configs" / "cluster-128x8.toml"


def _script(tmp_path, name, *extra):
    out = tmp_path / name
    assert launch_main(["--config", str(BASE), "--cluster", str(CLUSTER), "--master-addr", "n0",
                        "--out", str(out), *extra]) == 0
    return (out / "train_mindspeed.sh").read_text(), out


def _stack_args(script: str, stack: str):
    """Run the script's MEGATRON_STACK case block in bash; (exit code, STACK_ARGS, stderr)."""
    lines = script.splitlines()
    i = next(k for k, l in enumerate(lines) if l.startswith("MEGATRON_STACK="))
    j = next(k for k in range(i, len(lines)) if lines[k] == "esac")
    block = "\n".join(lines[i:j + 1]) + '\nprintf "%s\\n" ${STACK_ARGS[@]+"${STACK_ARGS[@]}"}\n'
    r = subprocess.run(["bash", "-c", "set -euo pipefail\n" + block], capture_output=True,
                       text=True, env={"MEGATRON_STACK": stack, "PATH": "/usr/bin:/bin"})
    return r.returncode, r.stdout.split(), r.stderr


def test_rope_default_omits_rotary_base_and_fused_flags_follow_the_stack(tmp_path):
    ms, _ = _script(tmp_path, "a")
    assert "--rotary-base" not in ms             # rope_theta 10000: every version's default
    assert _stack_args(ms, "mindspeed-llm")[:2] == (0, ["--use-fused-rmsnorm", "--use-fused-swiglu",
                                                        "--use-fused-rotary-pos-emb"])
    # ModelLink of early 2024 (CANN 7.0): no --use-fused-swiglu yet
    assert _stack_args(ms, "modellink-2024")[:2] == (0, ["--use-fused-rmsnorm", "--use-fused-rotary-pos-emb"])
    assert _stack_args(ms, "megatron-lm")[:2] == (0, [])
    code, _, err = _stack_args(ms, "megatron-2019")
    assert code == 2 and "MEGATRON_STACK must be one of" in err
    assert 'MEGATRON_STACK="${MEGATRON_STACK:-mindspeed-llm}"' in ms   # npu default


def test_other_rope_theta_is_passed_where_the_stack_knows_it(tmp_path):
    ms, _ = _script(tmp_path, "b", "--model.rope_theta", "500000")
    assert _stack_args(ms, "mindspeed-llm")[1][:2] == ["--rotary-base", "500000"]
    assert _stack_args(ms, "megatron-lm")[:2] == (0, ["--rotary-base", "500000"])
    code, _, err = _stack_args(ms, "modellink-2024")
    assert code == 2 and "has no --rotary-base" in err
    ms_cuda, _ = _script(tmp_path, "c", "--device", "cuda")
    assert 'MEGATRON_STACK="${MEGATRON_STACK:-megatron-lm}"' in ms_cuda
    assert _stack_args(ms_cuda, "mindspeed-llm")[1] == []          # no MindSpeed kernels on cuda


def test_probe_is_enabled_and_logs_are_named_per_setting(tmp_path):
    ms, out = _script(tmp_path, "eps1e-06-b2_0.95")
    assert "ENTRY=(-m fullscale.megatron_probe --adaptor auto -- pretrain_gpt.py)" in ms
    assert 'torchrun "${DISTRIBUTED_ARGS[@]}" "${ENTRY[@]}" \\' in ms
    assert f"export ADAMSPIKE_PROBE_OUT={out / 'run_megatron' / 'telemetry'}" in ms
    assert 'ADAMSPIKE_PROBE:-1' in ms
    assert '/eps1e-06-b2_0.95".node${NODE_RANK}.log"' in ms
    assert "node127.log\"" not in ms.replace("eps1e-06-b2_0.95.node127", "")
    r = subprocess.run(["bash", "-n"], input=ms, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _hints(ms: str):
    return [shlex.split(l.lstrip("# ").split("      #")[0]) for l in ms.splitlines()
            if l.startswith("#   adamspike analyze")]


def _line(it, loss):
    """Megatron-LM's training_log line (megatron/training/training.py format strings)."""
    return (f" [2024-06-01 12:00:01.123456] iteration {it:8d}/{5000:8d} |"
            f" consumed samples: {it * 1024:12d} | elapsed time per iteration (ms): {15234.5:.1f} |"
            f" learning rate: {1.5e-4:.6E} | global batch size: {1024:5d} | lm loss: {loss:.6E} |"
            f" loss scale: {1.0:.1f} | grad norm: {0.8:.3f} | number of skipped iterations: {0:3d} |"
            f" number of nan iterations: {0:3d} |")


def test_two_settings_logs_into_one_report(tmp_path, capsys):
    logs = []
    for name in ("eps1e-05-b2_0.95", "eps1e-06-b2_0.9"):
        ms, out = _script(tmp_path, name)
        probe_hint, log_hint = _hints(ms)
        assert probe_hint[:2] == ["adamspike", "analyze"]
        argv = log_hint[2:]
        f = dict(zip(argv[::2], argv[1::2]))
        assert (f["--seq-len"], f["--clip"], f["--b2"], f["--eps"]) == ("4096", "1", "0.95", "1e-05")
        log = Path(f["--log"])
        assert log.name == f"{name}.node127.log"
        log.parent.mkdir(parents=True)
        log.write_text("\n".join(_line(i, 3.0 - i / 1000) for i in range(1, 81)) + "\n")
        logs.append(argv)
    report = tmp_path / "report"
    a, b = logs
    merged = ["--log", a[a.index("--log") + 1], "--log", b[b.index("--log") + 1]]
    merged += [x for k, v in zip(a[::2], a[1::2]) if k not in ("--log", "--out") for x in (k, v)]
    assert analyze_main(merged + ["--out", str(report)]) == 0
    index = (report / "report.md").read_text()
    assert "eps1e-05-b2_0.95.node127.log" in index and "eps1e-06-b2_0.9.node127.log" in index
    # the hint's own command, as printed, works too
    assert analyze_main(logs[0][:logs[0].index("--out")] + ["--out", str(tmp_path / "one")]) == 0


def test_same_named_logs_get_distinct_run_names(tmp_path):
    a, b = tmp_path / "s1" / "logs" / "node127.log", tmp_path / "s2" / "logs" / "node127.log"
    names = log_run_names([str(a), str(b)])
    assert names == ["s1_logs_node127.log.run", "s2_logs_node127.log.run"]
    assert log_run_names([str(a)]) == ["node127.log.run"]
    for p in (a, b):
        p.parent.mkdir(parents=True)
        p.write_text("\n".join(_line(i, 2.0 + 1 / i) for i in range(1, 61)) + "\n")
    out = tmp_path / "r"
    assert analyze_main(["--log", str(a), "--log", str(b), "--out", str(out)]) == 0
    assert (out / "s1_logs_node127.log.run" / "run.json").is_file()
    assert (out / "s2_logs_node127.log.run" / "run.json").is_file()
