"""train_mindspeed.sh for the stacks users run: the flags of the current MindSpeed-LLM
LLaMA2 examples (mcore models, local transformer, PretrainedFromHF tokenizer), --rotary-base
and MindSpeed's fused-kernel flags gated by MEGATRON_STACK, Megatron's spiky-loss / large-grad
/ rerun / skip flags where the stack has them, every generated flag checked against the
vendored option names of that stack's parsers (fullscale/megatron_options.json), the probe
enabled, no machine-local path, per-setting log names and an analyze hint that works (also
for two settings into one report)."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest


from analysis.cli import log_run_names
from analysis.cli import main as analyze_main
from fullscale.launch import OPTIONS_FILE, REPO_ROOT, STACKS, launch_main

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "configs" / "llama2-70b.toml"
CLUSTER = ROOT / "configs" / "cluster-128x8.toml"


def _script(tmp_path, name, *extra):
    out = tmp_path / name
    assert launch_main(["--config", str(BASE), "--cluster", str(CLUSTER), "--master-addr", "n0",
                        "--out", str(out), *extra]) == 0
    return (out / "train_mindspeed.sh").read_text(), out


def _stack_args(script: str, stack: str, env=None):
    """Run the script's MEGATRON_STACK case block in bash; (exit code, STACK_ARGS, stderr)."""
    lines = script.splitlines()
    i = next(k for k, l in enumerate(lines) if l.startswith("MEGATRON_STACK="))
    j = next(k for k in range(i, len(lines)) if lines[k] == "esac")
    block = "\n".join(lines[i:j + 1]) + '\nprintf "%s\\n" ${STACK_ARGS[@]+"${STACK_ARGS[@]}"}\n'
    r = subprocess.run(["bash", "-c", "set -euo pipefail\n" + block], capture_output=True,
                       text=True, env={"MEGATRON_STACK": stack, "PATH": "/usr/bin:/bin",
                                       "TOKENIZER_PATH": "/tok", "TOKENIZER_MODEL": "/tok.model",
                                       **(env or {})})
    return r.returncode, r.stdout.split(), r.stderr


MCORE = ["--use-mcore-models", "--transformer-impl", "local", "--ckpt-format", "torch"]
FUSED = ["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb"]
HF_TOK = ["--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", "/tok"]
SP_TOK = ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "/tok.model"]
GUARD = ["--check-for-spiky-loss", "--check-for-large-grads", "--rerun-mode", "validate_results"]


def test_rope_default_omits_rotary_base_and_fused_flags_follow_the_stack(tmp_path):
    ms, _ = _script(tmp_path, "a")
    assert "--rotary-base" not in ms             # rope_theta 10000: every version's default
    # MindSpeed-LLM's examples/mcore/llama2 scripts (core_v0.12.1)
    assert _stack_args(ms, "mindspeed-llm")[:2] == (0, MCORE + FUSED + HF_TOK + GUARD)
    # ModelLink of early 2024 (CANN 7.0): no --use-fused-swiglu yet, legacy models
    assert _stack_args(ms, "modellink-2024")[:2] == (0, ["--use-fused-rmsnorm",
                                                         "--use-fused-rotary-pos-emb",
                                                         "--accumulate-allreduce-grads-in-fp32"] + SP_TOK)
    assert _stack_args(ms, "megatron-lm")[:2] == (0, ["--use-mcore-models"] + SP_TOK + GUARD)
    code, _, err = _stack_args(ms, "megatron-2019")
    assert code == 2 and "MEGATRON_STACK must be one of" in err
    # no default stack: detected on the node (fullscale.stack) unless named
    assert 'MEGATRON_STACK="${MEGATRON_STACK:-}"' in ms and "python -m fullscale.stack" in ms


def test_other_rope_theta_is_passed_where_the_stack_knows_it(tmp_path):
    ms, _ = _script(tmp_path, "b", "--model.rope_theta", "500000")
    assert _stack_args(ms, "mindspeed-llm")[1][5:7] == ["--rotary-base", "500000"]
    assert _stack_args(ms, "megatron-lm")[1][:3] == ["--use-mcore-models", "--rotary-base", "500000"]
    code, _, err = _stack_args(ms, "modellink-2024")
    assert code == 2 and "has no --rotary-base" in err
    ms_cuda, _ = _script(tmp_path, "c", "--device", "cuda")
    assert _stack_args(ms_cuda, "mindspeed-llm")[1] == MCORE + HF_TOK + GUARD   # no MindSpeed kernels


def test_megatron_spike_tools_and_the_restart_recipe_variables(tmp_path):
    ms, _ = _script(tmp_path, "g")
    for stack in ("mindspeed-llm", "megatron-lm"):
        code, args, _ = _stack_args(ms, stack, {"CKPT_STEP": "1000", "MEGATRON_RERUN_MODE": "disabled"})
        # --rerun-mode always explicit: its default changed at core_v0.14
        assert code == 0 and not {"--check-for-spiky-loss", "--check-for-large-grads"} & set(args)
        assert args[-4:] == ["--rerun-mode", "disabled", "--ckpt-step", "1000"]
    # Megatron-LM's own --iterations-to-skip: raw values passed through
    code, args, _ = _stack_args(ms, "megatron-lm", {"ITERATIONS_TO_SKIP": "1000 1001 1002"})
    assert code == 0 and args[-4:] == ["--iterations-to-skip", "1000", "1001", "1002"]
    # MindSpeed-LLM's and ModelLink's loops have none: refused, SKIP_ITERATIONS (the probe) instead
    for stack in ("mindspeed-llm", "modellink-2024"):
        code, _, err = _stack_args(ms, stack, {"ITERATIONS_TO_SKIP": "1000 1001"})
        assert code == 2 and "use SKIP_ITERATIONS" in err
    code, _, err = _stack_args(ms, "modellink-2024", {"CKPT_STEP": "1000"})
    assert code == 2 and "no --ckpt-step" in err
    code, _, err = _stack_args(ms, "mindspeed-llm", {"SKIP_ITERATIONS": "1001-1200", "ADAMSPIKE_PROBE": "0"})
    assert code == 2 and "SKIP_ITERATIONS needs the probe" in err
    code, _, err = _stack_args(ms, "mindspeed-llm", {"TOKENIZER_PATH": ""})
    assert code != 0 and "set TOKENIZER_PATH" in err
    head = ms.split("set -euo pipefail")[0]
    assert "--check-for-spiky-loss" in head and "SKIP_ITERATIONS" in head and "rerun" in head


def _run_script(script: Path, tmp_path: Path, **env):
    """Execute train_mindspeed.sh with stand-ins for torchrun (prints its argv) and the
    CANN set_env.sh; returns (exit code, torchrun argv after pretrain_gpt.py, stderr)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "torchrun").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    (bin_dir / "torchrun").chmod(0o755)
    (bin_dir / "python").write_text(f'#!/usr/bin/env bash\nexec {sys.executable} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    ms_dir = tmp_path / "MindSpeed-LLM"
    ms_dir.mkdir(exist_ok=True)
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "MINDSPEED_LLM_DIR": str(ms_dir),
            "MEGATRON_STACK": "mindspeed-llm",
            "ADAMSPIKE_HOME": str(REPO_ROOT), "TOKENIZER_PATH": "/tok",
            "TOKENIZER_MODEL": "/tok.model"}
    r = subprocess.run(["bash", str(script), "0"], capture_output=True, text=True,
                       env={k: v for k, v in {**base, **env}.items() if v is not None})
    argv = r.stdout.split("\n")[:-1]
    return r.returncode, argv[argv.index("pretrain_gpt.py") + 1:] if "pretrain_gpt.py" in argv else argv, r.stderr


def _cluster(tmp_path, device="npu"):
    set_env = tmp_path / "set_env.sh"
    set_env.write_text("true\n")
    c = tmp_path / f"cluster-{device}.toml"
    c.write_text(CLUSTER.read_text().replace("/usr/local/Ascend/ascend-toolkit/set_env.sh",
                                             str(set_env)).replace('device = "npu"', f'device = "{device}"'))
    return c


@pytest.mark.parametrize("device, extra", [
    ("npu", []), ("npu", ["--model.rope_theta", "500000"]), ("cuda", []),
    ("npu", ["--data.source", "synthetic"]), ("npu", ["--model.vocab_size", "32256"]),
])
def test_every_generated_flag_is_in_its_stack_parser(tmp_path, device, extra):
    """The script is executed for every stack (restart variables set, rerun on) and each
    --flag torchrun receives must be an option name of that stack's parsers, vendored with
    their source repository and commit."""
    vendored = json.loads(OPTIONS_FILE.read_text())
    assert set(vendored["stacks"]) == set(STACKS)
    for v in vendored["stacks"].values():
        assert all(len(src["commit"]) == 40 and src["repo"] for src in v["sources"])
    out = tmp_path / "l"
    assert launch_main(["--config", str(BASE), "--cluster", str(_cluster(tmp_path, device)),
                        "--master-addr", "n0", "--out", str(out), *extra]) == 0
    checked = 0
    for stack in STACKS:
        code, argv, err = _run_script(out / "train_mindspeed.sh", tmp_path, MEGATRON_STACK=stack,
                                      CKPT_STEP=None if stack == "modellink-2024" else "1000",
                                      SKIP_ITERATIONS="1001-1200",
                                      ITERATIONS_TO_SKIP="1000 1001" if stack == "megatron-lm" else None)
        if code == 2 and stack == "modellink-2024":     # refused with a message, not run
            assert "has no --rotary-base" in err or "has no --mock-data" in err
            continue
        assert code == 0, err
        flags = [a for a in argv if a.startswith("--")]
        assert len(flags) > 40
        unknown = sorted(set(flags) - set(vendored["stacks"][stack]["options"]))
        assert not unknown, (stack, unknown)
        checked += 1
        if stack == "mindspeed-llm":
            for f in ("--use-mcore-models", "--check-for-spiky-loss", "--ckpt-format"):
                assert f in flags
            assert ("--attention-softmax-in-fp32" in flags) == (device == "npu")
            assert "--iterations-to-skip" not in flags      # the probe skips on MindSpeed-LLM
            assert argv[argv.index("--transformer-impl") + 1] == "local"
    assert checked >= 2


def test_no_machine_local_path_and_a_clear_error_without_adamspike_home(tmp_path):
    out = tmp_path / "h"
    assert launch_main(["--config", str(BASE), "--cluster", str(_cluster(tmp_path)),
                        "--master-addr", "n0", "--out", str(out)]) == 0
    for name in ("train_mindspeed.sh", "train_torchrun.sh"):
        assert str(REPO_ROOT) not in (out / name).read_text()
    code, _, err = _run_script(out / "train_mindspeed.sh", tmp_path, ADAMSPIKE_HOME=None)
    assert code != 0 and "set ADAMSPIKE_HOME to the adamspike checkout" in err
    code, _, err = _run_script(out / "train_mindspeed.sh", tmp_path, ADAMSPIKE_HOME=str(tmp_path))
    assert code == 2 and "has no fullscale/megatron_probe.py" in err
    code, argv, _ = _run_script(out / "train_mindspeed.sh", tmp_path, ADAMSPIKE_HOME=None,
                                ADAMSPIKE_PROBE="0")       # without the probe it is not needed
    assert code == 0 and "--use-mcore-models" in argv
    r = subprocess.run(["bash", str(out / "train_torchrun.sh"), "0"], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and "set ADAMSPIKE_HOME" in r.stderr


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
        assert f["--model"] == "llama2-70b"
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


def _checkout(tmp_path, tree, core):
    d = tmp_path / f"checkout-{tree}-{core}"
    (d / tree).mkdir(parents=True)
    (d / "megatron" / "core").mkdir(parents=True)
    major, minor, patch = core.split(".")
    (d / "megatron" / "core" / "package_info.py").write_text(
        f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\n")
    return d


@pytest.mark.parametrize("tree, core, cann, stack", [
    ("mindspeed_llm", "0.12.1", "8.3.RC1", "mindspeed-llm"),     # current MindSpeed-LLM
    ("modellink", "0.4.0", "7.0.1", "modellink-2024"),           # the seed's stack
])
def test_the_script_detects_its_stack_on_the_node(tmp_path, tree, core, cann, stack):
    """MEGATRON_STACK unset: python -m fullscale.stack reads the checkout and CANN, the flags
    follow; each detected stack's flags are in its vendored option list."""
    out = tmp_path / "d"
    assert launch_main(["--config", str(BASE), "--cluster", str(_cluster(tmp_path)),
                        "--master-addr", "n0", "--out", str(out), "--data.source", "indexed",
                        "--data.path", "/data/x"]) == 0
    code, argv, err = _run_script(out / "train_mindspeed.sh", tmp_path, MEGATRON_STACK=None,
                                  MINDSPEED_LLM_DIR=str(_checkout(tmp_path, tree, core)),
                                  ADAMSPIKE_CANN_VERSION=cann)
    assert code == 0, err
    vendored = json.loads(OPTIONS_FILE.read_text())["stacks"][stack]["options"]
    flags = [a for a in argv if a.startswith("--")]
    assert not sorted(set(flags) - set(vendored))
    assert ("--accumulate-allreduce-grads-in-fp32" in flags) == (stack == "modellink-2024")
    assert ("--rerun-mode" in flags) == (stack != "modellink-2024")


def test_the_script_refuses_a_stack_it_does_not_know(tmp_path):
    out = tmp_path / "r"
    assert launch_main(["--config", str(BASE), "--cluster", str(_cluster(tmp_path)),
                        "--master-addr", "n0", "--out", str(out)]) == 0
    code, _, err = _run_script(out / "train_mindspeed.sh", tmp_path, MEGATRON_STACK=None,
                               MINDSPEED_LLM_DIR=str(_checkout(tmp_path, "mindspeed_llm", "0.12.1")),
                               ADAMSPIKE_CANN_VERSION="7.0.1")
    assert code == 2 and "MindSpeed-LLM needs CANN 8 or newer" in err and "CANN 7.0.1" in err


def test_the_seeds_recompute_flags_on_modellink_2024(tmp_path):
    """The seed's AscendSpeed recompute flags (its own parser, AscendSpeed 64b1937a, vendored
    as `seed_reference`) are not ModelLink 0df09cd1's: auto_recompute_device_size maps onto
    --adaptive-recompute-device-size (+ ADAPTIVE_RECOMPUTING=1), which that stack parses;
    checkpoint_policy / checkpoint_block_layer change nothing in the seed's code and are not
    passed. Every flag the modellink-2024 script passes is in that stack's list."""
    vendored = json.loads(OPTIONS_FILE.read_text())
    seed = set(vendored["seed_reference"]["options"])
    ml = set(vendored["stacks"]["modellink-2024"]["options"])
    assert vendored["seed_reference"]["sources"][0]["commit"].startswith("64b1937a")
    for f in ("--auto-recompute-device-size", "--checkpoint-policy", "--checkpoint_block_layer"):
        assert f in seed and f not in ml
    for f in ("--accumulate-allreduce-grads-in-fp32", "--recompute-granularity"):
        assert f in seed and f in ml
    assert "--adaptive-recompute-device-size" in ml
    out = tmp_path / "l"
    assert launch_main(["--config", str(BASE), "--cluster", str(_cluster(tmp_path)),
                        "--master-addr", "n0", "--out", str(out)]) == 0
    script = out / "train_mindspeed.sh"
    assert "      export ADAPTIVE_RECOMPUTING=1" in script.read_text()
    code, argv, err = _run_script(script, tmp_path, MEGATRON_STACK="modellink-2024",
                                  AUTO_RECOMPUTE_DEVICE_SIZE="48000")
    assert code == 0, err
    flags = [a for a in argv if a.startswith("--")]
    assert not sorted(set(flags) - ml)
    assert argv[argv.index("--adaptive-recompute-device-size") + 1] == "48000"
    assert "--accumulate-allreduce-grads-in-fp32" in flags and "--attention-softmax-in-fp32" in flags
    assert not any(f.startswith("--recompute") for f in flags)
    code, argv, _ = _run_script(script, tmp_path, MEGATRON_STACK="modellink-2024")
    assert code == 0 and "--adaptive-recompute-device-size" not in argv      # not asked: off
    code, _, err = _run_script(script, tmp_path, MEGATRON_STACK="modellink-2024",
                               AUTO_RECOMPUTE_DEVICE_SIZE="lots")
    assert code == 2 and "must be a positive integer (MB)" in err
    # a layout with recompute: adaptive recompute refuses --recompute-granularity
    full = tmp_path / "full"
    assert launch_main(["--config", str(BASE), "--cluster", str(_cluster(tmp_path)),
                        "--master-addr", "n0", "--out", str(full), "--recompute", "full"]) == 0
    code, _, err = _run_script(full / "train_mindspeed.sh", tmp_path,
                               MEGATRON_STACK="modellink-2024", AUTO_RECOMPUTE_DEVICE_SIZE="48000")
    assert code == 2 and "adaptive recompute refuses the layout's --recompute-granularity" in err
