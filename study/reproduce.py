"""`adamspike reproduce`: the whole study at CPU scale, into one output folder.

The loop of DESIGN.md, stage by stage, each stage one `adamspike <command>` in its own
process (the JAX and torch halves never share an interpreter):

    theory -> Monte-Carlo check -> toy spike runs (quadratic, MLP, tiny LLaMA) -> sweeps
    -> replication table -> spike-rate GLM (sweeps + toy runs, held-out validated) ->
    predictions.json / predictions_70b.json (pre-registered) -> plan -> tiny torch run
    driven by the predictions -> figures -> analysis (+ the 70B predictions scored on the
    rho-matched toy and on its Megatron-format log) -> STUDY.md

Independent stages overlap (`--jobs`, default 2): a stage can start once the stages it
needs have succeeded and those it reads after have finished, and a free slot takes the
first such stage in plan order. Compiled JAX programs and exact theory tables are cached
in OUT/.cache. A stage whose command is not built yet is reported as missing, a stage that fails is
reported as failed (with the tail of its log) and the stages that need its output are
skipped; nothing is faked. Each stage's stdout/stderr go to OUT/logs/<stage>.log and a
finished stage leaves OUT/.stages/<stage>.json, so `--resume` continues an interrupted
study without redoing finished stages. An existing non-empty OUT without --resume is an
error: nothing already written is overwritten.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from adamspike.config import read_toml

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


# Stages that leave run directories under OUT/runs (analysis and figures read them all).
RUN_STAGES = ["quadratic_spike", "quadratic_stable", "mlp", "llama_spike", "llama_stable",
              "torch_run", "matched_toy", "matched_toy_1e8", "matched_toy_ge", "matched_toy_ge_1e8"]


# Run stages whose run directories train the spike-rate GLM (not torch_run: it needs the
# predictions; not the matched toys: the 70B predictions are scored on them).
RATE_RUN_STAGES = {"quadratic_spike": "quadratic_eps1e-8", "quadratic_stable": "quadratic_eps5e-4",
                   "mlp": "mlp_sin", "llama_spike": "llama_spike", "llama_stable": "llama_stable"}


def _matched_optim() -> list[str]:
    """--b2 / --eps of configs/matched_70b.toml for its exported Megatron log (a log does not
    state them)."""
    optim = read_toml(REPO / "configs" / "matched_70b.toml").get("optim", {})
    return [a for k in ("b2", "eps") if k in optim for a in (f"--{k}", repr(float(optim[k])))]


def stages(out: Path, quick: bool, jobs: int = 2) -> list[Stage]:
    """The study, in order. Paths are inside `out`; jobs: processes of the figures and
    analysis stages (they run last, one after the other, beside nothing else)."""
    q = ["--quick"] if quick else []
    o = lambda *p: str(out.joinpath(*p))  # noqa: E731
    llama_steps = ["--train.num_steps", "100"] if quick else []
    # --quick leaves out the stable tiny LLaMA (the spiking one stays: predictions.json's
    # profile and the torch run's alarms read it)
    rate_runs = {k: v for k, v in RATE_RUN_STAGES.items() if not (quick and k == "llama_stable")}
    # the global-eps pair is the per-group pair's variant: 1000 steps, no curvature (each
    # curvature evaluation costs ~300 gradients and its compile ~50 s: the per-group pair
    # measures it), for the time budget; quick: 120 steps
    global_steps = ["--train.num_steps", "120" if quick else "1000",
                    "--telemetry.curvature_every", "0"]
    # the per-group-eps pair (5k steps, curvature): the full study only; --quick runs only
    # the global-eps pair (its Megatron log and the 70B scores need that pair)
    groupeps = [] if quick else [
        Stage("matched_toy_ge", "Rho-matched tiny LLaMA, per-group eps (70B rho per group at "
              "eps 1e-5)",
              ["simulate", "llama", "--config", str(REPO / "configs" / "matched_70b_groupeps.toml"),
               "--out", o("runs", "matched_70b_groupeps"), "--no-progress"],
              outputs=["runs/matched_70b_groupeps/run.json"]),
        Stage("matched_toy_ge_1e8", "Rho-matched tiny LLaMA, per-group eps / 1000 (the 70B at "
              "eps 1e-8)",
              ["simulate", "llama", "--config",
               str(REPO / "configs" / "matched_70b_groupeps_eps1e-8.toml"),
               "--out", o("runs", "matched_70b_groupeps_eps1e-8"), "--no-progress"],
              outputs=["runs/matched_70b_groupeps_eps1e-8/run.json"]),
    ]
    matched_runs = ["matched_70b", "matched_70b_eps1e-8"] + (
        [] if quick else ["matched_70b_groupeps", "matched_70b_groupeps_eps1e-8"])
    return [
        Stage("theory", "Closed-form theory numbers", ["theory", "all", "--json"],
              outputs=["theory/theory.json"], stdout_to="theory/theory.json"),
        # the longest stages first (they start at once, the matched replication as soon as
        # the ladder is done; the short ones fill the other slot)
        Stage("ladder", "Width/depth ladder of tiny LLaMAs: gradient RMS fit, 70B profile",
              ["simulate", "ladder", "--out", o("ladder"), "--no-progress", *q],
              outputs=["ladder/fit.json", "ladder/report.md"]),
        Stage("replay", "Causal replay of toy spikes (toy_spike at batch 16), one intervention "
              "each (JAX; torch subset)",
              ["replay", "--config", str(REPO / "configs" / "toy_spike.toml"),
               "--out", o("replay"), "--no-progress",
               # batch 16: ~2.5x the incidents per CPU second of batch 32 (measured: 11
               # incidents in 7 seeds x 1500 steps at 20 ms / step, against 15 in 14 seeds at
               # 35 ms / step), so >= 20 incidents fit the study's time budget
               "--train.global_batch_size", "16",
               *(q if quick else ["--torch-spikes", "2"])],
              outputs=["replay/replay.md", "replay/replay.csv"]),
        Stage("replication_matched", "Replication of the claims in the rho-matched regime "
              "(10 paired seeds per arm)",
              ["replicate", "matched", "--ladder", o("ladder"), "--out", o("replication_matched"),
               "--no-progress", *q],
              needs=["ladder"], outputs=["replication_matched/replication.md"]),
        *groupeps,
        # the spike-rate GLM's inputs, then the GLM and what reads it (predictions, the torch
        # run), so that chain overlaps the stages below instead of ending the study
        Stage("quadratic_spike", "Adam on a quadratic, eps below eps* (spikes)",
              ["simulate", "quadratic", "--steps", "30000", "--lr", "1e-2", "--eps", "1e-8",
               "--b2", "0.999", "--out", o("runs", "quadratic_eps1e-8"), "--no-progress"],
              outputs=["runs/quadratic_eps1e-8/run.json"]),
        Stage("quadratic_stable", "Adam on a quadratic, eps above eps* (no spikes)",
              ["simulate", "quadratic", "--steps", "30000", "--lr", "1e-2", "--eps", "5e-4",
               "--b2", "0.999", "--out", o("runs", "quadratic_eps5e-4"), "--no-progress"],
              outputs=["runs/quadratic_eps5e-4/run.json"]),
        Stage("mlp", "2-layer FNN on sin x + sin 4x, full-batch Adam (Bai et al.)",
              ["simulate", "mlp", "--kind", "sin", "--steps", "4000" if quick else "20000",
               "--lr", "1e-2", "--b2", "0.999", "--eps", "1e-8", "--hist-every", "50",
               "--out", o("runs", "mlp_sin"), "--no-progress"],
              outputs=["runs/mlp_sin/run.json"]),
        Stage("llama_spike", "Tiny LLaMA (JAX) in the spiking regime",
              ["simulate", "llama", "--config", str(REPO / "configs" / "toy_spike.toml"),
               "--out", o("runs", "llama_spike"), *llama_steps],
              outputs=["runs/llama_spike/run.json"]),
        *([] if quick else [
            Stage("llama_stable", "Tiny LLaMA (JAX), stable setting",
                  ["simulate", "llama", "--config", str(REPO / "configs" / "toy_stable.toml"),
                   "--out", o("runs", "llama_stable")],
                  outputs=["runs/llama_stable/run.json"])]),
        Stage("sweep", "eps x b2 x lr x seed sweep on the quadratic",
              ["sweep", "run", "--grid", str(REPO / "configs" / "sweep_quadratic.toml"),
               "--out", o("sweep"), *q], outputs=["sweep"]),
        Stage("sweep_mlp_width", "eps x b2 x width x seed sweep on the MLP (GLM held-out width)",
              ["sweep", "run", "--grid", str(REPO / "configs" / "sweep_mlp_width.toml"),
               "--out", o("sweep_mlp_width"), "--no-progress", *q],
              outputs=["sweep_mlp_width"]),
        Stage("spike_rate", "Spike-rate GLM on the sweeps, toy runs and matched arms, held-out validation",
              ["spike-rate", "--sweep", o("sweep"), "--sweep", o("sweep_mlp_width"), "--runs",
               *[o("runs", d) for d in rate_runs.values()],
               "--matched", o("replication_matched"), "--out", o("spike_rate")],
              needs=["sweep", "sweep_mlp_width", "replication_matched"], after=list(rate_runs),
              outputs=["spike_rate/model.json"], fresh=["spike_rate"]),
        Stage("predict", "predictions.json from the spike-rate GLM + sweep",
              ["predict", "--profile", o("runs", "llama_spike"), "--sweep", o("sweep"),
               "--rate-model", o("spike_rate", "model.json"), "--out", o("predictions.json")],
              needs=["sweep", "llama_spike", "spike_rate"], outputs=["predictions.json"],
              fresh=["predictions.json"]),
        Stage("predict_70b", "pre-registered predictions for LLaMA2-70B (GLM rate per setting, "
              "ladder profile per depth)",
              ["predict", "--profile", "llama2-70b", "--ladder", o("ladder"), "--sweep", o("sweep"),
               "--rate-model", o("spike_rate", "model.json"), "--out", o("predictions_70b.json")],
              needs=["sweep", "ladder", "spike_rate"], outputs=["predictions_70b.json"],
              fresh=["predictions_70b.json"]),
        Stage("torch_run", "Tiny LLaMA (torch) driven by the predictions' alarms",
              ["train", "--config", str(REPO / "configs" / "tiny_torch_study.toml"),
               "--out", o("runs", "torch_tiny"), "--alarms.predictions", o("predictions.json"),
               *(["--train.num_steps", "60"] if quick else [])],
              needs=["predict"], outputs=["runs/torch_tiny/run.json"]),
        Stage("matched_toy", "Rho-matched tiny LLaMA (70B rho at eps 1e-5, b2 0.95, Zipf data; "
              f"{global_steps[1]} steps)",
              ["simulate", "llama", "--config", str(REPO / "configs" / "matched_70b.toml"),
               "--out", o("runs", "matched_70b"), "--no-progress", *global_steps],
              outputs=["runs/matched_70b/run.json"]),
        Stage("matched_toy_1e8", "Rho-matched tiny LLaMA at the 70B's eps 1e-8 (eps / 1000; "
              f"{global_steps[1]} steps)",
              ["simulate", "llama", "--config", str(REPO / "configs" / "matched_70b_eps1e-8.toml"),
               "--out", o("runs", "matched_70b_eps1e-8"), "--no-progress", *global_steps],
              outputs=["runs/matched_70b_eps1e-8/run.json"]),
        Stage("montecarlo", "Monte-Carlo of Adam on i.i.d. and AR(1) streams (optax)",
              ["simulate", "streams", "--steps", "500" if quick else "2000",
               "--coords", "16384" if quick else "65536", "--b1", "0.9", "--b2", "0.95",
               "--phi", "0.5", "--out", o("montecarlo", "streams.json")],
              outputs=["montecarlo/streams.json"]),
        # theory figures read no runs (their Monte-Carlo points take ~1.5 min): drawn early,
        # beside the training stages, not at the study's end
        Stage("figures_theory", "Theory figures (closed forms with Monte-Carlo points)",
              ["figures", "--only-theory", "--out", o("figures"), *q],
              outputs=["figures/theory"]),
        Stage("replication", "Replication table of the literature's claims (toy regime)",
              ["sweep", "replicate", "--out", o("replication"), "--skip-llama", *q],
              outputs=["replication"]),
        Stage("megatron_log", "The rho-matched toy's steps as a Megatron-format training log",
              ["megatron-log", o("runs", "matched_70b"), "--out", o("megatron", "matched_70b.log")],
              needs=["matched_toy"], outputs=["megatron/matched_70b.log"],
              fresh=["megatron/matched_70b.log"]),
        Stage("score_70b", "The 70B predictions scored on the rho-matched toys and the log",
              ["analyze", o("runs", "matched_70b"), o("runs", "matched_70b_eps1e-8"),
               "--log", o("megatron", "matched_70b.log"), *_matched_optim(),
               "--predictions", o("predictions_70b.json"), "--out", o("scores_70b"),
               "--no-figures"],
              needs=["predict_70b", "matched_toy", "matched_toy_1e8", "megatron_log"],
              outputs=["scores_70b/prediction_scores.md"], fresh=["scores_70b"]),
        Stage("matched_report", "Rho-matched toy: spikes, regime trajectories, dormancy",
              ["simulate", "matched", "--runs", *[o("runs", r) for r in matched_runs],
               "--predictions", o("predictions_70b.json"), "--out", o("matched")],
              needs=["matched_toy", "matched_toy_1e8", *[st.name for st in groupeps],
                     "predict_70b"],
              outputs=["matched/report.md"]),
        Stage("plan", "Full-scale run configs + launch scripts per recommended setting",
              ["plan", "--predictions", o("predictions_70b.json"),
               "--base", str(REPO / "configs" / "llama2-70b.toml"),
               "--cluster", str(REPO / "configs" / "cluster-128x8.toml"), "--top", "3",
               "--master-addr", "node0000",  # the rank-0 host name, to edit
               "--out", o("plan")],
              needs=["predict_70b"], outputs=["plan"]),
        Stage("model_info", "LLaMA2-70B parameters, FLOPs/token, memory per card",
              ["model", "info", "--config", "llama2-70b", "--world-size", "1024", "--json"],
              outputs=["model_info.json"], stdout_to="model_info.json"),
        # the run figures are drawn once, by the figures stage (one process per run); the
        # analysis reports link them
        Stage("figures", "Every figure of the study (the theory figures: figures_theory)",
              ["figures", "--from-study", str(out), "--out", o("figures"), "--no-theory",
               "--jobs", str(jobs), *q],
              after=RUN_STAGES + ["sweep", "replication", "ladder", "spike_rate"],
              outputs=["figures"]),
        Stage("analyze", "Spikes, precursors, alarm scores, theory fits",
              ["analyze", "--from-study", str(out), "--predictions", o("predictions.json"),
               "--figures-from", o("figures"), "--jobs", str(jobs), "--out", o("analysis")],
              needs=["predict"],
              after=RUN_STAGES + ["figures"], outputs=["analysis"], fresh=["analysis"]),
    ]


def _set_aside(st: Stage, out: Path) -> None:
    """Move what an unfinished earlier attempt of `st` left in its `fresh` paths to
    OUT/.stale/<stage>-<n>/ (kept for inspection), so the rerun starts from nothing."""
    left = [p for p in st.fresh if (out / p).exists()]
    if not left:
        return
    n = 0
    while (out / ".stale" / f"{st.name}-{n}").exists():
        n += 1
    dest = out / ".stale" / f"{st.name}-{n}"
    for p in left:
        (dest / p).parent.mkdir(parents=True, exist_ok=True)
        (out / p).rename(dest / p)


def _run_stage(st: Stage, out: Path, env: dict) -> dict:
    _set_aside(st, out)
    log = out / "logs" / f"{st.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "study", *st.argv]
    t0 = time.monotonic()
    with open(log, "w") as err:
        err.write("$ adamspike " + " ".join(st.argv) + "\n")
        err.flush()
        if st.stdout_to:
            dest = out / st.stdout_to
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(dest, "w") as fh:
                rc = subprocess.run(cmd, stdout=fh, stderr=err, env=env, cwd=REPO).returncode
        else:
            rc = subprocess.run(cmd, stdout=err, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO).returncode
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


def write_study_report(out: Path, results: list[dict], quick: bool) -> Path:
    """STUDY.md: what ran, what it produced, where to look; failures with their log tail."""
    from analysis.report import rebase_links   # inlined reports keep their links valid
    lines = [f"# adamspike study{' (quick)' if quick else ''}", "",
             f"Generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by `adamspike reproduce"
             f"{' --quick' if quick else ''}`.", "", "## Stages", "",
             "| stage | status | seconds | output |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['title']} | {r['status']} | {r['seconds']} | `{r['log']}` |")
    regime_map = out / "figures" / "study" / "regime_map.png"
    if regime_map.exists():   # every run and the 70B estimate in Adam's eps regimes
        lines += ["", "## Regime map", "", f"![regime map]({regime_map.relative_to(out)})",
                  "", "Per-run regime cards and the update_rms fit per regime band: the "
                  "analysis report below (Regime overview, Regime card)."]
    for name, title in (("replication_matched", "Replication table, matched regime"),
                        ("replication", "Replication table, toy regime (b2 0.999, eps 1e-8: "
                                        "2.5-3.5 decades of rho above the 70B; its own section)"),
                        ("analysis", "Analysis report"),
                        ("ladder", "Width/depth ladder and the LLaMA2-70B profile"),
                        ("matched", "Rho-matched toy"), ("replay", "Causal replay of spikes")):
        for cand in (out / name / "replication.md", out / name / "report.md",
                     out / name / "replay.md"):
            if cand.exists():
                lines += ["", f"## {title}", "", rebase_links(cand.read_text().strip(), name)]
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


def _g(x) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.3g}"


def spike_rate_section(out: Path) -> list[str]:
    """STUDY.md: the GLM's held-out scores and calibration (spike_rate/report.md), the
    calibration figure, the pre-registered 70B table and its scores on the matched toys."""
    rep, p70 = out / "spike_rate" / "report.md", out / "predictions_70b.json"
    if not rep.exists() and not p70.exists():
        return []
    L = ["", "## Spike-rate model and the pre-registered 70B predictions", ""]
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
              "| rank | setting | rate / 1k steps | interval | P(>= 1 spike) | shallow rho | "
              "deep rho | extrapolation |", "|---|---|---|---|---|---|---|---|"]
        for s in sorted(d.get("settings", []), key=lambda s: s.get("rank", 0)):
            f = s.get("features", {})
            rho = {k: (10 ** f[k] if f.get(k) is not None else None)
                   for k in ("log10_rho_shallow", "log10_rho_deep")}
            ext = "; ".join(s.get("extrapolation_reasons", [])) or "-"
            ci = s.get("rate_ci", [None, None])
            L.append(f"| {s.get('rank')} | {s['id']} | {_g(s.get('rate_per_1k'))} | "
                     f"[{_g(ci[0])}, {_g(ci[1])}] | {_g(s.get('p_spike'))} | "
                     f"{_g(rho['log10_rho_shallow'])} | {_g(rho['log10_rho_deep'])} | {ext} |")
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
                    mark = marks / f"{st.name}.json"
                    failed = [n for n in st.needs if status.get(n, "ok") != "ok"]
                    if resume and mark.exists():
                        pending.remove(st)
                        finish(st, json.loads(mark.read_text()))
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
                    (marks / f"{st.name}.json").write_text(json.dumps(res, indent=2))
                finish(st, res)
    bar.close()
    return [results[st.name] for st in plan]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adamspike reproduce", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/study", help="output folder (must be new or empty)")
    ap.add_argument("--quick", action="store_true", help="CI scale (a few minutes)")
    ap.add_argument("--resume", action="store_true", help="continue an interrupted study")
    ap.add_argument("--only", nargs="+", metavar="STAGE", help="run only these stages")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="stages run at once (independent stages overlap; default 2)")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()) and not args.resume:
        print(f"adamspike reproduce: {out} exists and is not empty; use --resume or a new "
              "--out (nothing was overwritten)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    marks = out / ".stages"
    marks.mkdir(exist_ok=True)
    plan = stages(out, args.quick, max(1, args.jobs))
    if args.only:
        unknown = sorted(set(args.only) - {s.name for s in plan})
        if unknown:
            print(f"adamspike reproduce: unknown stage(s) {unknown}; known: "
                  f"{[s.name for s in plan]}", file=sys.stderr)
            return 2
        plan = [s for s in plan if s.name in args.only]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ADAMSPIKE_STUDY": str(out)}
    # overlapping stages share the cores instead of oversubscribing them
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, args.jobs))))
    # JAX's persistent compilation cache, per study: stages that compile the same program
    # (the trainer's init and steps at one model size) compile it once, and --resume
    # finds every finished compile
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(out / ".cache" / "jax"))
    # the analyses' tables of exact theory values (analysis.fits), computed once per study
    env.setdefault("ADAMSPIKE_CACHE_DIR", str(out / ".cache"))
    results = _schedule(plan, out, env, marks, args.resume, max(1, args.jobs))
    (out / "stages.json").write_text(json.dumps(results, indent=2))
    report = write_study_report(out, results, args.quick)
    print(f"study written to {out} (report: {report})")
    bad = [r["name"] for r in results if r["status"] in ("failed", "skipped")]
    missing = [r["name"] for r in results if r["status"] == "missing"]
    if missing:
        print(f"missing (not built yet): {', '.join(missing)}", file=sys.stderr)
    if bad:
        print(f"failed or skipped: {', '.join(bad)} (see {out}/logs)", file=sys.stderr)
        return 1
    return 0
