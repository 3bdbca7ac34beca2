"""`adamspike` entry point (the top package: nothing below imports it): one subcommand per
job, each implemented in its own package. `python -m study` runs it too.

Subcommands are imported when called (importlib, by the module path in COMMANDS), so that
`adamspike theory` never loads torch or jax.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.metadata
import sys

from adamspike import __version__

# subcommand -> ("module:function", one-line help). Each function takes argv and returns
# an exit status.
COMMANDS: dict[str, tuple[str, str]] = {
    "theory": ("theory.cli:main", "closed-form numbers (--json for machines)"),
    "simulate": ("simulate.cli:simulate_main", "Monte-Carlo streams, quadratic, MLP, toy LLaMA runs"),
    "sweep": ("study.cli:sweep_main", "grids over dotted config keys (resumable, --shard k/n)"),
    "replicate": ("study.cli:replicate_main", "test the literature's claims (toy problems; `replicate matched`: the 70B's regime)"),
    "replay": ("study.cli:replay_main", "causal replay of spikes with one intervention each (resumable)"),
    "phase-map": ("study.cli:phase_map_main", "spikes in the 70B's rho band: Pi x b2 x batch cells (resumable)"),
    "spike-rate": ("analysis.spike_rate:main", "fit + validate the spike-rate GLM on sweeps and runs"),
    "predict": ("simulate.predict:main", "pre-registered predictions.json: GLM spike rate per setting"),
    "package-data": ("study.cli:package_data_main", "the shipped ladder fit + spike-rate model (check; --from STUDY_DIR refreshes)"),
    "train": ("fullscale.train:main", "fullscale LLaMA2 training (run under torchrun)"),
    "launch": ("fullscale.launch:launch_main", "write per-node torchrun / MindSpeed scripts"),
    "plan": ("fullscale.launch:plan_main", "one run config + launch script per predicted setting"),
    "model": ("fullscale.cli:model_main", "`model info`: parameters, FLOPs/token, memory per card"),
    "data": ("fullscale.cli:data_main", "inspect / convert Megatron indexed data"),
    "analyze": ("study.cli:analyze_main", "spikes, precursors, alarm scores, theory fits, report (figures inline)"),
    "megatron-log": ("analysis.megatron_log:export_main", "a run directory's steps as a Megatron training log"),
    "assess": ("analysis.assess:main", "one screen on a run or log: regime, spikes, numerics, predicted rate, what to change"),
    "watch": ("analysis.watch:main", "follow a live log or run directory: one line (and --on-event hook) per spike / numerics event"),
    "figures": ("figures.cli:main", "regenerate every figure"),
    "science4": ("study.science4:main", "the 70B answer under the written plan: sharpness QC, spikes vs noise nulls, the public record"),
    "reproduce": ("study.reproduce:main", "the whole study at CPU scale (--quick for CI)"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: adamspike <command> [args]   (adamspike <command> --help)", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def resolve(name: str):
    """The function implementing subcommand `name`."""
    module_name, func_name = COMMANDS[name][0].split(":")
    return getattr(importlib.import_module(module_name), func_name)


def analyze_main(argv: list[str]) -> int:
    """`adamspike analyze` (analysis.cli) with the run figures drawn into each run's report
    (figures.cli.draw_run_figures): wired here, analysis does not import figures."""
    from analysis.cli import main as analyze      # lazy: pandas / scipy for this command

    def draw(runs, names, out):
        from figures.cli import draw_run_figures   # lazy: matplotlib only when drawing
        return draw_run_figures(runs, names, out)

    return analyze(argv, draw=draw)


def sweep_main(argv: list[str]) -> int:
    """`adamspike sweep run|merge` over simulate.sweep_problems.PROBLEMS;
    `adamspike sweep replicate` is `adamspike replicate`."""
    if argv and argv[0] == "replicate":
        return replicate_main(argv[1:])
    # lazy: the sweep problems import jax, only this subcommand needs it
    from simulate.sweep import main as sweep
    from simulate.sweep_problems import PROBLEMS
    return sweep(argv, PROBLEMS)


def replicate_main(argv: list[str]) -> int:
    """`adamspike replicate --out DIR [--claims FILE]`: a claims study (adamspike.claims):
    arms run by simulate.claims, verdicts and report by analysis.claims from their files;
    `adamspike replicate matched --ladder L ...` is `--claims configs/claims_matched.toml`."""
    matched = bool(argv) and argv[0] == "matched"
    ap = argparse.ArgumentParser(prog="adamspike replicate" + " matched" * matched,
                                 description="test the literature's claims: paired seeds per arm")
    ap.add_argument("--out", required=True, help="study directory (resumes at the first missing arm)")
    ap.add_argument("--claims", default=f"configs/claims{'_matched' * matched}.toml",
                    help="claims TOML (docs/design.md, 'Claims: one system')")
    ap.add_argument("--ladder", required=matched, help="ladder directory (fit.json: the 70B's rho per group)")
    ap.add_argument("--only", action="append", default=None, metavar="ID",
                    help="run only this claim (repeatable; the others are listed as not run)")
    ap.add_argument("--set", action="append", default=[], metavar="base.NAME.KEY=VALUE",
                    help="replace one value of a base (a TOML value; repeatable): the study's "
                         "size table gives smaller arms this way, e.g. "
                         "--set base.matched.overrides.train.num_steps=40")
    ap.add_argument("--seeds", type=int, default=None, help="paired seeds per arm (default: the file's; >= 10 for the tests)")
    ap.add_argument("--skip-llama", action="store_true", help="leave out the tiny-LLaMA toy rows (their note says so)")
    ap.add_argument("--cells-from", action="append", default=[], metavar="STORE",
                    help="a cell store to copy finished calibrations and arms from instead of "
                         "running them (read only; repeatable): the standard study gives the "
                         "cells shipped with the package")
    ap.add_argument("--no-progress", action="store_true")
    try:
        a = ap.parse_args(argv[matched:])
    except SystemExit as e:
        return 0 if e.code == 0 else 2
    if a.seeds is not None and a.seeds < 2:
        print("adamspike replicate: --seeds must be >= 2 (>= 10 for the paired tests)", file=sys.stderr)
        return 2
    # lazy: jax (arms) and pandas / scipy (table), only for this subcommand
    from pathlib import Path
    from adamspike.claims import REPO, read_study
    from adamspike.config import ConfigError
    from adamspike.rundir import atomic_write_bytes
    from analysis.claims import report_md
    from simulate.claims import run_study
    try:
        path = Path(a.claims) if Path(a.claims).exists() else REPO / a.claims
        out = run_study(read_study(path, a.set), a.out, only=a.only, num_seeds=a.seeds, ladder=a.ladder,
                        skip_llama=a.skip_llama, progress=not a.no_progress,
                        cells_from=a.cells_from)
        md, table = report_md(out)
    except (ConfigError, ValueError) as e:
        print(f"adamspike replicate: {e}", file=sys.stderr)
        return 2
    atomic_write_bytes(out / "replication.csv", table.to_csv(index=False).encode())
    atomic_write_bytes(out / "replication.md", md.encode())
    print(table[["id", "effect", "ci_low", "ci_high", "p_holm", "verdict"]].to_string(index=False))
    return 0


def package_data_main(argv: list[str]) -> int:
    """`adamspike package-data`: adamspike.package_data with simulate.predict as its
    predictor (the floor cannot import simulate; a refresh rewrites predictions.json)."""
    from adamspike import package_data   # lazy like every subcommand (hashlib, shutil)

    def predict(args: list[str]) -> int:
        from simulate.predict import main   # jax: only when --from refreshes the fit
        return main(args)

    return package_data.main(argv, predict=predict)


def phase_map_main(argv: list[str]) -> int:
    """`adamspike phase-map --out DIR [--config FILE] [--ladder L] [--set map.KEY=VALUE ...]`:
    the cells (simulate.phase_map, one cell store), the stability tracker's check, then the
    tables and report (analysis.phase_map, from the files)."""
    ap = argparse.ArgumentParser(prog="adamspike phase-map",
                                 description="phase map of spikes in the 70B's rho band")
    ap.add_argument("--out", required=True, help="map directory (resumes at the first missing cell)")
    ap.add_argument("--config", default="configs/phase_map.toml", help="map TOML")
    ap.add_argument("--ladder", help="ladder directory (fit.json: the 70B's rho per group); "
                                     "default: the file's [targets]")
    ap.add_argument("--set", action="append", default=[], metavar="map.KEY=VALUE",
                    help="replace one [map] value (a TOML value; repeatable): the study's size "
                         "table gives a smaller map this way, e.g. --set map.seeds=4")
    ap.add_argument("--no-check", action="store_true",
                    help="skip the tracker-vs-power-iteration check (the file's [map] check)")
    ap.add_argument("--no-progress", action="store_true")
    try:
        a = ap.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code == 0 else 2
    # lazy: jax (cells) and scipy / pandas (report), only for this subcommand
    from pathlib import Path
    from adamspike.claims import REPO
    from adamspike.config import ConfigError
    from analysis.phase_map import write_report
    from simulate import phase_map
    try:
        path = Path(a.config) if Path(a.config).exists() else REPO / a.config
        spec = phase_map.read_map(path, a.set)
        out = phase_map.run_map(spec, a.out, ladder=a.ladder, progress=not a.no_progress)
        if not a.no_check and not (out / "stability_check.csv").exists():
            phase_map.check_stability(spec, out, progress=not a.no_progress)
        write_report(out)
    except (ConfigError, ValueError) as e:
        print(f"adamspike phase-map: {e}", file=sys.stderr)
        return 2
    print((out / "phase_map.md").read_text())
    return 0


TORCH_REPLAY_SEEDS = 4   # torch base runs searched for spikes (bounds the study's cost)


def replay_main(argv: list[str]) -> int:
    """`adamspike replay`: the JAX study (simulate.replay) and, with --torch-spikes, its torch
    subset (fullscale.replay: spikes of the first TORCH_REPLAY_SEEDS seeds' torch runs), wired here (simulate never imports torch, fullscale never
    imports jax)."""
    from simulate import replay   # jax: only for this subcommand

    def torch_replay(spec, out, num_spikes, progress):
        from fullscale.replay import torch_replays   # torch: only with --torch-spikes
        found = torch_replays(
            spec.run_config(), out, num_spikes, spec.seeds[:TORCH_REPLAY_SEEDS],
            lambda loss, steps: spec.incidents(spec.detect(loss, steps)),
            lambda name, cfg, t, restart: replay.intervention_overrides(
                name, cfg, t, restart, spec.skip_window),
            spec.interventions, snapshot_every=spec.snapshot_every, min_lead=spec.min_lead,
            max_lead=spec.max_lead, horizon=spec.horizon, progress=progress)
        return replay.torch_rows(spec, found)

    return replay.main(argv, torch_replay=torch_replay)


# The install extra (pyproject.toml, README "Install") each command's heavy imports come
# from: a command whose extra is missing says which to install, in one line, exit 2.
EXTRA_OF_MODULE = {"torch": "cluster", "jax": "study", "jaxlib": "study", "optax": "study"}
TRAINER_TORCH = (2, 6)


def missing_extra(name: str, module: str | None) -> str | None:
    """The one-line message for subcommand `name` when `module` cannot be imported, or None
    when `module` is not one an install extra provides."""
    top = (module or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    if name == "train" and top == "torch":
        extra = "trainer"
    return (f"adamspike {name}: needs {top}, which is not installed here: "
            f"pip install -e '.[{extra}]' (README, Install)")


def _old_torch_for_trainer() -> str | None:
    """`adamspike train` on a torch older than the trainer extra's (e.g. the cluster's 2.1)."""
    try:
        v = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None        # not installed: the import error names the extra
    except Exception:  # noqa: BLE001 - no metadata: let the command decide
        return None
    try:
        major, minor = (int(x) for x in v.split("+")[0].split(".")[:2])
    except ValueError:
        return None
    if (major, minor) >= TRAINER_TORCH:
        return None
    return (f"adamspike train: needs torch >= {TRAINER_TORCH[0]}.{TRAINER_TORCH[1]} (found {v}): "
            "pip install -e '.[trainer]' (README, Install); on the torch 2.1 stack use "
            "train_mindspeed.sh (the Megatron probe)")


def _model_info_world_size(rest: list[str]) -> list[str]:
    """`model info --config RUN.toml` without --world-size: the world size the run config's
    batch implies (fullscale.model_info.default_world_size), not 1."""
    if not rest or rest[0] != "info" or any(a == "--world-size" or a.startswith("--world-size=")
                                            for a in rest):
        return rest
    from fullscale.model_info import default_world_size   # lazy: only for `model info`
    n = default_world_size(rest[1:])
    return rest if n is None else rest + ["--world-size", str(n)]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        print(f"adamspike: unknown command {name!r}"
              + (f" (did you mean `adamspike {close[0]}`?)" if close else "")
              + f"\n\n{_usage()}", file=sys.stderr)
        return 2
    if name == "train":
        msg = _old_torch_for_trainer()
        if msg:
            print(msg, file=sys.stderr)
            return 2
    try:
        if name == "model":
            rest = _model_info_world_size(rest)
        return int(resolve(name)(rest) or 0)
    except ModuleNotFoundError as e:
        msg = missing_extra(name, e.name)
        if msg is None:
            raise
        print(msg, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
