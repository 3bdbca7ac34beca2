"""The dependency direction of the packages (docs/design.md, "Layout and dependency
direction"), checked on the source with ast (nothing of the project is imported, except in
the one subprocess check of `import study.cli`):

- study/ (the top CLI and the study scheduler) sits above all others: no package below it
  (adamspike, theory, simulate, fullscale, analysis, figures) imports study, anywhere;

- theory/ imports nothing of ours; simulate/ never imports torch, fullscale/ or analysis/
  (the spike rule and the log parser it needs are in the floor); fullscale/ never imports
  jax / optax or simulate/; analysis/ and figures/ never import simulate/ or fullscale/,
  and analysis/ never imports figures/ (every import, module-top and local);
  the modules of adamspike/ (the floor) import no simulate/ fullscale/ analysis/ figures/
  at module top, and no jax / optax / torch at all;
- no import cycle among the module-top imports of project modules;
- an import inside a function is of an optional heavy dependency (LAZY_OK) or says why on
  its line, on the line above it, or on the line above / the first line of the run of
  consecutive imports it belongs to.

Every failure names file:line.
"""

from __future__ import annotations

import ast
import functools
import io
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = "study"                            # the CLI and the scheduler: imports anything
BELOW = ("adamspike", "theory", "simulate", "fullscale", "analysis", "figures")
PACKAGES = BELOW + (TOP,)
SCANNED = PACKAGES + ("bench",)          # bench/: scripts, checked for (c) only

# optional heavy dependencies that a function may import without a comment
LAZY_OK = {"jax", "jaxlib", "optax", "torch", "torch_npu", "matplotlib",
           "megatron", "mindspeed", "modellink", "ascendspeed", "ray"}

# package -> top-level names it must never import (module top or local)
FORBIDDEN = {
    "adamspike": {TOP},
    "theory": set(PACKAGES),
    "simulate": {"torch", "torch_npu", "fullscale", "analysis", TOP},
    "fullscale": {"jax", "jaxlib", "optax", "simulate", TOP},
    "analysis": {"simulate", "fullscale", "figures", TOP},
    "figures": {"simulate", "fullscale", TOP},
}
FOUNDATION_TOP_FORBIDDEN = {"simulate", "fullscale", "analysis", "figures"}
FOUNDATION_NEVER = {"jax", "jaxlib", "optax", "torch", "torch_npu"}

# Known departures from the rules above, each with the reason it is still there. An entry
# that no longer matches an import fails too (delete it once the import is gone).
KNOWN = {
    ("figures/fig_r_hist_bimodal.py", "simulate.streams"):
        "theory figure with JAX Monte-Carlo points computed on the fly (local import)",
    ("figures/fig_rms_t_transient.py", "simulate.streams"):
        "theory figure with JAX Monte-Carlo points computed on the fly (local import)",
    ("figures/fig_update_rms_vs_rho.py", "simulate.streams"):
        "theory figure with JAX Monte-Carlo points computed on the fly (local import)",
}


@dataclass(frozen=True)
class Imp:
    file: str          # path relative to ROOT
    line: int
    module: str        # the importing module, dotted
    target: str        # absolute dotted name imported (a submodule when `from pkg import mod`)
    local: bool        # inside a function (or lambda)
    guarded: bool      # under `if TYPE_CHECKING:` (never executed)
    commented: bool    # (c): a comment says why (see the module docstring)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def root(self) -> str:
        return self.target.split(".")[0]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_project_module(dotted: str) -> bool:
    p = ROOT.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _comment_lines(src: str) -> set[int]:
    out = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            out.add(tok.start[0])
    return out


def _targets(node, path: Path, module: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:                                   # relative import
        pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        pkg = pkg[:len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([base] if base else []))
    out = []
    for a in node.names:                             # `from pkg import mod` imports pkg.mod
        sub = f"{base}.{a.name}"
        out.append(sub if a.name != "*" and _is_project_module(sub) else base)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _scan(path: Path) -> list[Imp]:
    src = path.read_text()
    tree = ast.parse(src, str(path))
    comments = _comment_lines(src)
    rel, module = path.relative_to(ROOT).as_posix(), _module_name(path)
    out: list[Imp] = []

    def body_imports(stmts, local: bool, guarded: bool):
        prev_end, block_first = None, None       # runs of consecutive import statements
        for st in stmts:
            if isinstance(st, (ast.Import, ast.ImportFrom)):
                if prev_end is None or st.lineno != prev_end + 1:
                    block_first = st.lineno
                own = any(ln in comments for ln in range(st.lineno, st.end_lineno + 1))
                commented = own or (st.lineno - 1) in comments or \
                    (block_first - 1) in comments or block_first in comments
                for t in _targets(st, path, module):
                    out.append(Imp(rel, st.lineno, module, t, local, guarded, commented))
                prev_end = st.end_lineno
            else:
                prev_end = None
            visit(st, local, guarded)

    def visit(node, local: bool, guarded: bool):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list + node.args.defaults + node.args.kw_defaults:
                if d is not None:
                    visit(d, local, guarded)
            body_imports(node.body, True, guarded)
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            body_imports(node.body, local, True)
            body_imports(node.orelse, local, guarded)
            return
        for name in ("body", "orelse", "finalbody"):     # if / for / while / with / try / class
            stmts = getattr(node, name, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                body_imports(stmts, local, guarded)
        for h in getattr(node, "handlers", []):
            body_imports(h.body, local, guarded)
        for c in getattr(node, "cases", []):        # match statements
            body_imports(c.body, local, guarded)

    body_imports(tree.body, False, False)
    return out


@functools.lru_cache(maxsize=None)
def all_imports() -> tuple[Imp, ...]:
    out: list[Imp] = []
    for pkg in SCANNED:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            out += _scan(path)
    return tuple(out)


def _package(imp: Imp) -> str:
    return imp.module.split(".")[0]


def test_scanner_sees_the_packages():
    imps = all_imports()
    files = {i.file.split("/")[0] for i in imps}
    assert set(PACKAGES) <= files, files
    # a known module-top import and a known local import are both found
    assert any(i.file == "adamspike/train_config.py" and i.target == "adamspike.config"
               and not i.local for i in imps)
    assert any(i.file == "study/cli.py" and i.target == "simulate.sweep" and i.local
               for i in imps)


def test_dependency_direction():
    bad, seen = [], set()
    for i in all_imports():
        pkg = _package(i)
        if pkg not in PACKAGES:
            continue
        why = None
        if i.root in FORBIDDEN.get(pkg, ()) and i.root != pkg:
            why = f"{pkg}/ must not import {i.root}"
        elif pkg == "adamspike":
            if i.root in FOUNDATION_NEVER:
                why = f"foundation module {i.module} must not import {i.root}"
            elif i.root in FOUNDATION_TOP_FORBIDDEN and not i.local and not i.guarded:
                why = f"foundation module {i.module} must not import {i.root} at module top"
        if why is None:
            continue
        key = (i.file, i.target)
        if key in KNOWN:
            seen.add(key)
            continue
        bad.append(f"{i.where}: imports {i.target} ({why})")
    stale = [f"{f}: {t}" for f, t in KNOWN if (f, t) not in seen]
    assert not bad, "upward / sideways imports:\n" + "\n".join(sorted(set(bad)))
    assert not stale, "KNOWN entries without a matching import (remove them):\n" + "\n".join(stale)


def test_nothing_below_imports_the_top_package():
    """study/ (CLI, scheduler) is the top: no module below it imports study, neither by an
    import statement nor by name (importlib / `python -m study`)."""
    bad = [f"{i.where}: imports {i.target}" for i in all_imports()
           if _package(i) in BELOW and i.root == TOP]
    for pkg in BELOW:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if any(s in line for s in ('import_module("study', "import_module('study",
                                           '"-m", "study"', "'-m', 'study'")):
                    bad.append(f"{path.relative_to(ROOT).as_posix()}:{n}: {line.strip()}")
    assert not bad, "below the top package, imports of study:\n" + "\n".join(bad)


def _sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    out.append(sorted(comp))
    return out


def test_sccs_finds_a_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert sorted(map(tuple, _sccs(g))) == [("a", "b", "c"), ("d",), ("e",)]


def test_no_import_cycle_at_module_top():
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for i in all_imports():
        if _package(i) not in PACKAGES or i.local or i.guarded:
            continue
        graph.setdefault(i.module, set())
        if i.root in PACKAGES and i.target != i.module:
            graph[i.module].add(i.target)
            graph.setdefault(i.target, set())
            where.setdefault((i.module, i.target), i.where)
    cycles = [c for c in _sccs(graph) if len(c) > 1]
    msg = []
    for comp in cycles:
        edges = [f"  {where[(a, b)]}: {a} -> {b}" for a in comp for b in sorted(graph[a])
                 if b in comp]
        msg.append(f"cycle among {', '.join(comp)}:\n" + "\n".join(edges))
    assert not cycles, "\n".join(msg)


def test_function_level_imports_say_why():
    bad = sorted({(i.file, i.line, i.target) for i in all_imports()
                  if i.local and not i.commented and i.root not in LAZY_OK})
    assert not bad, ("imports inside functions without a comment saying why (move them to "
                     "the module top, or say why they are lazy):\n"
                     + "\n".join(f"{f}:{n}: {t}" for f, n, t in bad))


def _imported_by(code: str) -> list[str]:
    """Top-level names in sys.modules after running `code` in a fresh interpreter."""
    code += "\nimport sys\nprint(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()


def test_top_cli_imports_no_framework():
    """`adamspike --help` stays fast: importing the entry point loads no framework, no
    pandas / matplotlib / scipy and no other package of ours (subcommands are imported when
    called)."""
    heavy = {"jax", "optax", "torch", "pandas", "matplotlib", "scipy", "theory", "simulate",
             "fullscale", "analysis", "figures"}
    loaded = heavy & set(_imported_by("import study.cli"))
    assert not loaded, f"import study.cli loaded {sorted(loaded)}"


def test_light_paths_import_no_framework():
    """What .ci/compat.sh's py310 job imports without torch / jax (config, model info,
    launch / plan, analyze, figures CLI) stays free of both."""
    code = ("import adamspike.config, adamspike.train_config, adamspike.predictions, "
            "adamspike.llama, theory.cli, analysis.cli, figures.cli, fullscale.model_info, "
            "fullscale.launch, fullscale.hf, fullscale.cli")
    loaded = {"jax", "optax", "torch"} & set(_imported_by(code))
    assert not loaded, f"the torch/jax-free modules loaded {sorted(loaded)}"


def test_megatron_probe_needs_torch_and_numpy_only():
    """The py38 + torch 2.1 node (.ci/compat.sh py38): the probe imports with pandas,
    pyarrow, scipy, jax, tqdm and matplotlib missing (the plain run-directory writer)."""
    missing = ("pandas", "pyarrow", "scipy", "jax", "optax", "tqdm", "matplotlib")
    code = ("import sys\n"
            + "".join(f"sys.modules[{m!r}] = None\n" for m in missing)   # import -> ImportError
            + "import adamspike.metrics, fullscale.megatron_probe")
    _imported_by(code)


def test_figures_import_no_analysis_and_no_cli_cycle():
    """Figures read the files `adamspike analyze` wrote (spike detection and fits run once):
    no figures/*.py imports analysis; the figure scripts share figures._common, not
    figures.cli (which loads them by name)."""
    import ast
    root = Path(__file__).resolve().parents[2] / "figures"
    for p in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for m in mods:
                assert m.split(".")[0] != "analysis", f"{p.name} imports {m}"
                if p.name.startswith("fig_"):
                    assert m != "figures.cli", f"{p.name} imports figures.cli"
