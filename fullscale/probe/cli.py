"""`python -m fullscale.megatron_probe [--out RUN ...] -- SCRIPT ARGS`: install, then run SCRIPT."""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import sys
from typing import List, Optional

from fullscale.probe.settings import ENV_PREFIX, ProbeError, env_skip_iterations
from fullscale.probe.wrapper import install


def _adaptors(choice: str) -> List[str]:
    """The imports that apply a framework's patches, in the order its pretrain_gpt.py does
    them: MindSpeed-LLM `from mindspeed_llm import megatron_adaptor`; ModelLink of early
    2024 `from ascendspeed import megatron_adaptor` then `import modellink`."""
    def have(pkg):
        try:
            return importlib.util.find_spec(pkg) is not None
        except (ImportError, ValueError):
            return False

    if choice == "none":
        return []
    if choice != "auto":
        return [choice]
    if have("mindspeed_llm"):
        return ["mindspeed_llm:megatron_adaptor"]
    if have("modellink"):
        return (["ascendspeed:megatron_adaptor"] if have("ascendspeed") else []) + ["modellink"]
    return []


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m fullscale.megatron_probe",
        usage="%(prog)s [--out RUN] [--every K] [--hist-every H] [--secant 0|1] "
              "[--adaptor MODULE|none] -- SCRIPT.py ARGS...",
        description="Install the adamspike probe (per-tensor Adam telemetry, spike rules, "
                    "skip-step, restart recipe) around Megatron's train_step, then run SCRIPT "
                    "as __main__ with ARGS. Settings not given here come from the "
                    f"{ENV_PREFIX}* variables (docs/mindspeed_probe.md).")
    ap.add_argument("--out", default=os.environ.get(ENV_PREFIX + "OUT"),
                    help=f"the run directory (default: {ENV_PREFIX}OUT)")
    ap.add_argument("--every", type=int, help=f"telemetry every K steps (default: {ENV_PREFIX}EVERY, else 10)")
    ap.add_argument("--hist-every", type=int,
                    help=f"histograms every H steps, 0 = never (default: {ENV_PREFIX}HIST_EVERY, else 100)")
    ap.add_argument("--precision", choices=("float32", "float64"), default="float32",
                    help="elementwise dtype of the sums (npu: float32 always)")
    ap.add_argument("--secant", type=int, choices=(0, 1),
                    help=f"the online curvature proxy (default: {ENV_PREFIX}SECANT, else 1)")
    ap.add_argument("--adaptor", default="auto",
                    help="PKG[:NAME] whose import applies the framework's patches before the "
                         "probe is installed (auto: mindspeed_llm:megatron_adaptor, or "
                         "ascendspeed:megatron_adaptor + modellink, if importable; none: plain "
                         "Megatron-LM)")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m fullscale.megatron_probe [--out RUN ...] [--adaptor MOD] -- SCRIPT ARGS`:
    install the probe, then run SCRIPT as __main__ with ARGS (Megatron parses sys.argv)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:   # a launcher that swallowed the "--": cut before the script
        cut = next((i for i, x in enumerate(argv) if x.endswith(".py")), None)
        if cut is not None:
            argv.insert(cut, "--")
    if "--" not in argv and ("-h" in argv or "--help" in argv):
        _parser().print_help()
        return 0
    if "--" not in argv:
        print("usage: python -m fullscale.megatron_probe [--out RUN] [--every K] "
              "[--hist-every H] [--secant 0|1] [--adaptor MODULE|none] -- SCRIPT.py ARGS...",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = _parser()
    a = ap.parse_args(argv[:cut])
    rest = argv[cut + 1:]
    if not rest:
        print("megatron_probe: no training script after --", file=sys.stderr)
        return 2
    if not a.out:
        print(f"megatron_probe: --out (or {ENV_PREFIX}OUT) is required", file=sys.stderr)
        return 2
    script = rest[0]
    if not os.path.isfile(script):
        print(f"megatron_probe: {script}: no such training script", file=sys.stderr)
        return 2
    sys.argv = rest      # the adaptor and the script parse Megatron's arguments
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    for name in _adaptors(a.adaptor):
        pkg, _, attr = name.partition(":")
        mod = importlib.import_module(pkg)        # `from pkg import attr`
        if attr and not hasattr(mod, attr):
            importlib.import_module(f"{pkg}.{attr}")
    try:
        skip = env_skip_iterations()
    except ProbeError as e:   # the listed batches would be trained: refuse instead
        print(f"megatron_probe: {e}", file=sys.stderr)
        return 2
    try:
        install(a.out, every=a.every, hist_every=a.hist_every, precision=a.precision,
                secant=None if a.secant is None else bool(a.secant))
    except ProbeError as e:   # fail open: the job runs without the probe ...
        if skip:              # ... but not with batches it was told to skip
            print(f"megatron_probe: {e}; {ENV_PREFIX}SKIP_ITERATIONS needs the probe installed "
                  "(fix the setting, or remove the list)", file=sys.stderr)
            return 2
        print(f"adamspike probe: not installed ({e}); training runs without it", flush=True)
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
