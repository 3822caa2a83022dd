"""Quoted tables in docs/papers/ against the commands that measured them (issue #46 item 7; raysim/tools/doc_tables.py).

Offline, nothing trained: every marked table must be the table rendered from its committed result file, and the
result file's plan digest must be that of today's plan of its command. Then the checker itself: a number edited in
the docs, a marker naming another command and an edited spec each make it fail, and the record tool writes a file
the checker accepts (a zero-shot comparison of one round on the tiny model: evaluation only).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from raysim.tools.doc_tables import Recorded, check_docs, check_marked, marked_tables, pack_plan, plan_digest, today_plan

ROOT = Path(__file__).resolve().parents[1]
PAPERS = ROOT / "docs" / "papers"
TINY = ["data.dataset=digits", "data.shots=8", "model.name=raysim-tiny", "model.pretrained=", "train.num_clients=3",
        "train.n_ctx=4", "execution.backend=inline", "output.tensorboard=false"]


def test_every_marked_table_is_its_recorded_table_of_todays_plan():
    marked, problems = check_docs(PAPERS, ROOT)
    assert marked, "no marked table in docs/papers/: the check would pass vacuously"
    assert not problems, "\n".join(problems)


def _first_marked() -> tuple[Path, str, int]:
    for doc in sorted(PAPERS.glob("*.md")):
        text = doc.read_text()
        found = marked_tables(doc, text)
        if found:
            return doc, text, found[0].line
    raise AssertionError("no marked table in docs/papers/")


def test_a_number_edited_by_hand_fails():
    doc, text, line = _first_marked()
    lines = text.splitlines()
    row = line + 2  # the marker, the header, the rule (0-based index of the first data row)
    cells = lines[row].split("|")
    cells[-2] = cells[-2].replace(".", ",", 1) if "." in cells[-2] else cells[-2] + "1"  # e.g. 54.70 -> 54,70
    lines[row] = "|".join(cells)
    edited = marked_tables(doc, "\n".join(lines))[0]
    problems = check_marked(edited, ROOT)
    assert len(problems) == 1 and "differs from" in problems[0] and "row 3" in problems[0], problems


def test_a_marker_naming_another_command_fails():
    doc, text, line = _first_marked()
    lines = text.splitlines()
    lines[line - 1] = lines[line - 1].replace(" -->", " --rounds 99 -->")
    problems = check_marked(marked_tables(doc, "\n".join(lines))[0], ROOT)
    assert any("the marker names" in p for p in problems), problems


def test_an_edited_spec_fails_naming_the_key_and_the_commands(tmp_path):
    """A result file recorded from a spec; the spec then changes (the rounds, the clients): the check names the key
    that moved and says what to re-run and update. The digest covers train.rounds though a resume may grow it. (A
    changed default reaches the plan the same way: as a changed value of every run's config.)"""
    spec = tmp_path / "t.yaml"
    spec.write_text("layout: in_cross\nrounds: 2\nmethods: [zeroshot, promptfl]\n"
                    "setting: {data: {dataset: digits}, train: {num_clients: 3}}\n")
    result = tmp_path / "results" / "t.json"

    argv = [str(spec)]
    runs = today_plan(argv)
    table = {"header": ["In-Client", "Cross-Client", "HM"], "rows": ["zeroshot", "promptfl"],
             "values": [[0.5, 0.5, 0.5], [0.6, 0.4, 0.48]]}
    rec = Recorded(command=f"raysim compare {spec}", plan_digest=plan_digest(runs), plan=pack_plan(runs), title="t", table=table)
    rec.write(result)
    doc = tmp_path / "page.md"
    doc.write_text(f"text\n\n<!-- table: {result.relative_to(tmp_path)} via {rec.command} -->\n{rec.rendered()}\n\nmore\n")
    assert check_docs(tmp_path, tmp_path)[1] == []
    spec.write_text(spec.read_text().replace("rounds: 2", "rounds: 3"))
    (problem,) = check_docs(tmp_path, tmp_path)[1]
    assert "train.rounds: 2 -> 3 (2 runs)" in problem and f"re-run `raysim compare {spec} --out OUT`" in problem
    assert f"update {result.relative_to(tmp_path)}" in problem
    spec.write_text(spec.read_text().replace("rounds: 3", "rounds: 2").replace("num_clients: 3", "num_clients: 4"))
    (problem,) = check_docs(tmp_path, tmp_path)[1]
    assert "train.num_clients: 3 -> 4 (2 runs)" in problem
    stored = json.loads(result.read_text())
    assert stored["plan"]["common"]["train.num_clients"] == "3" and stored["plan"]["runs"][1][1]["method"] == "'promptfl'"
    assert "train.num_clients" not in stored["plan"]["runs"][1][1]  # stored once, in common


def test_the_record_tool_writes_what_the_check_accepts(tmp_path):
    """`raysim compare ... --out OUT`, then benchmarks/record_table.py: its file, pasted under its marker, passes;
    a comparison not run yet is refused in one line naming the command to run."""
    import importlib.util

    from raysim.tools.compare import main as compare

    spec_ = importlib.util.spec_from_file_location("record_table", ROOT / "benchmarks" / "record_table.py")
    tool = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(tool)
    args = ["--methods", "zeroshot", "--rounds", "1", *TINY]
    out, result = tmp_path / "out", tmp_path / "results" / "z.json"
    assert tool.main(["--out", str(out), "--to", str(result), *args]) == 2  # nothing run yet
    assert not result.exists()
    assert compare([*args, "--out", str(out), "--max-concurrent", "1"]) == 0
    assert tool.main(["--out", str(out), "--to", str(result), *args]) == 0
    rec = Recorded.read(result)
    table_md = (out / "table.md").read_text()
    assert rec.rendered() in table_md  # compare's own table, rendered by the same code
    doc = tmp_path / "page.md"
    doc.write_text(f"<!-- table: {result.relative_to(tmp_path)} via {rec.command} -->\n{rec.rendered()}\n")
    assert check_docs(tmp_path, tmp_path)[1] == []
    shutil.rmtree(out)


def test_a_malformed_marker_is_refused_naming_the_line(tmp_path):
    from raysim.errors import ConfigError

    doc = tmp_path / "p.md"
    doc.write_text("a\n<!-- table: x.json -->\n| a |\n")
    with pytest.raises(ConfigError, match=r"p\.md:2: a table marker reads"):
        marked_tables(doc)
    doc.write_text("```markdown\n<!-- table: x.json via raysim compare x.yaml -->\n| a |\n```\n")
    assert marked_tables(doc) == []  # an example in a code block is no marker
