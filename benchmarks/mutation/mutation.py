"""Mutation testing of raysim with mutmut (`make mutation`): build the flat tree mutmut runs in, and report.

    python benchmarks/mutation/mutation.py prepare   # build/mutation: the tree mutmut mutates
    python benchmarks/mutation/mutation.py report    # per-file counts and the score, from `mutmut results`

mutmut copies its `source_paths` into mutants/ and puts mutants/ first on sys.path, so that the tests import the
mutated copy. The repository maps methods/, privacy/ and attacks/ into the raysim package through pyproject's
package-dir (an editable install), which mutmut's copy would bypass (the tests would import the clean files and
every mutant would "survive"). In the flat tree methods/, privacy/ and attacks/ sit inside raysim/, so the plain
import system finds raysim.privacy in mutants/raysim/privacy. The scope and the tests mutmut runs are
[tool.mutmut] in pyproject.toml; the triage of the survivors is in docs/testing.md, "Mutation testing".

Score = killed / (killed + survived + no tests), where a timeout counts as killed (the mutant made the tests hang)
and "no tests" means no selected test runs the mutated function (it survives by not being looked at)."""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / "build" / "mutation"
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "mutants")
KILLED = {"killed", "timeout"}


def prepare(out: Path = TREE) -> Path:
    """A fresh flat tree at `out` (any earlier one, mutants and mutmut's cache included, is removed)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shutil.copytree(ROOT / "raysim", out / "raysim", ignore=IGNORE)
    for part in ("methods", "privacy", "attacks"):
        shutil.copytree(ROOT / part, out / "raysim" / part, ignore=IGNORE)
    for extra in ("tests", "docs", "benchmarks"):  # tests read docs pages and table specs beside the code
        shutil.copytree(ROOT / extra, out / extra, ignore=IGNORE)
    for name in ("pyproject.toml", "mkdocs.yml", "README.md"):
        shutil.copy2(ROOT / name, out / name)
    return out


def results(tree: Path = TREE) -> dict[str, str]:
    """{mutant name: status} for every mutant of the last `mutmut run` in `tree`."""
    mutmut = Path(sys.executable).with_name("mutmut")
    out = subprocess.run([str(mutmut), "results", "--all", "true"], cwd=tree, capture_output=True, text=True, check=True)
    status = {}
    for line in out.stdout.splitlines():
        name, sep, state = line.strip().rpartition(": ")
        if sep and name:
            status[name] = state.strip()
    return status


def module_of(mutant: str) -> str:
    """raysim.privacy.accountant.x_check_steps__mutmut_4 -> raysim.privacy.accountant"""
    head = mutant.split("__mutmut_")[0]
    parts = head.split(".")
    while parts and (parts[-1].startswith("x_") or parts[-1].startswith("xǁ")):
        parts.pop()
    return ".".join(parts) if parts else head


def score(counts: collections.Counter) -> float:
    killed = sum(counts[s] for s in KILLED)
    looked = killed + counts["survived"] + counts["no tests"]
    return 100.0 * killed / looked if looked else float("nan")


def report(tree: Path = TREE) -> str:
    status = results(tree)
    if not status:
        raise SystemExit(f"no mutmut results in {tree}: run `make mutation` first")
    per_module: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for name, state in status.items():
        per_module[module_of(name)][state] += 1
    total: collections.Counter = collections.Counter()
    states = ["killed", "timeout", "survived", "no tests", "suspicious", "skipped"]
    lines = ["| module | " + " | ".join(states) + " | score % |", "|---" * (len(states) + 2) + "|"]
    for module in sorted(per_module):
        c = per_module[module]
        total.update(c)
        lines.append(f"| {module} | " + " | ".join(str(c[s]) for s in states) + f" | {score(c):.1f} |")
    lines.append("| **all** | " + " | ".join(str(total[s]) for s in states) + f" | **{score(total):.1f}** |")
    others = sorted(set(total) - set(states))
    if others:
        lines.append(f"\nother states: {', '.join(f'{s} {total[s]}' for s in others)}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["prepare", "report"])
    parser.add_argument("--tree", type=Path, default=TREE)
    args = parser.parse_args()
    if args.command == "prepare":
        print(prepare(args.tree))
    else:
        print(report(args.tree))


if __name__ == "__main__":
    main()
