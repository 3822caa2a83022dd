"""A shared helper of the paper-preset tests (test_paper_presets.py for FedSEPT, test_paper_presets_htfl.py for
FedTSP and VPDR): the cells of a paper table that a preset's dry run plans. Not a test module (no test_ prefix);
the tests import it by name (pytest puts this folder on sys.path).

A paper table is its columns and its rows as the paper prints them. A column is the config keys it fixes, dotted
({"data.dataset": "cifar100", "data.beta": 0.1}). A row is (method, {key: value}): a key without a dot is an
option of the method's own section, as in a compare entry; a dotted key is any config key
({"dcr": True, "dp.prototypes": "vpp"})."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator

Column = dict[str, Any]
Row = tuple[str, dict[str, Any]]


def planned(path: Path) -> tuple[Any, ...]:
    """The validated config of every run the preset's dry run plans (configs only: no data, no weights), planned
    once per file content (a test that edits a copy gets the copy's plan)."""
    return _planned(str(path), path.read_text())


@lru_cache(maxsize=32)
def _planned(path: str, text: str) -> tuple[Any, ...]:
    from raysim.tools.compare import plan, spec_from_args

    spec, _ = spec_from_args([path])
    return tuple(cfg for _, _, _, cfg in plan(spec, Path("/nonexistent/out")))


def value(cfg: Any, key: str) -> Any:
    """A config's value of a row or column key: a dotted key from the config, a bare one from the method's options."""
    from raysim.build import method_options
    if "." not in key:
        return getattr(method_options(cfg), key)
    out = cfg
    for part in key.split("."):
        out = getattr(out, part)
    return out


def cells(path: Path, columns: list[Column], rows: list[Row],
          where: Callable[[Any], bool]) -> Iterator[tuple[Column, str, dict[str, Any], list[Any]]]:
    """(column, method, row options, the planned runs of that cell) for every cell of the table; `where` is what
    every run of the table holds besides (its epsilon)."""
    runs = planned(path)
    for col in columns:
        for method, opts in rows:
            yield col, method, opts, [c for c in runs if c.method == method and where(c)
                                      and all(value(c, k) == v for k, v in {**col, **opts}.items())]


def assert_dry_run_lists_the_plan(path: Path, tmp_path: Path, capsys: Any, monkeypatch: Any) -> None:
    """`raysim compare PATH --dry-run` prints one line per planned run, no more and no fewer."""
    from raysim.tools.compare import main, plan, run_name, spec_from_args

    monkeypatch.chdir(tmp_path)  # no ./data, no weights here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main([str(path), "--dry-run", "--out", str(tmp_path / "out")]) == 0
    listed = {line.split(": ", 1)[0] for line in capsys.readouterr().out.splitlines() if " [" in line}
    spec, _ = spec_from_args([str(path)])
    assert listed == {run_name(e, cell, cfg, spec) for cell, e, _, cfg in plan(spec, tmp_path / "out")}
