"""`adamspike` entry point: one subcommand per job, each implemented in its own package.

Subcommands are imported lazily so that `adamspike theory` never loads torch or jax. A
subcommand whose module is not built yet says so and exits with status 3.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> ("module:function", one-line help). Each function takes argv and returns
# an exit status.
COMMANDS: dict[str, tuple[str, str]] = {
    "theory": ("theory.cli:main", "closed-form numbers (--json for machines)"),
    "simulate": ("simulate.cli:simulate_main", "Monte-Carlo streams, quadratic, MLP, toy LLaMA runs"),
    "sweep": ("simulate.sweep:main", "eps x b2 x batch x lr x seed sweeps (resumable, --shard k/n)"),
    "predict": ("simulate.predict:main", "predictions.json from theory + sweep results"),
    "train": ("fullscale.train:main", "fullscale LLaMA2 training (run under torchrun)"),
    "launch": ("fullscale.launch:launch_main", "write per-node torchrun / MindSpeed scripts"),
    "plan": ("fullscale.launch:plan_main", "one run config + launch script per predicted setting"),
    "model": ("fullscale.cli:model_main", "`model info`: parameters, FLOPs/token, memory per card"),
    "data": ("fullscale.cli:data_main", "inspect / convert Megatron indexed data"),
    "analyze": ("analysis.cli:main", "spikes, precursors, alarm scores, theory fits, report"),
    "figures": ("figures.cli:main", "regenerate every figure"),
    "reproduce": ("adamspike.reproduce:main", "the whole study at CPU scale (--quick for CI)"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: adamspike <command> [args]   (adamspike <command> --help)", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def resolve(name: str):
    """The function implementing subcommand `name`, or None if its module is not built."""
    target, _ = COMMANDS[name]
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Only "this module does not exist" means not built; a missing dependency inside
        # it is a real error and propagates.
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            return None
        raise
    return getattr(module, func_name, None)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from adamspike import __version__
        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"adamspike: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    func = resolve(name)
    if func is None:
        print(f"adamspike {name}: not built yet ({COMMANDS[name][0]} is missing)", file=sys.stderr)
        return 3
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
