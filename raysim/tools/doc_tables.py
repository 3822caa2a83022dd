"""Quoted tables in docs/papers/ tied to the command that measured them (issue #46 item 7).

A quoted table is marked by an HTML comment on the line right above it:

    <!-- table: benchmarks/results/fedsept_ablation.json via raysim compare benchmarks/tables/fedsept_ablation.yaml -->

The result file (`record`, written by `python benchmarks/record_table.py`) holds what `raysim compare` measured: the
layout's Table (its cells, marks and notes, as compare renders them) and the PLAN it came from: every run's config
as `compare.plan` builds it today, less its output folder and the keys a resumed run may change
(`Config.resumable_keys`: execution, caching, data_root; train.rounds is kept), which `raysim compare` itself ignores
when it reads a finished run back. `check_marked_tables` (tests/test_docs_tables.py) then says, for every marked table, whether

- the Markdown in the docs is the table rendered from the result file (`Table.markdown`, compare's own renderer),
  so a number edited by hand fails;
- the marker's command is the one the result file was recorded from;
- today's plan of that command is the recorded one (its sha256 digest), so a change of the spec or of a default
  that would change a run fails, naming the keys that moved and the commands that update the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shlex
from pathlib import Path
from typing import Any, Sequence

from raysim.errors import ConfigError, shown

MARKER = re.compile(r"^<!-- table: (?P<file>\S+) via (?P<command>raysim compare .+?) -->$")
FORMAT = 1  # the result file's layout; a file of another format is refused (re-record it)

Plan = list[tuple[str, dict[str, str]]]  # (run name, {dotted key: repr(value)}) of every planned run, in order


def compare_argv(command: str) -> list[str]:
    """`raysim compare SPEC key=value` -> [SPEC, key=value]."""
    words = shlex.split(command)
    if words[:2] != ["raysim", "compare"]:
        raise ConfigError(f"{shown(command)}: a recorded table's command is `raysim compare ...`")
    return words[2:]


def today_plan(argv: Sequence[str]) -> Plan:
    """Every run `raysim compare ARGV` plans today, each as its config less the output section and the resumable
    keys but train.rounds (what compare compares when it reads a finished run back:
    raysim.storage.runfolder.RunFolder.differences, which lets a resume add rounds)."""
    from raysim.storage.runfolder import flat
    from raysim.tools.compare import plan, run_name, spec_from_args

    if any(a == "--out" or a.startswith("--out=") for a in argv):
        raise ConfigError("a recorded table's command names no --out (the run folders are not part of the plan)")
    spec, _ = spec_from_args(list(argv))
    runs = plan(spec, Path("plan-of-record"))  # configs only: nothing is read from or written to this folder
    out: Plan = []
    for cell, entry, _, cfg in runs:
        skip = cfg.resumable_keys() - {"train.rounds"}  # a resumed run may grow its rounds; a table's rounds are its own
        out.append((run_name(entry, cell, cfg, spec),
                    {k: repr(v) for k, v in sorted(flat(cfg).items()) if k not in skip and not k.startswith("output.")}))
    return out


def plan_digest(runs: Plan) -> str:
    return hashlib.sha256(json.dumps([[name, sorted(cfg.items())] for name, cfg in runs]).encode()).hexdigest()


def pack_plan(runs: Plan) -> dict[str, Any]:
    """A plan stored small: the keys every run shares once, each run's own keys beside its name."""
    common = dict(runs[0][1]) if runs else {}
    for _, cfg in runs[1:]:
        common = {k: v for k, v in common.items() if cfg.get(k) == v}
    return {"common": common, "runs": [[name, {k: v for k, v in cfg.items() if k not in common}] for name, cfg in runs]}


def unpack_plan(packed: dict[str, Any]) -> Plan:
    return [(str(name), {**packed["common"], **own}) for name, own in packed["runs"]]


def plan_changes(recorded: Plan, today: Plan, limit: int = 6) -> list[str]:
    """What moved between two plans, one phrase each (at most `limit`)."""
    names_then, names_now = [n for n, _ in recorded], [n for n, _ in today]
    if names_then != names_now:
        gone, new = sorted(set(names_then) - set(names_now)), sorted(set(names_now) - set(names_then))
        return [f"runs {'removed ' + shown(gone) if gone else ''}{' ' if gone and new else ''}{'added ' + shown(new) if new else ''}"
                .strip() if gone or new else "runs reordered"]
    moved: dict[str, list[str]] = {}
    for (name, then), (_, now) in zip(recorded, today):
        for k in sorted(set(then) | set(now)):
            if then.get(k) != now.get(k):
                moved.setdefault(f"{k}: {then.get(k, '(absent)')} -> {now.get(k, '(absent)')}", []).append(name)
    return [f"{what} ({len(runs)} run{'s' * (len(runs) > 1)})" for what, runs in list(moved.items())[:limit]]


@dataclasses.dataclass
class Recorded:
    """One result file: the command, the digest and packed copy of its plan, and the table compare rendered."""

    command: str
    plan_digest: str
    plan: dict[str, Any]
    title: str
    table: dict[str, Any]  # raysim.tools.layouts.Table's fields

    def rendered(self) -> str:
        """The table's Markdown rows as `raysim compare` prints them (header, rule, one line per entry)."""
        from raysim.tools.layouts import Table

        text = Table(**self.table).markdown()
        return "\n".join(line for line in text.splitlines() if line.startswith("|"))

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"format": FORMAT, **dataclasses.asdict(self)}
        path.write_text(json.dumps(body, indent=1, sort_keys=False) + "\n")

    @classmethod
    def read(cls, path: Path) -> "Recorded":
        try:
            body = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: not a readable result file ({type(e).__name__}); re-record it with "
                              "python benchmarks/record_table.py") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise ConfigError(f"{path}: not a result file of format {FORMAT}; re-record it with python benchmarks/record_table.py")
        body.pop("format")
        return cls(**body)


def record(*, argv: Sequence[str], out: Path) -> Recorded:
    """The table of `raysim compare ARGV --out OUT`, read back from OUT's finished runs, with today's plan.
    Every run must be finished there with today's settings (else: which to finish or redo)."""
    from raysim.tools.compare import describe, earlier_run, plan, same_runs, spec_from_args
    from raysim.tools.layouts import LAYOUTS, RunRecord

    runs_today = today_plan(argv)
    spec, _ = spec_from_args(list(argv))
    configs = plan(spec, out)
    same = same_runs(configs)
    command = shlex.join(["raysim", "compare", *argv])
    records = []
    for i, (cell, entry, _, cfg) in enumerate(configs):
        source = configs[same.get(i, i)][2]  # a cell made by an earlier run of the same config reads that run
        state = earlier_run(source, cfg)  # a run there with other settings is refused, naming them
        if state != "finished":
            raise ConfigError(f"{source}: that run is {'not there' if state == 'none' else 'not finished'}; run "
                              f"`{command} --out {out}` first (it resumes), then record")
        records.append(RunRecord(entry, cell, source, 0.0, seed=cfg.train.seed if spec.seeds else None))
    table = LAYOUTS.get(spec.layout)().table(records, spec)
    title = f"{spec.title or spec.layout + ' comparison'}: {describe(records, spec)}"
    return Recorded(command=command, plan_digest=plan_digest(runs_today), plan=pack_plan(runs_today), title=title,
                    table=dataclasses.asdict(table))


@dataclasses.dataclass(frozen=True)
class Marked:
    doc: Path
    line: int  # 1-based line of the marker
    result: str  # the result file, relative to the repository root
    command: str
    table: str  # the Markdown table under the marker (its | lines)


def marked_tables(doc: Path, text: str | None = None) -> list[Marked]:
    """Every marked table of a Markdown page: the marker line, then the table's | lines right under it (a marker
    inside a fenced code block is an example, not a marker)."""
    lines = (doc.read_text() if text is None else text).splitlines()
    out = []
    fenced = False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        m = MARKER.match(line.strip())
        if m is None:
            if line.strip().startswith("<!-- table:"):
                raise ConfigError(f"{doc}:{i + 1}: a table marker reads `<!-- table: FILE via raysim compare ... -->`")
            continue
        rows = []
        for below in lines[i + 1:]:
            if not below.startswith("|"):
                break
            rows.append(below.rstrip())
        out.append(Marked(doc, i + 1, m["file"], m["command"], "\n".join(rows)))
    return out


def check_marked(marked: Marked, root: Path) -> list[str]:
    """What is wrong with one marked table ([] = it is the recorded table of today's plan)."""
    where = f"{marked.doc.name}:{marked.line}"
    path = root / marked.result
    if not path.is_file():
        return [f"{where}: {marked.result} does not exist; run `{marked.command} --out OUT` and "
                f"`python benchmarks/record_table.py --out OUT --to {marked.result} {shlex.join(compare_argv(marked.command))}`"]
    rec = Recorded.read(path)
    update = (f"re-run `{rec.command} --out OUT` and update {marked.result} "
              f"(python benchmarks/record_table.py --out OUT --to {marked.result} {shlex.join(compare_argv(rec.command))})")
    problems = []
    if marked.command != rec.command:
        problems.append(f"{where}: the marker names `{marked.command}`, {marked.result} was recorded from `{rec.command}`")
    if not marked.table:
        problems.append(f"{where}: no Markdown table right under the marker")
    elif marked.table != rec.rendered():
        doc_rows, rec_rows = marked.table.splitlines(), rec.rendered().splitlines()
        first = next((i for i, (a, b) in enumerate(zip(doc_rows, rec_rows)) if a != b), min(len(doc_rows), len(rec_rows)))
        doc_row = doc_rows[first] if first < len(doc_rows) else "(no row)"
        rec_row = rec_rows[first] if first < len(rec_rows) else "(no row)"
        problems.append(f"{where}: the table differs from {marked.result} at its row {first + 1}: the docs have "
                        f"{shown(doc_row)}, the result file {shown(rec_row)}; paste the recorded table (Recorded.rendered)")
    # the command's spec is named from the repository root, wherever the check runs from
    argv = [str(root / a) if a.endswith((".yaml", ".yml")) and not Path(a).is_absolute() else a for a in compare_argv(rec.command)]
    today = today_plan(argv)
    if plan_digest(today) != rec.plan_digest:
        changes = plan_changes(unpack_plan(rec.plan), today)
        problems.append(f"{where}: today's plan of `{rec.command}` is not the one {marked.result} was measured on "
                        f"({'; '.join(changes) or 'the stored plan does not match its digest'}); {update}")
    return problems


def check_docs(docs: Path, root: Path) -> tuple[list[Marked], list[str]]:
    """Every marked table under docs/ (each *.md) and what is wrong with each."""
    marked = [m for doc in sorted(docs.glob("*.md")) for m in marked_tables(doc)]
    return marked, [p for m in marked for p in check_marked(m, root)]
