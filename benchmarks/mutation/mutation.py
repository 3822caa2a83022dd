"""Mutation testing of raysim with mutmut (`make mutation`): build the flat tree mutmut runs in, and report.

    python benchmarks/mutation/mutation.py prepare   # build/mutation: the tree mutmut mutates
    python benchmarks/mutation/mutation.py prepare --scope stepper --tree build/mutation-stepper   # a second scope
    python benchmarks/mutation/mutation.py report    # per-file counts and the score, from `mutmut results`
    python benchmarks/mutation/mutation.py triage    # the survivors by kind, and the open ones by function
    python benchmarks/mutation/mutation.py diffs     # each open survivor's changed line, before and after
    python benchmarks/mutation/mutation.py kill MUTANT... --test tests/x.py::test_y   # does a new test kill them?

mutmut copies its `source_paths` into mutants/ and puts mutants/ first on sys.path, so that the tests import the
mutated copy. The repository maps methods/, privacy/ and attacks/ into the raysim package through pyproject's
package-dir (an editable install), which mutmut's copy would bypass (the tests would import the clean files and
every mutant would "survive"). In the flat tree methods/, privacy/ and attacks/ sit inside raysim/, so the plain
import system finds raysim.privacy in mutants/raysim/privacy. The scope and the tests mutmut runs are
[tool.mutmut] in pyproject.toml; a second scope, [tool.raysim.mutation.SCOPE] (its own `only_mutate` and test
selection), replaces those two keys in the tree's copy with `prepare --scope SCOPE`: the DP-SGD stepper and the host's
privacy handle are run against the fast tests that reach them, not against the whole-run tests of the first scope
(20-60 s a mutant there). The triage of the survivors is in docs/testing.md, "Mutation testing".

Score = killed / (killed + survived + no tests), where a timeout counts as killed (the mutant made the tests hang)
and "no tests" means no selected test runs the mutated function (it survives by not being looked at)."""

from __future__ import annotations

import argparse
import collections
import fnmatch
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / "build" / "mutation"
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "mutants")
KILLED = {"killed", "timeout", "segfault"}  # segfault: a mutant that hung was stopped by signal (a timeout)


SCOPED_KEYS = ("only_mutate", "pytest_add_cli_args_test_selection")


def scoped_pyproject(text: str, scope: str) -> str:
    """pyproject.toml's text with [tool.mutmut]'s scope keys replaced by those of [tool.raysim.mutation.<scope>]."""
    import tomllib  # Python 3.11+, as below

    scopes = tomllib.loads(text).get("tool", {}).get("raysim", {}).get("mutation", {})
    if scope not in scopes:
        raise SystemExit(f"no mutation scope {scope!r} in pyproject.toml (known: {', '.join(sorted(scopes)) or 'none'}); "
                         "add a [tool.raysim.mutation.<scope>] table with only_mutate and pytest_add_cli_args_test_selection")
    head, sep, rest = text.partition("[tool.mutmut]")
    body, nxt, tail = rest.partition("\n[")
    for key in SCOPED_KEYS:
        found = re.search(rf"^{key} = \[", body, flags=re.M)
        if found is None:
            raise SystemExit(f"[tool.mutmut] in pyproject.toml has no {key} to replace")
        # the array ends at the first "]" after which the text from "[" parses as TOML (a "]" may sit in a string)
        end = next(i + 1 for i in range(found.end(), len(body)) if body[i] == "]" and _parses(body[found.end() - 1:i + 1]))
        body = body[:found.start()] + f"{key} = {json.dumps(scopes[scope][key])}" + body[end:]
    return head + sep + body + nxt + tail


def _parses(array: str) -> bool:
    import tomllib

    try:
        tomllib.loads(f"x = {array}")
        return True
    except tomllib.TOMLDecodeError:
        return False


def prepare(out: Path = TREE, scope: str = "") -> Path:
    """A fresh flat tree at `out` (any earlier one, mutants and mutmut's cache included, is removed); with
    `scope`, its pyproject's [tool.mutmut] mutates and runs what [tool.raysim.mutation.<scope>] names."""
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
    if scope:
        pyproject = out / "pyproject.toml"
        pyproject.write_text(scoped_pyproject(pyproject.read_text("utf-8"), scope), "utf-8")
    return out


RESULTS: Path | None = None  # a saved `mutmut results --all true` listing to read instead (--results)


def results(tree: Path = TREE) -> dict[str, str]:
    """{mutant name: status} for every mutant of the last `mutmut run` in `tree` (or of the --results listing)."""
    if RESULTS is not None:
        text = RESULTS.read_text("utf-8")
    else:
        mutmut = Path(sys.executable).with_name("mutmut")
        text = subprocess.run([str(mutmut), "results", "--all", "true"], cwd=tree, capture_output=True, text=True,
                              check=True).stdout
    status = {}
    for line in text.splitlines():
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


def in_scope(module: str, tree: Path = TREE) -> bool:
    """Whether `module` (raysim.privacy.accountant) is a file [tool.mutmut] only_mutate names (a tree mutated with a
    wider scope before, or mutmut's own listing, may hold others)."""
    path = module.replace(".", "/") + ".py"
    return any(fnmatch.fnmatch(path, p) for p in _only_mutate(tree))


@functools.lru_cache(maxsize=None)
def _only_mutate(tree: Path) -> tuple[str, ...]:
    """[tool.mutmut] only_mutate of the tree's pyproject.toml, read once per tree."""
    import tomllib  # Python 3.11+ (the project's tested Python; 3.10 users: pip install tomli and import it as tomllib)

    config = tomllib.loads((tree / "pyproject.toml").read_text("utf-8"))["tool"]["mutmut"]
    return tuple(config.get("only_mutate", ["*"]))


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
        if in_scope(module_of(name), tree):
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


# ---------------------------------------------------------------------------------------- triage
# Each surviving mutant's changed line, from mutants/<file>.py (mutmut keeps every mutant there as a function beside
# `<name>__mutmut_orig`), sorted into the kinds that cannot change a run's numbers on the machines the tests run on,
# and the rest ("open": a test could kill it). The kinds, checked in this order:
KINDS = {
    "message": "only the text of an error message or assertion changes (or the message is dropped): the check itself "
               "is unchanged; the messages users act on are asserted in tests/privacy/test_privacy_domains.py",
    "device": "a device= / dtype= argument dropped or set to None, or .to(None): the same tensor on the CPU in float32 "
              "/ float64, where these tests run (the GPU paths are timed by benchmarks/gpu_paths.py)",
    "default": "a keyword default changes that every caller in the package overrides",
    "symmetric": "the sign of zero-mean symmetric noise (t - noise, -E for an exponential difference, c - N(0, s^2)): the same "
                 "distribution, so the same privacy and the same expected result",
}


NEUTRAL = Path(__file__).with_name("neutral.toml")  # survivors judged behaviour-neutral by hand, with the reason


def _norm(line: str) -> str:
    return " ".join(line.split())


@functools.lru_cache(maxsize=None)
def judged(path: Path = NEUTRAL) -> dict[tuple[str, str], str]:
    """{(function, mutated line): why} from neutral.toml. A mutant is matched by its function and the text of its
    changed line, not by its number (mutmut renumbers when a function changes); when the code of that line changes,
    the entry stops matching and the mutant is open again, to be judged anew."""
    import tomllib

    out = {}
    for entry in tomllib.loads(path.read_text("utf-8")).get("neutral", []):
        for line in entry["lines"]:
            out[(entry["function"], _norm(line))] = entry["why"]
    return out


def _changed(orig: str, mutant: str) -> tuple[str, str]:
    import difflib

    minus, plus = [], []
    for line in difflib.ndiff(orig.splitlines(), mutant.splitlines()):
        if line.startswith("- "):
            minus.append(line[2:].strip())
        elif line.startswith("+ "):
            plus.append(line[2:].strip())
    return " ".join(minus), " ".join(plus)


def kind_of(orig: str, mutant: str) -> str:
    import re

    a, b = _changed(orig, mutant)
    strip = re.compile(r"(f?\"[^\"]*\"|f?'[^']*'|None)")

    def masked(line: str) -> str:  # every string literal (adjacent ones concatenated) and None as one S
        return re.sub(r"S(\s+S)+", "S", strip.sub("S", line))

    if a.startswith(("raise ", "assert ")) or "raise " in a or " assert " in f" {a}":
        if masked(a) == masked(b) or re.sub(r",\s*(f?\"[^\"]*\"|f?'[^']*')\s*$", "", a) == b:
            return "message"
    if a and masked(a) == "S" and masked(b) == "S":  # a line of string literals only: a message continued
        return "message"
    if re.search(r"(device|dtype)=", a) or ".to(" in a:
        if re.sub(r"(device|dtype)=[^,()]+|\.to\([^()]*\)", "", a).replace(" ", "").replace(",", "") == \
                re.sub(r"(device|dtype)=[^,()]+|\.to\([^()]*\)", "", b).replace(" ", "").replace(",", ""):
            return "device"
    if a.startswith("def ") and b.startswith("def "):
        return "default"
    noisy = "noise" in a or "log1p" in a or "_randn(" in a
    if re.sub(r"\s", "", a).replace("-", "+") == re.sub(r"\s", "", b).replace("-", "+") and noisy:
        return "symmetric"
    return "open"


def triage(tree: Path = TREE) -> tuple[dict[str, int], dict[str, list[tuple[str, str, str]]]]:
    """(count per kind, {function: [(mutant, line before, line after) of each open mutant]}) over the surviving
    mutants in scope."""
    import ast

    sources: dict[str, dict[str, str]] = {}
    counts: collections.Counter = collections.Counter()
    open_: dict[str, list[str]] = collections.defaultdict(list)
    for name, state in sorted(results(tree).items()):
        module = module_of(name)
        if state != "survived" or not in_scope(module, tree):
            continue
        if module not in sources:
            text = (tree / "mutants" / (module.replace(".", "/") + ".py")).read_text("utf-8")
            sources[module] = {n.name: ast.get_source_segment(text, n) or ""
                               for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef)}
        func = name[len(module) + 1:]
        orig_name = func.split("__mutmut_")[0] + "__mutmut_orig"
        orig = sources[module].get(orig_name, "")
        mutant = sources[module].get(func, "").replace(func, orig_name, 1)  # the def line names the mutant
        kind = kind_of(orig, mutant)
        a, b = _changed(orig, mutant)
        bare = func.split("__mutmut_")[0].removeprefix("xǁ").removeprefix("x_").replace("ǁ", ".")
        if kind == "open" and (f"{module}.{bare}", _norm(b)) in judged():
            kind = "judged"
        counts[kind] += 1
        if kind == "open":
            open_[f"{module}.{bare}"].append((name, a, b))
    return dict(counts), dict(open_)


def triage_report(tree: Path = TREE) -> str:
    counts, open_ = triage(tree)
    lines = ["| kind | survivors | why it cannot change a result |", "|---|---|---|"]
    for kind, why in KINDS.items():
        lines.append(f"| {kind} | {counts.get(kind, 0)} | {why} |")
    lines.append(f"| judged | {counts.get('judged', 0)} | judged behaviour-neutral by hand: each line and its reason in "
                 f"benchmarks/mutation/neutral.toml |")
    lines.append(f"| open | {counts.get('open', 0)} | a test could kill it: listed below by function |")
    lines.append("")
    for func in sorted(open_, key=lambda f: -len(open_[f])):
        lines.append(f"- `{func}` ({len(open_[func])})")
    return "\n".join(lines)


def diffs_report(tree: Path = TREE) -> str:
    """Every open survivor: its name, and its changed line before (-) and after (+)."""
    _, open_ = triage(tree)
    lines = []
    for func in sorted(open_):
        lines.append(f"## {func}")
        for name, a, b in open_[func]:
            lines += [f"{name}", f"  - {a}", f"  + {b}"]
    return "\n".join(lines)


def kill(mutants: list[str], tests: list[str], tree: Path = TREE, timeout: float = 120.0) -> dict[str, str]:
    """{mutant: "killed" | "survived" | "timeout"}: `tests` (pytest ids, repository paths) run once per mutant
    against the mutated files of the last `mutmut run` in `tree`, as mutmut runs them (in mutants/, with
    MUTANT_UNDER_TEST naming the mutant). The repository's tests/ is copied over the tree's first, so a test
    written after the run is the one checked; the mutated source files are the run's."""
    work = tree / "mutants"
    if not work.is_dir():
        raise SystemExit(f"no mutated tree in {work}: run `make mutation` (or `mutation.py prepare` and mutmut) first")
    shutil.copytree(ROOT / "tests", work / "tests", ignore=IGNORE, dirs_exist_ok=True)
    env = {**os.environ, "RAYSIM_TESTS_WITHOUT_RAY": "1", "HF_HUB_OFFLINE": "1"}
    out = {}
    for name in mutants:
        try:
            done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p",
                                   "no:randomly", *tests], cwd=work, env={**env, "MUTANT_UNDER_TEST": name},
                                  capture_output=True, text=True, timeout=timeout)
            out[name] = "survived" if done.returncode == 0 else "killed" if done.returncode == 1 else \
                f"error (pytest exit {done.returncode}: {done.stdout.strip().splitlines()[-1:]})"
        except subprocess.TimeoutExpired:
            out[name] = "timeout"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["prepare", "report", "triage", "diffs", "kill"])
    parser.add_argument("mutants", nargs="*", help="kill: the mutants' names (as `mutmut results` lists them)")
    parser.add_argument("--test", action="append", default=[], help="kill: a pytest id to run (repeatable)")
    parser.add_argument("--tree", type=Path, default=TREE)
    parser.add_argument("--scope", default="", help="prepare: the [tool.raysim.mutation.SCOPE] table to mutate instead")
    parser.add_argument("--results", type=Path, help="a saved `mutmut results --all true` listing (default: ask mutmut)")
    args = parser.parse_intermixed_args()
    global RESULTS
    RESULTS = args.results
    if args.command == "prepare":
        print(prepare(args.tree, args.scope))
    elif args.command == "report":
        print(report(args.tree))
    elif args.command == "kill":
        if not args.mutants or not args.test:
            parser.error("kill needs mutant names and at least one --test")
        status = kill(args.mutants, args.test, args.tree)
        for name, state in status.items():
            print(f"{name}: {state}")
        if any(state != "killed" for state in status.values()):
            raise SystemExit(1)
    elif args.command == "triage":
        print(triage_report(args.tree))
    else:
        print(diffs_report(args.tree))


if __name__ == "__main__":
    main()
