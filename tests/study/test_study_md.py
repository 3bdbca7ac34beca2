"""STUDY.md is written from the study table and the reports' own data (study/study_md.py):
a stage added to the table appears in it with no change to the writer; each stage's row
says its core-seconds."""

import json
import re
from pathlib import Path

import pytest

from adamspike.config import ConfigError
from study import study_md
from study.reproduce import STUDY, load_study, main

ADDED = """
[study_md]
answer_heading = "The answer, in one minute"
question = "What does the added stage say?"

[stages.added]
title = "A stage added to the table"
args = ["theory", "all", "--json"]
outputs = ["added/theory.json"]
stdout_to = "added/theory.json"

[[stages.added.report]]
section = "The added stage's numbers"
order = 1
file = "added/theory.json"
intro = "The closed forms, as the added stage wrote them:"

[[stages.added.report]]            # a file no stage wrote: says nothing
section = "Never written"
order = 2
file = "added/absent.md"

[[stages.added.answer]]            # evidence absent: no line, and no opening
kind = "rho_profile"
order = 1
file = "added/fit.json"
link = "ladder"
section = "The added stage's numbers"
"""


def test_a_stage_added_to_the_table_appears_in_study_md(tmp_path):
    """A real `reproduce` on a table holding one new stage: its section with its file
    inlined, its row with wall and core seconds (the stage's process CPU time)."""
    table = tmp_path / "study.toml"
    table.write_text(ADDED)
    out = tmp_path / "study"
    assert main(["--study", str(table), "--out", str(out), "--jobs", "1"]) == 0
    report = (out / "STUDY.md").read_text()
    assert "## The added stage's numbers" in report
    assert "The closed forms, as the added stage wrote them:" in report
    assert (out / "added" / "theory.json").read_text().strip() in report
    assert "Never written" not in report and "The answer, in one minute" not in report
    row = next(ln for ln in report.splitlines() if ln.startswith("| A stage added"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "ok" and float(cells[2]) > 0 and float(cells[3]) > 0, row
    assert json.loads((out / "stages.json").read_text())[0]["core_seconds"] == pytest.approx(float(cells[3]), abs=0.05)
    assert "core-s: the CPU seconds" in report


def test_the_answer_and_sections_come_from_the_table_and_the_files(tmp_path):
    """The writer reads what the table declares: an answer line from a file of a known kind
    with its link to the declaring stage's section, the first existing file per kind, parts
    sharing a section under one heading, a demoted report, a `reads_shipped` note only for
    a stage whose argv read the shipped fit."""
    table = tmp_path / "study.toml"
    table.write_text("""
[study_md]
answer_heading = "The answer, in one minute"
question = "Q."

[stages.a]
args = ["theory"]
[[stages.a.answer]]
kind = "rho_profile"
order = 2
file = "a/fit.json"
link = "rung fit"
section = "Rungs: the fit"
[[stages.a.answer]]
kind = "rho_profile"
order = 3
file = "b/fit.json"
cite = "the copy"
[[stages.a.report]]
section = "Rungs: the fit"
order = 5
file = "a/report.md"
demote = true
[[stages.a.report]]
section = "Rungs: the fit"
order = 6
when = "reads_shipped"
text = "Read from the shipped fit."

[stages.b]
args = ["theory"]
[[stages.b.report]]
section = "Second"
order = 1
file = "b/report.md"
""")
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "fit.json").write_text(json.dumps({"llama2_70b": {"rho": {d: 0.5}}}))
    (tmp_path / "a" / "report.md").write_text("## Fit\n\nsee [the table](fit.csv)\n")
    (tmp_path / "b" / "report.md").write_text("second stage")
    results = [{"name": n, "title": n, "status": "ok", "seconds": 1.0, "core_seconds": 2.5,
                "log": f"logs/{n}.log", "argv": ["theory"]} for n in ("a", "b")]
    text = study_md.write_study_report(tmp_path, results, "quick", study=table).read_text()
    lines = text.splitlines()
    # the answer: the first existing file of the kind, its link to the section's heading
    assert "- **Where it sits** ([rung fit](#rungs-the-fit)): rho = rms(g) / eps per depth group a 0.5" in text
    assert "the copy" not in text and lines.index("## The answer, in one minute") < lines.index("## Stages")
    # sections in the table's order, the file's headings demoted and its links rebased
    assert lines.index("## Second") < lines.index("## Rungs: the fit") and text.count("## Rungs") == 1
    assert "### Fit" in lines and "[the table](a/fit.csv)" in text
    assert "Read from the shipped fit." not in text
    shipped = str(study_md.package_data.profile_dir("llama2-70b"))
    results[0]["argv"] = ["theory", f"{shipped}/ladder"]
    assert "Read from the shipped fit." in study_md.write_study_report(
        tmp_path, results, "quick", study=table).read_text()
    assert "| a | ok | 1.0 | 2.5 |" in text and "5 in all" in text


def test_a_bad_study_md_entry_is_refused_before_anything_runs(tmp_path, capsys):
    table = tmp_path / "study.toml"
    table.write_text('[stages.a]\nargs = ["theory"]\n[[stages.a.answer]]\nkind = "guess"\n'
                     'order = 1\nfile = "x.json"\n')
    assert main(["--study", str(table), "--out", str(tmp_path / "o")]) == 2
    assert "stages.a.answer[0]" in capsys.readouterr().err and not (tmp_path / "o").exists()
    table.write_text('[stages.a]\nargs = ["theory"]\n[[stages.a.report]]\nsection = "s"\n'
                     'order = 1\nfile = "x.md"\nplace = "top"\n')
    with pytest.raises(ConfigError, match=r"stages.a.report\[0\]: unknown key\(s\) \['place'\]"):
        study_md.contributions(table, "full")


def test_the_writer_names_no_stage():
    """Every stage of configs/study.toml is data to the writer: no stage name is quoted in
    its code (a stage's STUDY.md part is its table's `report` / `answer` entries)."""
    source = Path(study_md.__file__).read_text()
    named = [n for n in load_study(STUDY, "full") if re.search(rf"[\"']{n}[\"']", source)]
    assert not named, named
    opening, answer, report = study_md.contributions(STUDY, "full")
    assert opening["answer_heading"] == "The answer, in one minute"
    kinds = [e["kind"] for e in answer]
    assert kinds[0] == "plan_reading" and set(kinds) == set(study_md.ANSWER_LINES)
