"""`adamspike reproduce`: the whole study at CPU scale, into one output folder.

The loop of DESIGN.md, stage by stage, each stage one `adamspike <command>` in its own
process (the JAX and torch halves never share an interpreter):

    theory -> Monte-Carlo check -> toy spike runs (quadratic, MLP, tiny LLaMA) -> sweeps
    -> replication table -> spike-rate GLM (sweeps + toy runs, held-out validated) ->
    predictions.json / predictions_70b.json (pre-registered) -> plan -> tiny torch run
    driven by the predictions -> figures -> analysis (+ the 70B predictions scored on the
    rho-matched toy and on its Megatron-format log) -> STUDY.md

The stages are data, configs/study.toml: one table per stage (its arguments, sizes,
dependencies, outputs), in plan order, at three scales (SCALES): the tables themselves are
`--full` (every measurement recomputed: hours on 2 cores, cached by cell and resumable); the
default, `standard`, merges in each stage's `standard` values (the multi-hour measurements
read from the fit shipped with the package, adamspike/data/llama2_70b, placeholder
{shipped}: the ladder's cells are refitted, the phase maps and the batch-sharpness stage are
left out or small); `--quick` (CI) merges in the `quick` values instead (smaller sizes; a few
stages left out). This module only fills in the paths and runs the plan.

Independent stages overlap (`--jobs`, default 2): a stage can start once the stages it
needs have succeeded and those it reads after have finished, and a free slot takes the
first such stage in plan order. Compiled JAX programs and exact theory tables are cached
in OUT/.cache. A stage whose command is not built yet is reported as missing, a stage that fails is
reported as failed (with the tail of its log) and the stages that need its output are
skipped; nothing is faked. Each stage's stdout/stderr go to OUT/logs/<stage>.log and a
finished stage leaves OUT/.stages/<stage>.json, so `--resume` continues an interrupted
study without redoing finished stages. An existing non-empty OUT without --resume is an
error: nothing already written is overwritten.

One writer per study folder: `reproduce` holds OUT/writer.lock (adamspike.rundir.RunLock:
flock, host and pid); a second one on a live folder is refused in one line. Each stage runs
in its own process group and dies with `reproduce`, with all it started (kill -9: a guard
leading the group gets PR_SET_PDEATHSIG on Linux and kills the group; SIGTERM / SIGINT stop
every stage's group, then `reproduce` itself). A stage killed
mid-way left partial outputs: its `fresh` paths (run stages: their run folder) are set
aside to OUT/.stale/ before it reruns. A stage mark holds its result's sha256; a torn or
altered one reruns its stage, with one line.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from adamspike import package_data
from adamspike.cells import cache_home
from adamspike.config import ConfigError, read_toml
from adamspike.rundir import OutputPathError, RunFormatError, RunLock, check_out
from adamspike.tables import fmt, md_table

REPO = Path(__file__).resolve().parent.parent
NOT_BUILT = 3


@dataclass
class Stage:
    name: str
    title: str
    argv: list[str]                  # arguments of `adamspike`
    needs: list[str] = field(default_factory=list)   # must have succeeded
    after: list[str] = field(default_factory=list)   # must have finished (any status)
    outputs: list[str] = field(default_factory=list)   # paths relative to OUT it must leave
    stdout_to: str | None = None     # file (relative to OUT) that receives stdout
    # outputs that a rerun must find absent (their command refuses to overwrite): an
    # interrupted attempt's leftovers are moved to OUT/.stale/, never deleted
    fresh: list[str] = field(default_factory=list)


STUDY = REPO / "configs" / "study.toml"
SCALES = ("quick", "standard", "full")    # full: the tables as written; else their overlay
OVERLAYS = ("quick", "standard")
STAGE_KEYS = {"title", "args", "sizes", "run", "needs", "after", "outputs", "stdout_to", "fresh",
              *OVERLAYS}
OVERLAY_KEYS = STAGE_KEYS - set(OVERLAYS) | {"skip"}
_PLACEHOLDER = re.compile(r"\{([^{}]+)\}")


def _size_flags(sizes: dict) -> list[str]:
    """`key = value` -> `--key value`; true: `--key` alone; false: left out; a list:
    `--key item` per item (`set = ["fixed.train.num_steps=3000", ...]`: each stage's
    explicit sizes, the modules' `--set`)."""
    out: list[str] = []
    for k, v in sizes.items():
        if v is True:
            out.append(f"--{k}")
        elif isinstance(v, list):
            out += [a for item in v for a in (f"--{k}", str(item))]
        elif v is not False:
            out += [f"--{k}", str(v)]
    return out


def _optim_of(path: str) -> list[str]:
    """--b2 / --eps of a config's [optim] (for a Megatron log, which does not state them)."""
    optim = read_toml(REPO / path).get("optim", {})
    return [a for k in ("b2", "eps") if k in optim for a in (f"--{k}", repr(float(optim[k])))]


def load_study(path: Path = STUDY, scale: str = "standard") -> dict[str, dict]:
    """The study's stage tables (configs/study.toml), in plan order, with the scale's overlay
    (`quick` or `standard`; none for `full`) merged in (`sizes` key by key, other keys
    replaced) and its skipped stages left out."""
    if scale not in SCALES:
        raise ConfigError(f"study scale {scale!r}: expected one of {', '.join(SCALES)}")
    tables = read_toml(path).get("stages")
    if not isinstance(tables, dict) or not tables:
        raise ConfigError(f"{path}: expected [stages.<name>] tables")
    plan: dict[str, dict] = {}
    for name, t in tables.items():
        unknown = sorted(set(t) - STAGE_KEYS)
        if unknown:
            raise ConfigError(f"stages.{name}: unknown key(s) {unknown} (known: {sorted(STAGE_KEYS)})")
        for o in OVERLAYS:
            unknown = sorted(set(t.get(o, {})) - OVERLAY_KEYS)
            if unknown:
                raise ConfigError(f"stages.{name}.{o}: unknown key(s) {unknown} "
                                  f"(known: {sorted(OVERLAY_KEYS)})")
        q = t.get(scale, {}) if scale in OVERLAYS else {}
        if q.get("skip"):
            continue
        st = {k: v for k, v in t.items() if k not in OVERLAYS}
        st.update({k: v for k, v in q.items() if k not in ("skip", "sizes")})
        st["sizes"] = {**t.get("sizes", {}), **q.get("sizes", {})}
        plan[name] = st
    known = set(tables)
    for name, st in plan.items():
        for key in ("needs", "after"):
            bad = sorted(set(st.get(key, [])) - known)
            if bad:
                raise ConfigError(f"stages.{name}.{key}: unknown stage(s) {bad}")
    return plan


def stages(out: Path, scale: str = "standard", jobs: int = 2, study: Path = STUDY) -> list[Stage]:
    """The study (configs/study.toml), in order, its placeholders filled in. Paths are inside
    `out`; jobs: processes of the figures and analysis stages (they run last, one after the
    other, beside nothing else)."""
    plan = load_study(study, scale)
    values = {"out": str(out), "repo": str(REPO), "jobs": str(jobs),
              "shipped": str(package_data.profile_dir("llama2-70b"))}

    def fill(text: str, sizes: dict) -> str:
        def one(m: re.Match) -> str:
            key = m.group(1)
            if key in values:
                return values[key]
            if key in sizes:
                return str(sizes[key])
            raise ConfigError(f"{study}: unknown placeholder {{{key}}} in {text!r}")
        return _PLACEHOLDER.sub(one, text)

    def expand(arg: str, sizes: dict) -> list[str]:
        if arg.startswith("{runs:") and arg.endswith("}"):
            names = arg[len("{runs:"):-1].split(",")
            unknown = [n for n in names if n in plan and "run" not in plan[n]]
            if unknown:
                raise ConfigError(f"{study}: {arg}: stage(s) {unknown} leave no run")
            return [str(out / plan[n]["run"]) for n in names if n in plan]
        if arg.startswith("{optim_of:") and arg.endswith("}"):
            return _optim_of(arg[len("{optim_of:"):-1])
        return [fill(arg, sizes)]

    result = []
    for name, st in plan.items():
        sizes = st["sizes"]
        outputs = list(st.get("outputs", []))
        fresh = list(st.get("fresh", []))
        if "run" in st:
            outputs.append(f"{st['run']}/run.json")
            # `simulate ... --out` and `train --out` refuse a non-empty folder: a run killed
            # mid-way is set aside before the stage reruns
            fresh += [] if st["run"] in fresh else [st["run"]]
        result.append(Stage(
            name, fill(st.get("title", name), sizes),
            [a for arg in st.get("args", []) for a in expand(arg, sizes)]
            + _size_flags({k: fill(v, sizes) if isinstance(v, str) else v
                           for k, v in sizes.items()}),
            # stages the scale leaves out are not waited for
            needs=[n for n in st.get("needs", []) if n in plan],
            after=[n for n in st.get("after", []) if n in plan],
            outputs=outputs, stdout_to=st.get("stdout_to"), fresh=fresh))
    return result


def _set_aside(st: Stage, out: Path) -> str | None:
    """Move what an unfinished earlier attempt of `st` left in its `fresh` paths to
    OUT/.stale/<stage>-<n>/ (kept for inspection), so the rerun starts from nothing.
    Returns the line that says so (None when nothing was left)."""
    left = [p for p in st.fresh if (out / p).exists()]
    if not left:
        return None
    n = 0
    while (out / ".stale" / f"{st.name}-{n}").exists():
        n += 1
    dest = out / ".stale" / f"{st.name}-{n}"
    for p in left:
        (dest / p).parent.mkdir(parents=True, exist_ok=True)
        (out / p).rename(dest / p)
    return (f"{st.name}: an interrupted attempt left {', '.join(left)}; moved to "
            f"{dest.relative_to(out)}/ and rerunning the stage")


# ----------------------------------------------------------------------------- stage processes
# Every stage is its own process group (a signal to reproduce stops the stage and whatever
# it started) and that whole group dies when reproduce dies (a kill -9 leaves no orphan
# running beside the next --resume). PR_SET_PDEATHSIG alone reaches only the process it is
# set in: the processes a stage starts (analyze's and figures' --jobs workers, fork pool
# workers that wait forever on a dead parent's queue) would live on with ppid 1. So each
# stage runs under a small guard, the group's leader: the kernel tells it (SIGHUP, its
# PDEATHSIG) that reproduce died and it SIGKILLs its group, the stage and all it started.
_LIVE: dict[int, subprocess.Popen] = {}
_LIVE_LOCK = threading.Lock()
_PR_SET_PDEATHSIG = 1
try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _PRCTL = None
_STAGE_ARGV = "ADAMSPIKE_STAGE_ARGV"     # the guarded stage's command (JSON), not in argv:
                                         # the guard's command line does not pose as the stage
_STAGE_GUARD = """
import json, os, signal, subprocess, sys
def gone(signum, frame):               # reproduce died: the stage's whole group goes
    os.killpg(0, signal.SIGKILL)
signal.signal(signal.SIGHUP, gone)
signal.signal(signal.SIGTERM, lambda s, f: None)   # sent to the group: the stage's to handle
if os.getppid() != int(sys.argv[1]):
    gone(0, None)
env = dict(os.environ)
cmd = json.loads(env.pop("%s"))
rc = subprocess.Popen(cmd, env=env).wait()
if rc < 0:                             # end as the stage ended: by its signal
    signal.signal(-rc, signal.SIG_DFL)
    os.kill(os.getpid(), -rc)
sys.exit(rc)
""" % _STAGE_ARGV


def _die_with_parent(parent: int, sig: int = signal.SIGKILL):
    """preexec_fn: `sig` to this process when `parent` (reproduce) dies, also if it died
    between the fork and this call. Only async-signal-safe work: prctl resolved above."""
    def set_up() -> None:
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
            if os.getppid() != parent:
                os._exit(137)
    return set_up


def _spawn(cmd: list[str], env: dict, **kw) -> int:
    """Run a stage's command under the guard, in its own process group; its exit status."""
    guard = [sys.executable, "-c", _STAGE_GUARD, str(os.getpid())]
    p = subprocess.Popen(guard, process_group=0, env={**env, _STAGE_ARGV: json.dumps(cmd)},
                         preexec_fn=_die_with_parent(os.getpid(), signal.SIGHUP), **kw)
    with _LIVE_LOCK:
        _LIVE[p.pid] = p
    try:
        return p.wait()
    finally:
        with _LIVE_LOCK:
            _LIVE.pop(p.pid, None)


def stop_stages(grace_s: float = 10.0) -> list[int]:
    """SIGTERM every running stage's process group, SIGKILL what is left after grace_s;
    returns the stopped pids."""
    with _LIVE_LOCK:
        live = list(_LIVE.values())
    for p in live:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)     # also what the stage started
        except ProcessLookupError:
            pass
    return [p.pid for p in live]


def _run_stage(st: Stage, out: Path, env: dict) -> dict:
    note = _set_aside(st, out)
    if note:
        tqdm.write(f"adamspike reproduce: {note}", file=sys.stderr)
    log = out / "logs" / f"{st.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "study", *st.argv]
    t0 = time.monotonic()
    with open(log, "w") as err:
        err.write((f"# {note}\n" if note else "") + "$ adamspike " + " ".join(st.argv) + "\n")
        err.flush()
        if st.stdout_to:
            dest = out / st.stdout_to
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(dest, "w") as fh:
                rc = _spawn(cmd, stdout=fh, stderr=err, env=env, cwd=REPO)
        else:
            rc = _spawn(cmd, stdout=err, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    seconds = time.monotonic() - t0
    missing_outputs = [p for p in st.outputs if not (out / p).exists()]
    if rc == NOT_BUILT:
        status = "missing"
    elif rc != 0:
        status = "failed"
    elif missing_outputs:
        status, rc = "failed", -1
    else:
        status = "ok"
    return {"name": st.name, "title": st.title, "status": status, "returncode": rc,
            "seconds": round(seconds, 2), "log": str(log.relative_to(out)),
            "missing_outputs": missing_outputs, "argv": st.argv}


def _tail(path: Path, num_lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return ""


def scale_note(plan: list[Stage], scale: str, study: Path = STUDY) -> str:
    """What the scale changed, for STUDY.md: the stages it left out and those that read the
    fit shipped with the package instead of measuring (their argv names its folder)."""
    if scale == "full":
        return ""
    shipped = str(package_data.profile_dir("llama2-70b"))
    names = {st.name for st in plan}
    left = [n for n in load_study(study, "full") if n not in names]
    reads = [st.name for st in plan if any(shipped in a for a in st.argv)]
    m = package_data.manifest("llama2-70b")
    lines = [f"Scale `{scale}` (`adamspike reproduce --full` recomputes everything: hours on 2 "
             "cores, cached by cell and resumable)."]
    if reads:
        lines.append(f"Read from the fit shipped with the package (`adamspike/data/llama2_70b`, "
                     f"version {m.get('version')} of {m.get('created')}): stage(s) "
                     f"{', '.join(f'`{n}`' for n in reads)}.")
    if left:
        lines.append(f"Left out at this scale: {', '.join(f'`{n}`' for n in left)}.")
    return " ".join(lines)


def write_study_report(out: Path, results: list[dict], scale: str = "standard",
                       note: str = "") -> Path:
    """STUDY.md: what ran, what it produced, where to look; failures with their log tail.
    `note`: scale_note's lines."""
    from analysis.report import rebase_links   # inlined reports keep their links valid
    flag = {"quick": " --quick", "full": " --full"}.get(scale, "")
    lines = [f"# adamspike study{'' if scale == 'full' else f' ({scale})'}", "",
             f"Generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by `adamspike reproduce"
             f"{flag}`." + (f" {note}" if note else ""), "", "## Stages", "",
             md_table(([r["title"], r["status"], str(r["seconds"]), f"`{r['log']}`"] for r in results),
                      headers=["stage", "status", "seconds", "output"], max_rows=None)]
    answer = answer_section(out)
    if answer:   # the answer first, then the stages that made it
        lines[4:4] = answer + [""]
    regime_map = out / "figures" / "study" / "regime_map.png"
    if regime_map.exists():   # every run and the 70B estimate in Adam's eps regimes
        lines += ["", "## Regime map", "", f"![regime map]({regime_map.relative_to(out)})",
                  "", "Per-run regime cards and the update_rms fit per regime band: the "
                  "analysis report below (Regime overview, Regime card)."]
    pm_fig = out / "figures" / "phase_map" / "phase_map.png"
    for name, title in (("science4", "Science 4: the 70B answer under a written plan"),
                        ("phase_map", "Phase map: spikes in the 70B's rho band"),
                        ("replication_phase", "Replication at the edge of stability in the 70B's rho band"),
                        ("replication_matched", "Replication table, matched regime"),
                        ("replication", "Replication table, toy regime (b2 0.999, eps 1e-8: "
                                        "2.5-3.5 decades of rho above the 70B; its own section)"),
                        ("analysis", "Analysis report"),
                        ("ladder", "Width/depth ladder and the LLaMA2-70B profile"),
                        ("batch_sharpness", "Sharpness against the evaluation batch"),
                        ("matched", "Rho-matched toy"), ("replay", "Causal replay of spikes")):
        for cand in (out / name / "replication.md", out / name / "report.md",
                     out / name / "replay.md", out / name / "phase_map.md",
                     out / name / "batch_sharpness.md", out / name / "science4.md"):
            if cand.exists():
                lines += ["", f"## {title}", "", rebase_links(cand.read_text().strip(), name)]
                if name == "phase_map" and pm_fig.exists():
                    lines += ["", f"![phase map]({pm_fig.relative_to(out)})"]
                break
    lines += spike_rate_section(out)
    figs = sorted((out / "figures").rglob("*.png")) if (out / "figures").exists() else []
    if figs:
        lines += ["", "## Figures", ""] + [f"- [{p.stem}]({p.relative_to(out)})" for p in figs]
    bad = [r for r in results if r["status"] != "ok"]
    if bad:
        lines += ["", "## Not done", ""]
        for r in bad:
            lines += [f"### {r['title']}: {r['status']}", "", "```", _tail(out / r["log"]), "```", ""]
    path = out / "STUDY.md"
    path.write_text("\n".join(lines) + "\n")
    return path


SEED_SETTING = "eps1e-05-b2_0.95-lr0.00015"   # the seed report's 70B (predictions_70b ids)


def answer_section(out: Path) -> list[str]:
    """STUDY.md's opening: the seed's 70B question answered from this study's files (the
    phase map, the claims at the edge of stability, the 70B predictions), each line with a
    link to its evidence; what a file does not hold is said, not guessed."""
    L = ["## The answer, in one minute", "",
         "The seed's LLaMA2-70B: AdamW eps 1e-5, b2 0.95, lr 1.5e-4, clip 1, 4M tokens per "
         "step; it spiked inside its first 1543 steps."]
    s4 = out / "science4" / "science4.json"
    if s4.exists():    # the plan-governed reading first: the older lines below predate it
        d4 = json.loads(s4.read_text())
        last = (d4.get("versions") or [{}])[-1]
        L.append(f"- **Under the written plan** ([Science 4](#science-4-the-70b-answer-under-a-"
                 f"written-plan); plan sha256 `{d4['plan_sha256'][:16]}...`): with the convergence "
                 f"QC ({last.get('reading', '?')}), S after the warmup "
                 f"{fmt(last.get('S_after'))} [{fmt(last.get('S_lo'))}, {fmt(last.get('S_hi'))}] "
                 f"(90 % prediction interval): **{last.get('label', '?')}**. The shipped fit's "
                 "'A possible' below rests on an unconverged rung-seed and a leave-one-out range.")
    fit = out / "ladder" / "fit.json"
    if fit.exists():
        rho = json.loads(fit.read_text()).get("llama2_70b", {}).get("rho", {})
        if rho:
            L.append("- **Where it sits** ([ladder](#width-depth-ladder-and-the-llama2-70b-profile)): "
                     "rho = rms(g) / eps per depth group " + ", ".join(
                         f"{g} {v:.2g}" for g, v in rho.items())
                     + " - every group but the head in the eps band (rho < 1), where Adam is "
                       "momentum SGD with step lr / eps.")
        sh = json.loads(fit.read_text()).get("llama2_70b", {}).get("sharpness")
        if sh:
            pk, wu = sh["pi"]["peak"], sh["pi"]["warmup_step_1000"]
            L.append(f"- **How close to the eps band's edge** ([sharpness ladder](#width-depth-"
                     f"ladder-and-the-llama2-70b-profile)): lambda_max(H) extrapolated to "
                     f"{sh['lambda_max']:.3g} [{sh['lambda_max_lo']:.3g}, {sh['lambda_max_hi']:.3g}], "
                     f"so Pi_eps = (lr/eps) lambda_max(H) = {pk['pi_eps']:.3g} [{pk['pi_eps_lo']:.3g}, "
                     f"{pk['pi_eps_hi']:.3g}] at the peak lr and {wu['pi_eps']:.3g} at step 1000 of "
                     f"the warmup, against the threshold {sh['threshold']:g} (it would need "
                     f"lambda_max(H) > {sh['lambda_crossing_at_peak']:.3g})"
                     + (f"; that reading lets the minibatch sharpness keep falling with the batch "
                        f"up to 4M tokens; if it stops at the ladder's "
                        f"{sh['at_ladder_tokens']['tokens_per_step']:,.0f} tokens, lambda_max(H) is "
                        f"{sh['at_ladder_tokens']['lambda_max']:.3g} and Pi_eps "
                        f"{sh['at_ladder_tokens']['pi']['peak']['pi_eps']:.3g}: the ladder brackets "
                        f"the 70B between {pk['over_threshold']:.2g}x and "
                        f"{sh['at_ladder_tokens']['pi']['peak']['over_threshold']:.2g}x the threshold"
                        if "at_ladder_tokens" in sh else "") + ".")
    # the stage's summary, else (standard scale) the shipped one the ladder stage copied
    bs = [p for p in (out / "batch_sharpness" / "summary.json",
                      out / "ladder" / "batch_sharpness.json") if p.exists()]
    summary = json.loads(bs[0].read_text()) if bs else {}
    t70 = summary.get("llama2_70b")
    if t70:
        rungs, tok = pd.DataFrame(summary["rungs"]), summary["eval_tokens"]
        where = ("[batch sharpness](#sharpness-against-the-evaluation-batch)"
                 if bs[0].parent.name == "batch_sharpness" else
                 "the shipped fit's `ladder/batch_sharpness.json`")
        L.append(f"- **Where the batch fall stops** ({where}): "
                 f"over {len(rungs)} trained rung x seed pairs lambda_max(H) falls "
                 f"{rungs['fall_first_to_last'].quantile(0.25):.2g}-"
                 f"{rungs['fall_first_to_last'].quantile(0.75):.2g}x (IQR) from {tok[0]} to "
                 f"{tok[-1]} tokens and stops there (median noise share "
                 f"{100 * rungs['noise_share'].median():.0f} % at {tok[-1]} tokens); the "
                 f"full-data limit carried to the 70B is {t70['lambda_inf']:.3g} (leave one rung "
                 f"out: {t70['lambda_inf_leave_one_out'][0]:.2g}-"
                 f"{t70['lambda_inf_leave_one_out'][1]:.3g}), Pi_eps {t70['pi_eps']:.3g} = "
                 f"{t70['over_threshold']:.2g}x the threshold at the peak lr: the reading the "
                 "predictions below use.")
    pm = out / "phase_map" / "phase_map.csv"
    if pm.exists():
        full = pd.read_csv(pm)
        t = full[full["in_band"]] if "in_band" in full else full
        out_band = full[~full["in_band"]] if "in_band" in full else full.iloc[:0]
        tags = sorted(int(c.split("_")[1]) for c in t.columns
                      if c.startswith("spikes_") and c.split("_")[1].isdigit())
        n = int(t[f"spikes_{tags[0]}"].sum()) if tags and len(t) else 0
        lanes = int(t["num_seeds"].sum()) if len(t) else 0
        meta = out / "phase_map" / "map.json"     # a reduced map draws no conclusion
        reduced = meta.exists() and bool(json.loads(meta.read_text()).get("sets"))
        reduced_note = ("No cell spiked in this reduced map (its sizes in configs/study.toml's "
                        "size table): too few and too short runs to test either mechanism; "
                        "`adamspike reproduce --full` runs the full map.")
        L.append(f"- **Toys held in that band** ([phase map](#phase-map-spikes-in-the-70bs-rho-band)): "
                 f"{n} loss spike(s) >= {tags[0] if tags else '?'} % in {lanes} runs of "
                 f"{int(t['num_steps'].max()) if len(t) else 0} steps over {len(t)} cells "
                 f"(lr x{t['lr_mult'].min():g} to x{t['lr_mult'].max():g}, b2 "
                 f"{', '.join(f'{b:g}' for b in sorted(t['b2'].unique()))}, batch x"
                 f"{', x'.join(f'{b:g}' for b in sorted(t['batch_mult'].unique()))}); Adam's "
                 f"stability number S reached p90 {t['S_p90'].max():.2g} (S = 1 is the edge), "
                 f"the rule's detection floor was a {100 * t['detect_floor'].median():.0f} % jump. "
                 + ("Mechanism per cell: " + ", ".join(
                     f"x{r.lr_mult:g}/b2 {r.b2:g}/batch x{r.batch_mult:g}: {r.mechanism}"
                     for r in t.itertuples() if r.mechanism != "no spikes") + "."
                    if n else reduced_note if reduced else
                    "No cell spiked: neither mechanism is exercised in this band at "
                    "toy scale; the 70B's spikes are not reproduced by Pi_eps alone.")
                 + (f" Out of the band ({len(out_band)} cell(s) whose groups left it, e.g. "
                    f"lr x{out_band['lr_mult'].max():g}): {int(out_band[f'spikes_{tags[0]}'].sum())} "
                    "spike(s)." if len(out_band) and tags else ""))
    rep = out / "replication_phase" / "replication.csv"
    if rep.exists():
        r = pd.read_csv(rep)
        rows = [f"`{x.id}` {x.verdict} ({x.control_mean:.3g} -> {x.treatment_mean:.3g} spikes/run)"
                for x in r.itertuples() if x.id in ("seed.lower_eps", "seed.lower_eps_1e6",
                                                      "seed.eps_lower_b2")]
        if rows:
            L.append("- **Lowering eps / b2 at the edge of stability** ([claims]"
                     "(#replication-at-the-edge-of-stability-in-the-70bs-rho-band)): "
                     + "; ".join(rows) + ".")
    p70 = out / "predictions_70b.json"
    if p70.exists():
        d70 = json.loads(p70.read_text())
        sets = [x for x in d70.get("settings", []) if x["id"].startswith(SEED_SETTING)]
        if sets:
            x = sets[0]
            lo, hi = x.get("rate_ci", [None, None])
            val = d70.get("rate_model", {}).get("validation", {})
            score = (f" Held-out ({val.get('split', '?').split(';')[0]}): log-loss "
                     f"{val['model']['log_loss']:.3f} vs {val['baseline']['log_loss']:.3f} for a "
                     f"constant rate, Brier {val['model']['brier']:.3f} vs "
                     f"{val['baseline']['brier']:.3f}." if val.get("model") else "")
            if "phases" in x:
                ph = x["phases"]
                L.append(f"- **Predicted** ([mechanism model](#spike-rate-model-and-the-pre-"
                         f"registered-70b-predictions)): mechanism {x['mechanism']}; during the "
                         f"warmup {ph['warmup']['rate_per_1k']:.3g} [{fmt(ph['warmup']['rate_ci'][0])}, "
                         f"{fmt(ph['warmup']['rate_ci'][1])}] spikes per 1k steps (S = "
                         f"{fmt(ph['warmup']['stability'])}), after it {x['rate_per_1k']:.3g} "
                         f"[{fmt(lo)}, {fmt(hi)}] (S = {fmt(ph['after']['stability'])}); rank "
                         f"{x.get('rank')} of {len(d70['settings'])}"
                         + (" (an extrapolation: " + "; ".join(x["extrapolation_reasons"][:3]) + ")"
                            if x.get("extrapolated") else "") + "." + score)
                L.append("- **What changing eps or b2 does** (the same lr and batch, after the "
                         "warmup): " + "; ".join(
                             f"{o['id'].split('-b1')[0]}: {o['rate_per_1k']:.3g} [{fmt(o['rate_ci'][0])}, "
                             f"{fmt(o['rate_ci'][1])}], {o.get('mechanism', '?')}"
                             for o in sorted(d70["settings"], key=lambda o: o["id"])
                             if o["id"].split("-lr")[-1] == x["id"].split("-lr")[-1]) + ".")
                top = sorted(d70["settings"], key=lambda o: o.get("rank", 0))[:3]
                L.append("- **Candidates ranked** (lowest predicted rate first; "
                         "[all](#predictions_70bjson)): " + "; ".join(
                             f"{o['rank']}. {o['id']} ({o['rate_per_1k']:.3g})" for o in top) + ".")
            else:
                L.append(f"- **Predicted rate** ([spike-rate model](#spike-rate-model-and-the-pre-"
                         f"registered-70b-predictions)): {x['rate_per_1k']:.3g} spikes per 1k steps "
                         f"[{fmt(lo)}, {fmt(hi)}] for the seed's setting, rank {x.get('rank')} of "
                         f"{len(d70['settings'])} (one rate for warmup and after: the model has "
                         "no schedule feature)." + score)
    return L if len(L) > 3 else []


def _setting_row(s: dict) -> list:
    """A predictions_70b.json setting as a row of STUDY.md's 70B table."""
    f, (lo, hi) = s.get("features", {}), s.get("rate_ci", [None, None])
    rho = [10 ** f[k] if f.get(k) is not None else None for k in ("log10_rho_shallow", "log10_rho_deep")]
    wu = s.get("phases", {}).get("warmup", {})
    return [s.get("rank"), s["id"], s.get("mechanism", "-"),
            f"{fmt(wu.get('rate_per_1k'))} [{fmt((wu.get('rate_ci') or [None])[0])}, "
            f"{fmt((wu.get('rate_ci') or [None, None])[1])}]" if wu else "-",
            s.get("rate_per_1k"), f"[{fmt(lo)}, {fmt(hi)}]", s.get("p_spike"),
            *rho, "; ".join(s.get("extrapolation_reasons", [])) or "-"]


def spike_rate_section(out: Path) -> list[str]:
    """STUDY.md: the GLM's held-out scores and calibration (spike_rate/report.md), the
    calibration figure, the pre-registered 70B table and its scores on the matched toys."""
    rep, p70 = out / "spike_rate" / "report.md", out / "predictions_70b.json"
    mech = out / "spike_rate_mechanism" / "report.md"
    if not rep.exists() and not p70.exists():
        return []
    L = ["", "## Spike-rate model and the pre-registered 70B predictions", ""]
    if mech.exists():
        L += ["The 70B predictions use the model with the mechanism groups (S, rho_min, "
              "warmup) trained on the phase maps' lanes; the sweep-trained model below it "
              "predicts the toy profile (predictions.json).", "",
              mech.read_text().strip().replace("### Spike-rate model (Poisson GLM on regime groups)",
                                               "### Mechanism model (Poisson GLM on the phase maps)"), ""]
    elif p70.exists():
        model_file = str(json.loads(p70.read_text()).get("rate_model", {}).get("model_file", ""))
        if str(package_data.DATA) in model_file:    # the standard scale: the shipped model
            L += ["The 70B predictions use the mechanism model shipped with the package "
                  "(`adamspike/data/llama2_70b/spike_rate_model.json`: S and warmup, trained on "
                  "the full width-32 and width-64 phase maps; `--full` retrains it); the "
                  "sweep-trained model below predicts the toy profile (predictions.json).", ""]
    if rep.exists():
        L += [rep.read_text().strip(), ""]
    fig = out / "figures" / "spike_rate" / "calibration.png"
    if fig.exists():
        L += [f"![calibration of the spike-rate GLM]({fig.relative_to(out)})", ""]
    if p70.exists():
        d = json.loads(p70.read_text())
        rm = d.get("rate_model", {})
        L += ["### predictions_70b.json", "",
              f"Pre-registered {d.get('created', '?')}, content sha256 "
              f"`{d.get('content_sha256', 'missing')}`. P(>= 1 spike) over "
              f"{rm.get('horizon_steps', '?')} steps. {rm.get('extrapolation_note', '')}.", "",
              md_table(map(_setting_row, sorted(d.get("settings", []), key=lambda s: s.get("rank", 0))),
                       headers=["rank", "setting", "mechanism", "warmup rate / 1k [interval]",
                                "rate / 1k steps (after warmup)", "interval", "P(>= 1 spike)",
                                "shallow rho", "deep rho", "extrapolation"], max_rows=None)]
    sc = out / "scores_70b" / "prediction_scores.md"
    if sc.exists():
        L += ["", "### The 70B predictions scored on the rho-matched toys and their Megatron log",
              "", "\n".join(("#" + ln) if ln.startswith("#") else ln
                            for ln in sc.read_text().strip().splitlines())]
    return L


def _skipped(st: Stage, out: Path, reason: str) -> dict:
    log = out / "logs" / f"{st.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(reason + "\n")
    return {"name": st.name, "title": st.title, "status": "skipped", "returncode": None,
            "seconds": 0.0, "log": str(log.relative_to(out)), "missing_outputs": [],
            "argv": st.argv, "reason": reason}


def _mark_hash(res: dict) -> str:
    return hashlib.sha256(json.dumps({k: v for k, v in res.items() if k != "sha256"},
                                     sort_keys=True).encode()).hexdigest()


def write_mark(marks: Path, res: dict) -> None:
    """OUT/.stages/<stage>.json of a stage that succeeded: its result and the result's
    sha256, written whole (a temporary file renamed onto it)."""
    path = marks / f"{res['name']}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(json.dumps({**res, "sha256": _mark_hash(res)}, indent=2))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_mark(marks: Path, name: str) -> dict | None:
    """The result a finished stage left, or None (absent; or torn, altered, not a success:
    then one line says the stage reruns)."""
    path = marks / f"{name}.json"
    if not path.exists():
        return None
    try:
        res = json.loads(path.read_text())
        ok = (isinstance(res, dict) and res.get("sha256") == _mark_hash(res)
              and res.get("status") == "ok" and res.get("name") == name)
        why = "its content does not match its sha256 (torn or altered)"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        ok, why = False, f"it is unreadable ({type(e).__name__})"
    if not ok:
        tqdm.write(f"adamspike reproduce: {path}: {why}; rerunning stage {name}", file=sys.stderr)
        return None
    return {k: v for k, v in res.items() if k != "sha256"}


def _schedule(plan: list[Stage], out: Path, env: dict, marks: Path, resume: bool,
              jobs: int) -> list[dict]:
    """Run the stages, up to `jobs` at once, each once its `needs` and `after` are done.
    Results come back in plan order."""
    names = {st.name for st in plan}
    pending = list(plan)
    status: dict[str, str] = {}
    results: dict[str, dict] = {}
    running: dict = {}
    bar = tqdm(total=len(plan), desc="reproduce", unit="stage", file=sys.stderr)

    def finish(st: Stage, res: dict) -> None:
        status[st.name] = res["status"]
        results[st.name] = res
        bar.update(1)
        tqdm.write(f"[{res['status']:>7}] {st.name} ({res['seconds']} s)", file=sys.stderr)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        while pending or running:
            # a free slot takes the first ready stage in plan order (submitting every ready
            # stage at once would queue a stage that just became ready behind all others);
            # passes repeat while stages finish in place (resumed or skipped)
            changed = True
            while changed:
                changed = False
                for st in list(pending):
                    waits = [n for n in st.needs + st.after if n in names and n not in status]
                    if waits:
                        continue
                    done = read_mark(marks, st.name) if resume else None
                    failed = [n for n in st.needs if status.get(n, "ok") != "ok"]
                    if done is not None:
                        pending.remove(st)
                        finish(st, done)
                        changed = True
                    elif failed:
                        pending.remove(st)
                        finish(st, _skipped(st, out, "needs " + ", ".join(failed)))
                        changed = True
                    elif len(running) < jobs:
                        pending.remove(st)
                        running[pool.submit(_run_stage, st, out, env)] = st
            if not running:
                if pending:  # a dependency outside the plan that never finishes
                    for st in pending:
                        finish(st, _skipped(st, out, "dependencies not in this run"))
                    pending.clear()
                continue
            finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for fut in finished:
                st = running.pop(fut)
                res = fut.result()
                if res["status"] == "ok":
                    write_mark(marks, res)
                finish(st, res)
    bar.close()
    return [results[st.name] for st in plan]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adamspike reproduce", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/study", help="output folder (must be new or empty)")
    scale = ap.add_mutually_exclusive_group()
    scale.add_argument("--quick", action="store_const", const="quick", dest="scale",
                       help="CI scale (a few minutes): configs/study.toml's quick values")
    scale.add_argument("--full", action="store_const", const="full", dest="scale",
                       help="every measurement recomputed, the phase maps and the batch-sharpness "
                            "ladder included (hours on 2 cores; cached by cell, --resume "
                            "continues); default: the standard scale, which reads those from "
                            "the fit shipped with the package")
    ap.add_argument("--resume", action="store_true", help="continue an interrupted study")
    ap.add_argument("--study", default=str(STUDY),
                    help="the stages, as TOML (default configs/study.toml)")
    ap.add_argument("--only", nargs="+", metavar="STAGE", help="run only these stages")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="stages run at once (independent stages overlap; default 2)")
    ap.add_argument("--executor", choices=("local", "ray"), default="local",
                    help="where the stages that write cells (adamspike.cells) compute them: "
                         "local worker processes, or Ray tasks (--address, else a local Ray)")
    ap.add_argument("--address", help="Ray cluster address for --executor ray (HOST:PORT)")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()) and not args.resume:
        print(f"adamspike reproduce: {out} exists and is not empty; use --resume or a new "
              "--out (nothing was overwritten)", file=sys.stderr)
        return 2
    try:      # a read-only or unwritable --out: one line before anything runs
        check_out(out, keep_existing=True)
    except OutputPathError as e:
        print(f"adamspike reproduce: {e}", file=sys.stderr)
        return 2
    try:
        args.scale = args.scale or "standard"
        plan = stages(out, args.scale, max(1, args.jobs), Path(args.study))
        note = scale_note(plan, args.scale, Path(args.study))
    except ConfigError as e:
        print(f"adamspike reproduce: {e}", file=sys.stderr)
        return 2
    if args.only:
        unknown = sorted(set(args.only) - {s.name for s in plan})
        if unknown:
            print(f"adamspike reproduce: unknown stage(s) {unknown}; known: "
                  f"{[s.name for s in plan]}", file=sys.stderr)
            return 2
        plan = [s for s in plan if s.name in args.only]
    # a study folder keeps its scale: resuming it at another would take the other scale's
    # finished stages (a reduced map, a refitted ladder) as this one's
    scale_file = out / ".stages" / "scale"
    if scale_file.is_file() and scale_file.read_text().strip() != args.scale:
        print(f"adamspike reproduce: {out} holds a study at scale "
              f"{scale_file.read_text().strip()!r}; resume it at that scale or use a new --out "
              f"for {args.scale!r} (nothing was changed)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    try:     # one writer per study folder (released when this process ends, even by kill -9)
        lock = RunLock(out).acquire(new=None)
    except RunFormatError as e:
        print(f"adamspike reproduce: {e}", file=sys.stderr)
        return 2
    marks = out / ".stages"
    marks.mkdir(exist_ok=True)
    scale_file.write_text(args.scale + "\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ADAMSPIKE_STUDY": str(out)}
    # overlapping stages share the cores instead of oversubscribing them
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, args.jobs))))
    # JAX's persistent compilation cache, per user (not per study): a second study into a
    # new folder, and the next --resume, load every program the first compiled
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache_home() / "jax"))
    env["ADAMSPIKE_EXECUTOR"] = args.executor          # adamspike.cells.run_cells' default
    if args.address:
        env["ADAMSPIKE_RAY_ADDRESS"] = args.address
    # the analyses' tables of exact theory values (analysis.fits), computed once per study
    env.setdefault("ADAMSPIKE_CACHE_DIR", str(out / ".cache"))

    def interrupted(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stopped = stop_stages()
        print(f"adamspike reproduce: interrupted by {signal.Signals(signum).name}; stopped "
              f"{len(stopped)} running stage(s) (--resume continues)", file=sys.stderr)
        lock.release()
        os._exit(128 + signum)   # the pool's threads wait on stages already stopped

    handlers = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        results = _schedule(plan, out, env, marks, args.resume, max(1, args.jobs))
        (out / "stages.json").write_text(json.dumps(results, indent=2))
        report = write_study_report(out, results, args.scale, note)
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
        lock.release()
    print(f"study written to {out} (report: {report})")
    bad = [r["name"] for r in results if r["status"] in ("failed", "skipped")]
    missing = [r["name"] for r in results if r["status"] == "missing"]
    if missing:
        print(f"missing (not built yet): {', '.join(missing)}", file=sys.stderr)
    if bad:
        print(f"failed or skipped: {', '.join(bad)} (see {out}/logs)", file=sys.stderr)
        return 1
    return 0
