"""STUDY.md, written from the study table (configs/study.toml) and the reports' own data.

Each stage of the table declares what it adds to STUDY.md, as data:

    [[stages.<name>.answer]]   a line of the opening ("The answer, in one minute"):
        kind     how to say it: one of ANSWER_LINES, each reading one kind of file
        file     the file it reads (relative to the study folder); no file, no line
        order    where the line goes (ascending); one line per kind: the first entry, by
                 order, whose file exists (a stage's own summary before the shipped copy)
        link     the text of the link to the line's evidence, `section` the heading it
                 points at; or `cite`: plain text instead of a link
        ...      the kind's own settings (ANSWER_LINES' docstrings)
    [[stages.<name>.report]]   a part of the body:
        section  its `##` heading (parts with the same heading, in order, share it)
        order    where the part goes (ascending)
        file     a Markdown report inlined (its links rebased to stay valid), or
        figure   an image (`alt` its text), or
        render   a table drawn from a file's data (RENDERERS; `file` names the file), or
        text     a paragraph alone
        heading  a `###` line before it; intro / note: paragraphs before / after it
        demote   true: its headings one level down;  retitle: [old, new] a line replaced
        when     "reads_shipped": only when the stage read the fit shipped with the package

The table's top-level [study_md]: `answer_heading` and `question` open the answer,
`figure_folder` is the folder whose PNGs STUDY.md lists (relative to the study folder). Nothing
here names a stage: a stage added to the table with its entries appears in STUDY.md, and
an entry whose file is absent (the scale left its stage out) says nothing.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Callable

import pandas as pd

from adamspike import package_data
from adamspike.config import ConfigError, read_toml
from adamspike.tables import fmt, md_table

REPORT_KEYS = {"section", "order", "file", "figure", "alt", "render", "text", "heading", "intro",
               "note", "demote", "retitle", "when"}
ANSWER_KEYS = {"kind", "file", "order", "link", "section", "cite"}


def anchor(heading: str) -> str:
    """The link target of a Markdown heading, as GitHub makes it (lower case; punctuation
    other than - and _ dropped; spaces to -)."""
    return "#" + re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


# ------------------------------------------------------------------------------- the answer
def _plan_reading(path: Path, e: dict, link: str) -> list[str]:
    """A plan's reading (science4.json): the last version's label and S interval, the 70B's
    S on the toys' scale (One S) and the rate model's held-out verdict when measured."""
    d4 = json.loads(path.read_text())
    last = (d4.get("versions") or [{}])[-1]
    L = [f"- **Under the written plan** ({link}; plan v{d4.get('plan_version', 1)}, sha256 "
         f"`{d4['plan_sha256'][:16]}...`): with the convergence QC ({last.get('reading', '?')}), "
         f"S after the warmup {fmt(last.get('S_after'))} [{fmt(last.get('S_lo'))}, "
         f"{fmt(last.get('S_hi'))}] (90 % prediction interval): **{last.get('label', '?')}** "
         "(`predict` prints this label; Science 3's 'A possible' rested on an unconverged "
         "rung-seed and a leave-one-out range)."]
    toy = d4.get("S_70b_toy_scale")
    if toy:
        L.append(f"  On the toys' scale (One S, the 70B's estimator calibrated against the toys' "
                 f"tracker): S {fmt(toy['S'])} [{fmt(toy['lo'])}, {fmt(toy['hi'])}].")
    mt = d4.get("matched_toy_test")
    if mt:
        L.append(f"  The toy matched to the 70B on every quantity ({mt['cells']}; rho per group, "
                 f"S against '{mt['reading']}', the relative update, lr x wd): {mt['k']} "
                 f"visible spikes in {mt['n']:,.0f} lane-steps"
                 + (f", against the seed run's {mt['k0']} in {mt['n0']:,.0f}: **{mt['verdict']}** "
                    f"(P[K <= k] = {mt['p_lower']:.3g})" if "verdict" in mt else "") + ".")
    rm = d4.get("rate_model")
    if rm:
        L.append(f"  The rate model that can say zero, on the held-out third map: "
                 f"**{rm['verdict']}** ({rm['why']}).")
    return L


def _rho_profile(path: Path, e: dict, link: str) -> list[str]:
    """The 70B's rho per depth group (a ladder fit.json)."""
    rho = json.loads(path.read_text()).get("llama2_70b", {}).get("rho", {})
    if not rho:
        return []
    return [f"- **Where it sits** ({link}): rho = rms(g) / eps per depth group "
            + ", ".join(f"{g} {v:.2g}" for g, v in rho.items())
            + " - every group but the head in the eps band (rho < 1), where Adam is "
              "momentum SGD with step lr / eps."]


def _sharpness_edge(path: Path, e: dict, link: str) -> list[str]:
    """lambda_max(H) and Pi_eps extrapolated to the 70B (a ladder fit.json)."""
    sh = json.loads(path.read_text()).get("llama2_70b", {}).get("sharpness")
    if not sh:
        return []
    pk, wu = sh["pi"]["peak"], sh["pi"]["warmup_step_1000"]
    return [f"- **How close to the eps band's edge** ({link}): lambda_max(H) extrapolated to "
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
               if "at_ladder_tokens" in sh else "") + "."]


def _batch_fall(path: Path, e: dict, link: str) -> list[str]:
    """Where the minibatch sharpness stops falling with the batch (a batch-sharpness
    summary.json), carried to the 70B."""
    summary = json.loads(path.read_text())
    t70 = summary.get("llama2_70b")
    if not t70:
        return []
    rungs, tok = pd.DataFrame(summary["rungs"]), summary["eval_tokens"]
    return [f"- **Where the batch fall stops** ({link}): "
            f"over {len(rungs)} trained rung x seed pairs lambda_max(H) falls "
            f"{rungs['fall_first_to_last'].quantile(0.25):.2g}-"
            f"{rungs['fall_first_to_last'].quantile(0.75):.2g}x (IQR) from {tok[0]} to "
            f"{tok[-1]} tokens and stops there (median noise share "
            f"{100 * rungs['noise_share'].median():.0f} % at {tok[-1]} tokens); the "
            f"full-data limit carried to the 70B is {t70['lambda_inf']:.3g} (leave one rung "
            f"out: {t70['lambda_inf_leave_one_out'][0]:.2g}-"
            f"{t70['lambda_inf_leave_one_out'][1]:.3g}), Pi_eps {t70['pi_eps']:.3g} = "
            f"{t70['over_threshold']:.2g}x the threshold at the peak lr: the reading the "
            "predictions below use."]


def _band_spikes(path: Path, e: dict, link: str) -> list[str]:
    """The loss spikes of a phase map's cells in the 70B's rho band (phase_map.csv, its
    map.json beside it: a reduced map draws no conclusion)."""
    full = pd.read_csv(path)
    t = full[full["in_band"]] if "in_band" in full else full
    out_band = full[~full["in_band"]] if "in_band" in full else full.iloc[:0]
    tags = sorted(int(c.split("_")[1]) for c in t.columns
                  if c.startswith("spikes_") and c.split("_")[1].isdigit())
    n = int(t[f"spikes_{tags[0]}"].sum()) if tags and len(t) else 0
    lanes = int(t["num_seeds"].sum()) if len(t) else 0
    meta = path.parent / "map.json"
    reduced = meta.exists() and bool(json.loads(meta.read_text()).get("quick"))
    reduced_note = ("No cell spiked in this reduced map (configs/phase_map.toml's [quick] "
                    "sizes): too few and too short runs to test either mechanism; "
                    "`adamspike reproduce --full` runs the full map.")
    return [f"- **Toys held in that band** ({link}): "
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
               "spike(s)." if len(out_band) and tags else "")]


def _claim_verdicts(path: Path, e: dict, link: str) -> list[str]:
    """The verdicts of the claims `ids` (a replication.csv)."""
    r = pd.read_csv(path)
    rows = [f"`{x.id}` {x.verdict} ({x.control_mean:.3g} -> {x.treatment_mean:.3g} spikes/run)"
            for x in r.itertuples() if x.id in e.get("ids", [])]
    return ["- **Lowering eps / b2 at the edge of stability** (" + link + "): "
            + "; ".join(rows) + "."] if rows else []


def _predicted_rate(path: Path, e: dict, link: str) -> list[str]:
    """The pre-registered rate of the seed's `setting` (predictions_70b.json; ids starting
    with it), what changing eps or b2 does, the ranking; `table_section`: the heading of
    the table of every setting."""
    d70 = json.loads(path.read_text())
    sets = [x for x in d70.get("settings", []) if x["id"].startswith(e["setting"])]
    if not sets:
        return []
    x = sets[0]
    lo, hi = x.get("rate_ci", [None, None])
    val = d70.get("rate_model", {}).get("validation", {})
    score = (f" Held-out ({val.get('split', '?').split(';')[0]}): log-loss "
             f"{val['model']['log_loss']:.3f} vs {val['baseline']['log_loss']:.3f} for a "
             f"constant rate, Brier {val['model']['brier']:.3f} vs "
             f"{val['baseline']['brier']:.3f}." if val.get("model") else "")
    if "phases" not in x:
        older = f"[spike-rate model]({anchor(e['section'])})" if "section" in e else link
        return [f"- **Predicted rate** ({older}): "
                f"{x['rate_per_1k']:.3g} spikes per 1k steps "
                f"[{fmt(lo)}, {fmt(hi)}] for the seed's setting, rank {x.get('rank')} of "
                f"{len(d70['settings'])} (one rate for warmup and after: the model has "
                "no schedule feature)." + score]
    ph = x["phases"]
    table = anchor(e.get("table_section", ""))
    return [
        f"- **Predicted** ({link}): mechanism {x['mechanism']}; during the "
        f"warmup {ph['warmup']['rate_per_1k']:.3g} [{fmt(ph['warmup']['rate_ci'][0])}, "
        f"{fmt(ph['warmup']['rate_ci'][1])}] spikes per 1k steps (S = "
        f"{fmt(ph['warmup']['stability'])}), after it {x['rate_per_1k']:.3g} "
        f"[{fmt(lo)}, {fmt(hi)}] (S = {fmt(ph['after']['stability'])}); rank "
        f"{x.get('rank')} of {len(d70['settings'])}"
        + (" (an extrapolation: " + "; ".join(x["extrapolation_reasons"][:3]) + ")"
           if x.get("extrapolated") else "") + "." + score,
        "- **What changing eps or b2 does** (the same lr and batch, after the "
        "warmup): " + "; ".join(
            f"{o['id'].split('-b1')[0]}: {o['rate_per_1k']:.3g} [{fmt(o['rate_ci'][0])}, "
            f"{fmt(o['rate_ci'][1])}], {o.get('mechanism', '?')}"
            for o in sorted(d70["settings"], key=lambda o: o["id"])
            if o["id"].split("-lr")[-1] == x["id"].split("-lr")[-1]) + ".",
        "- **Candidates ranked** (lowest predicted rate first; "
        f"[all]({table})): " + "; ".join(
            f"{o['rank']}. {o['id']} ({o['rate_per_1k']:.3g})"
            for o in sorted(d70["settings"], key=lambda o: o.get("rank", 0))[:3]) + "."]


# one kind of answer line per kind of evidence file: (path, entry, link) -> lines
ANSWER_LINES: dict[str, Callable[[Path, dict, str], list[str]]] = {
    "plan_reading": _plan_reading, "rho_profile": _rho_profile,
    "sharpness_edge": _sharpness_edge, "batch_fall": _batch_fall,
    "band_spikes": _band_spikes, "claim_verdicts": _claim_verdicts,
    "predicted_rate": _predicted_rate}


# ------------------------------------------------------------------------------ the body
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


def _predictions_table(path: Path) -> str:
    """A predictions file's provenance line and its settings, ranked."""
    d = json.loads(path.read_text())
    rm = d.get("rate_model", {})
    return "\n".join([
        f"Pre-registered {d.get('created', '?')}, content sha256 "
        f"`{d.get('content_sha256', 'missing')}`. P(>= 1 spike) over "
        f"{rm.get('horizon_steps', '?')} steps. {rm.get('extrapolation_note', '')}.", "",
        md_table(map(_setting_row, sorted(d.get("settings", []), key=lambda s: s.get("rank", 0))),
                 headers=["rank", "setting", "mechanism", "warmup rate / 1k [interval]",
                          "rate / 1k steps (after warmup)", "interval", "P(>= 1 spike)",
                          "shallow rho", "deep rho", "extrapolation"], max_rows=None)])


RENDERERS: dict[str, Callable[[Path], str]] = {"predictions_table": _predictions_table}


def contributions(study: Path, scale: str) -> tuple[dict, list[dict], list[dict]]:
    """The table's [study_md] and its stages' answer and report entries at `scale`, each with
    its stage's name and plan position, checked: an unknown key or kind is a ConfigError."""
    from study.reproduce import load_study     # the table's reader (it imports this module)
    plan = load_study(study, scale)
    answer, report = [], []
    for pos, (name, st) in enumerate(plan.items()):
        for key, known, out in (("answer", ANSWER_KEYS, answer), ("report", REPORT_KEYS, report)):
            entries = st.get(key, [])
            for i, e in enumerate(entries if isinstance(entries, list) else [entries]):
                where = f"{study}: stages.{name}.{key}[{i}]"
                if not isinstance(e, dict) or "order" not in e:
                    raise ConfigError(f"{where}: expected a table with an `order`")
                if key == "answer":
                    if e.get("kind") not in ANSWER_LINES or "file" not in e:
                        raise ConfigError(f"{where}: expected a `file` and a `kind` of "
                                          f"{sorted(ANSWER_LINES)}, got {e.get('kind')!r}")
                else:
                    unknown = sorted(set(e) - known)
                    if unknown:
                        raise ConfigError(f"{where}: unknown key(s) {unknown} (known: {sorted(known)})")
                    if "section" not in e or not ({"file", "figure", "text"} & set(e)):
                        raise ConfigError(f"{where}: expected a `section` and a `file`, "
                                          "`figure` or `text`")
                    if e.get("when", "reads_shipped") != "reads_shipped":
                        raise ConfigError(f"{where}: unknown when {e['when']!r} "
                                          "(known: 'reads_shipped')")
                    if "render" in e and e["render"] not in RENDERERS:
                        raise ConfigError(f"{where}: unknown render {e['render']!r} "
                                          f"(known: {sorted(RENDERERS)})")
                out.append({**e, "stage": name, "pos": pos})
    key = lambda e: (e["order"], e["pos"])          # noqa: E731
    return read_toml(study).get("study_md", {}), sorted(answer, key=key), sorted(report, key=key)


def answer_section(out: Path, opening: dict, entries: list[dict]) -> list[str]:
    """STUDY.md's opening: the question, then one line per kind of evidence found in the
    study folder, each with a link to it; empty when none was found."""
    lines, said = [], set()
    for e in entries:
        path = out / e["file"]
        if e["kind"] in said or not path.exists():
            continue
        link = f"[{e['link']}]({anchor(e['section'])})" if "section" in e else e.get("cite", "")
        got = ANSWER_LINES[e["kind"]](path, e, link)
        if got:
            said.add(e["kind"])
            lines += got
    if not lines:
        return []
    return [f"## {opening.get('answer_heading', 'The answer')}", "",
            *([opening["question"]] if opening.get("question") else []), *lines]


def _part(out: Path, e: dict, shipped_by: set[str]) -> list[str] | None:
    """One report entry's lines; None when its file or condition is absent."""
    from analysis.report import rebase_links   # inlined reports keep their links valid
    if e.get("when") == "reads_shipped" and e["stage"] not in shipped_by:
        return None
    if "figure" in e:
        if not (out / e["figure"]).exists():
            return None
        body = f"![{e.get('alt', Path(e['figure']).stem)}]({e['figure']})"
    elif "file" in e:
        path = out / e["file"]
        if not path.exists():
            return None
        if "render" in e:
            body = RENDERERS[e["render"]](path)
        else:
            body = path.read_text().strip()
            if e.get("retitle"):
                body = body.replace(*e["retitle"])
            body = rebase_links(body, str(Path(e["file"]).parent))
            if e.get("demote"):
                body = "\n".join(("#" + ln) if ln.startswith("#") else ln for ln in body.splitlines())
    else:
        body = e["text"]
    return ([f"### {e['heading']}", ""] if e.get("heading") else []) \
        + ([e["intro"], ""] if e.get("intro") else []) \
        + [body] + (["", e["note"]] if e.get("note") else [])


def report_sections(out: Path, entries: list[dict], shipped_by: set[str]) -> list[str]:
    """The body: the entries whose files exist, in order, under their sections' headings."""
    lines, current = [], None
    for e in entries:
        part = _part(out, e, shipped_by)
        if part is None:
            continue
        if e["section"] != current:
            lines += ["", f"## {e['section']}"]
            current = e["section"]
        lines += [""] + part
    return lines


def _tail(path: Path, num_lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return ""


def _core(r: dict) -> str:
    return "-" if r.get("core_seconds") is None else f"{r['core_seconds']:.1f}"


def write_study_report(out: Path, results: list[dict], scale: str = "standard", note: str = "",
                       study: Path | None = None) -> Path:
    """STUDY.md: the answer, what ran (wall and core seconds), what it produced, where to
    look; failures with their log tail. `note`: reproduce.scale_note's lines; `study`: the
    table (default configs/study.toml)."""
    from study.reproduce import STUDY     # reproduce imports this module (the writer)
    opening, answer, report = contributions(Path(study or STUDY), scale)
    shipped = str(package_data.profile_dir("llama2-70b"))
    shipped_by = {r["name"] for r in results if any(shipped in a for a in r.get("argv", []))}
    flag = {"quick": " --quick", "full": " --full"}.get(scale, "")
    cores = [r["core_seconds"] for r in results if r.get("core_seconds") is not None]
    lines = [f"# adamspike study{'' if scale == 'full' else f' ({scale})'}", "",
             f"Generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by `adamspike reproduce"
             f"{flag}`." + (f" {note}" if note else ""), ""]
    lines += answer_section(out, opening, answer)
    lines += (["", "## Stages", ""] if len(lines) > 4 else ["## Stages", ""]) + [
        md_table(([r["title"], r["status"], str(r["seconds"]), _core(r), f"`{r['log']}`"]
                  for r in results),
                 headers=["stage", "status", "seconds", "core-s", "output"], max_rows=None)]
    if cores:
        lines += ["", f"core-s: the CPU seconds (user + system) of the stage's processes, its "
                  f"workers included: {sum(cores):.0f} in all (wall seconds depend on the "
                  "machine's load and the stages beside it; core-seconds compare machines)."]
    lines += report_sections(out, report, shipped_by)
    folder = out / opening["figure_folder"] if opening.get("figure_folder") else None
    figs = sorted(folder.rglob("*.png")) if folder and folder.exists() else []
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
