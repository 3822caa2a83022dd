"""benchmarks/mutation/mutation.py: the triage rules sort a survivor by its changed line, and every survivor judged
neutral by hand (neutral.toml) still names a function and a line of today's code (a stale entry would hide nothing,
but would mislead the reader of the docs' triage)."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("raysim_mutation_tool", ROOT / "benchmarks" / "mutation" / "mutation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fn(body: str) -> str:
    return "def f(x):\n" + "\n".join("    " + line for line in body.splitlines()) + "\n"


@pytest.mark.parametrize(
    "orig, mutant, kind",
    [
        ('raise ConfigError(f"cannot reach {x}; " "raise epsilon")', "raise ConfigError(None)", "message"),
        ('raise ConfigError("k must be > 0")', 'raise ConfigError("XXk must be > 0XX")', "message"),
        ('"use a prototype method"', '"USE A PROTOTYPE METHOD"', "message"),
        ("y = torch.zeros(3, device=x.device)", "y = torch.zeros(3, device=None)", "device"),
        ("c = c + (_randn(s, g, c) * std)", "c = c - (_randn(s, g, c) * std)", "symmetric"),
        ("if x > 0:", "if x >= 0:", "open"),
        ('if x == "rdp":', 'if x == "XXrdpXX":', "open"),  # a compared string is not a message
    ],
)
def test_the_triage_rules_sort_a_survivor_by_its_changed_line(orig, mutant, kind):
    assert _tool().kind_of(_fn(orig), _fn(mutant)) == kind


def _file(module: list[str]) -> Path:
    """The repository file of raysim.<module> (methods/, privacy/ and attacks/ map into the package)."""
    parts = module[1:]
    base = ROOT if parts and parts[0] in ("methods", "privacy", "attacks") else ROOT / "raysim"
    return base.joinpath(*parts).with_suffix(".py")


def _split(function: str) -> tuple[Path, str]:
    """raysim.privacy.ledger.PrivacyLedger.check -> (privacy/ledger.py, "PrivacyLedger.check")."""
    parts = function.split(".")
    for cut in (len(parts) - 1, len(parts) - 2):
        if _file(parts[:cut]).is_file():
            return _file(parts[:cut]), ".".join(parts[cut:])
    raise AssertionError(f"neutral.toml: no module of today's code holds {function}")


def _functions(path: Path) -> dict[str, str]:
    """{function or Class.method: its source text, comments included} of one file."""
    text = path.read_text("utf-8")
    tree = ast.parse(text)
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = ast.get_source_segment(text, node)
        elif isinstance(node, ast.ClassDef):
            out.update({f"{node.name}.{f.name}": ast.get_source_segment(text, f) for f in node.body
                        if isinstance(f, ast.FunctionDef)})
    return out


def test_every_judged_survivor_names_a_function_and_a_line_of_todays_code():
    tool = _tool()
    judged = tool.judged(tool.NEUTRAL)
    assert len(judged) >= 30  # the file was read (an empty table would pass the loop below)
    for (function, line), why in judged.items():
        assert why.strip()
        path, name = _split(function)
        functions = _functions(path)
        assert name in functions, f"neutral.toml: {function} is not a function of today's code"
        source = functions[name]
        # the mutated line differs from the source by the mutation: its words (names) must all appear in it, in
        # the source's spelling or another case (mutmut's string mutations: "XX..XX", lower and upper case), or be a
        # keyword mutmut swaps in (continue -> break, break -> return)
        words = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", line)) - {"None", "True", "False", "and", "or", "not", "if",
                                                                      "else", "is", "in", "break", "return"}
        lowered = source.lower()
        missing = {w for w in words if w not in source and w.lower() not in lowered and not re.fullmatch(r"XX\w*XX", w)}
        assert not missing, f"neutral.toml: {function}: {line!r} has {missing} that the function no longer has"


def test_a_second_scope_replaces_only_what_mutmut_mutates_and_runs():
    # `prepare --scope stepper` rewrites the tree's [tool.mutmut] only_mutate and test selection from
    # [tool.raysim.mutation.stepper]; everything else of pyproject.toml (the package, the other mutmut keys) stays
    import tomllib

    tool = _tool()
    text = (ROOT / "pyproject.toml").read_text("utf-8")
    config = tomllib.loads(text)
    out = tomllib.loads(tool.scoped_pyproject(text, "stepper"))
    scope = config["tool"]["raysim"]["mutation"]["stepper"]
    for key in ("only_mutate", "pytest_add_cli_args_test_selection"):
        assert out["tool"]["mutmut"][key] == scope[key] != config["tool"]["mutmut"][key]
    others = {k: v for k, v in config["tool"]["mutmut"].items() if k not in scope}
    assert others and all(out["tool"]["mutmut"][k] == v for k, v in others.items())
    assert out["project"] == config["project"] and out["tool"]["raysim"] == config["tool"]["raysim"]
    # every file the scope mutates exists, and none is also in the first scope (a mutant is scored once)
    for pattern in scope["only_mutate"]:
        assert (ROOT / pattern.replace("raysim/privacy/", "privacy/")).is_file(), pattern
        assert pattern not in config["tool"]["mutmut"]["only_mutate"]
    with pytest.raises(SystemExit, match="no mutation scope 'nope'"):
        tool.scoped_pyproject(text, "nope")
