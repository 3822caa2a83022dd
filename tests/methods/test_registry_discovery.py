"""The method registry is discovered, not hand-kept: every module of the paper folders (methods/fedsept,
methods/fedtsp, methods/vpdr) registers a method or is a declared helper, `discover()` imports exactly the
modules pkgutil lists, the registered names are exactly the `@register_method` classes of the sources, a
method in a new file is found without editing any other file, and the shared bases in methods/families/
register nothing. The same for the other two plug-in folders, privacy/mechanisms/ (`@register_mechanism`) and
attacks/ (`@register_attack`): discovery imports exactly their modules, registers exactly their decorated
classes, and finds one in a new file. Also: methods/ stays free of Ray, logging and file I/O (the engine owns those).

The registry checks run in a fresh interpreter: other tests register test-only methods (tests/flaky_method.py)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
METHODS_DIR = ROOT / "methods"
PAPERS = ("fedsept", "fedtsp", "vpdr")

# modules of the paper folders that register no method, and why they are there
HELPERS = {
    "fedsept/fedsept_parts.py": "FedSEPT's building blocks (public basis, SEM, router, regularisers, fusion), tested on their own",
    "fedtsp/fedtsp_descriptions.py": "the class descriptions and prompts FedTSP's PLM encodes (bundled JSON assets)",
    "fedtsp/fedtsp_semantics.py": "the semantic analysis of FedTSP's text prototypes that `raysim compare` reports",
    "vpdr/finch.py": "the FINCH clustering that VPDR's FPL and FedPLVM run on the released prototypes",
}


def _registered_classes(path: Path) -> list[str]:
    """The `name` of every class in `path` decorated with @register_method (read from the source)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ClassDef):
            continue
        if not any(isinstance(d, ast.Name) and d.id == "register_method" for d in node.decorator_list):
            continue
        for stmt in node.body:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == "name" for t in targets):
                assert isinstance(stmt.value, ast.Constant), f"{path}: {node.name}.name must be a string literal"
                names.append(stmt.value.value)
                break
        else:
            raise AssertionError(f"{path}: @register_method class {node.name} sets no `name`")
    return names


def _paper_files() -> list[Path]:
    return sorted(p for paper in PAPERS for p in (METHODS_DIR / paper).glob("*.py") if p.name != "__init__.py")


def _run(code: str) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON object last."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def discovered() -> dict:
    return _run("""
        import json, pkgutil, sys
        import raysim.methods as m
        before = {k for k in sys.modules if k.startswith("raysim.methods.")}
        m.discover()
        walked = [i.name for i in pkgutil.walk_packages(m.__path__, prefix="raysim.methods.")]
        imported = sorted(k for k in sys.modules if k.startswith("raysim.methods."))
        registered = {n: m.get_method(n).__module__ for n in m.method_names()}
        print(json.dumps({"walked": walked, "imported": imported, "before": sorted(before), "registered": registered}))
    """)


def test_every_paper_module_registers_a_method_or_is_a_declared_helper():
    for path in _paper_files():
        rel = path.relative_to(METHODS_DIR).as_posix()
        names = _registered_classes(path)
        if rel in HELPERS:
            assert not names, f"{rel} registers {names}: take it off HELPERS in this test"
        else:
            assert names, (f"{rel} registers no method: register one with @register_method, move shared code to "
                           "methods/families/, or declare it in HELPERS here with the reason it is a helper")
    stale = [rel for rel in HELPERS if not (METHODS_DIR / rel).is_file()]
    assert not stale, f"HELPERS names files that do not exist: {stale}"


def test_discover_imports_exactly_the_modules_pkgutil_lists(discovered):
    walked, imported = set(discovered["walked"]), set(discovered["imported"])
    assert walked == imported, f"missing: {sorted(walked - imported)}; extra: {sorted(imported - walked)}"
    for paper in PAPERS:  # the walk reaches into every paper folder
        assert any(n.startswith(f"raysim.methods.{paper}.") for n in walked), paper
    # nothing but the package's own base is imported before discover() runs: registration is discovery's
    assert set(discovered["before"]) <= {"raysim.methods.base"}, discovered["before"]


def test_registered_methods_are_exactly_the_decorated_classes_of_the_paper_folders(discovered):
    registered = discovered["registered"]
    scanned: dict[str, str] = {}
    for path in sorted(METHODS_DIR.rglob("*.py")):
        module = "raysim.methods." + ".".join(path.relative_to(METHODS_DIR).with_suffix("").parts)
        for name in _registered_classes(path):
            assert name not in scanned, f"{name!r} is registered in {scanned.get(name)} and {module}"
            scanned[name] = module
    assert registered == scanned
    for name, module in registered.items():
        assert module.split(".")[2] in PAPERS, f"method {name!r} lives in {module}, outside methods/{{{','.join(PAPERS)}}}/"


def test_families_register_no_method_and_import_no_method_module():
    for path in sorted((METHODS_DIR / "families").glob("*.py")):
        assert not _registered_classes(path), f"{path.name}: a family module holds shared bases, not methods"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not any(node.module.startswith(f"raysim.methods.{p}") for p in PAPERS), (
                    f"families/{path.name} imports {node.module}: the bases sit below the methods")


def test_a_method_in_a_new_file_is_found_without_editing_any_other(tmp_path):
    (tmp_path / "zz_discovery_probe.py").write_text(textwrap.dedent("""
        from raysim.methods.fedsept.zeroshot import ZeroShot
        from raysim.methods.base import register_method


        @register_method
        class DiscoveryProbe(ZeroShot):
            name = "zz_discovery_probe"
    """))
    out = _run(f"""
        import json
        import raysim.methods as m
        import raysim.methods.fedsept as paper
        paper.__path__.append({str(tmp_path)!r})  # as if the file sat in methods/fedsept/
        print(json.dumps({{"module": m.get_method("zz_discovery_probe").__module__}}))
    """)
    assert out["module"] == "raysim.methods.fedsept.zz_discovery_probe"


# the other plug-in folders: (package, folder, decorator, what the registry holds, how to list it, helper modules)
PLUGINS = {
    "mechanisms": ("raysim.privacy.mechanisms", ROOT / "privacy" / "mechanisms", "register_mechanism", "class",
                   "import raysim.privacy.mechanisms as p; p.discover(); items = [p.MECHANISMS.get(n) for n in p.MECHANISMS.names()]",
                   {"base"}),
    "attacks": ("raysim.attacks", ROOT / "attacks", "register_attack", "instance",
                "import raysim.attacks as p; items = p.attacks()", {"base"}),
}
PROBES = {
    "mechanisms": """
        from raysim.privacy.mechanisms.base import register_mechanism
        from raysim.privacy.mechanisms.public_release import Public


        @register_mechanism
        class DiscoveryProbe(Public):
            name = "zz_discovery_probe"
    """,
    "attacks": """
        from raysim.attacks.base import register_attack
        from raysim.attacks.prototype_mia import PrototypeMIA


        @register_attack
        class DiscoveryProbe(PrototypeMIA):
            name = "zz_discovery_probe"
    """,
}


def _decorated(path: Path, decorator: str) -> list[str]:
    """The names of the classes in `path` decorated with `decorator` (read from the source)."""
    return [node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
            and any(isinstance(d, ast.Name) and d.id == decorator for d in node.decorator_list)]


def _plugin_registry(kind: str, extra_dir: str = "") -> dict:
    """In a fresh interpreter: the package's modules pkgutil lists, those imported after discovery, and the
    (module, class) of every registered item; with `extra_dir` on the package's path from its first import,
    as if its files sat in the folder."""
    package, _, _, holds, listing, _ = PLUGINS[kind]
    return _run(f"""
        import importlib.abc, json, pkgutil, sys

        class Extra(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name != {package!r} or not {extra_dir!r}:
                    return None
                for finder in sys.meta_path:  # the finder that would find it (the editable install's, or the path's)
                    spec = finder.find_spec(name, path, target) if finder is not self and hasattr(finder, "find_spec") else None
                    if spec is not None:
                        spec.submodule_search_locations.append({extra_dir!r})
                        return spec
                return None

        sys.meta_path.insert(0, Extra())
        {listing}
        walked = [i.name for i in pkgutil.iter_modules(p.__path__, prefix={package + "."!r})]
        imported = sorted(k for k in sys.modules if k.startswith({package + "."!r}))
        cls = (lambda x: x) if {holds!r} == "class" else type
        registered = sorted([cls(i).__module__, cls(i).__name__] for i in items)
        print(json.dumps({{"walked": walked, "imported": imported, "registered": registered}}))
    """)


@pytest.mark.parametrize("kind", sorted(PLUGINS))
def test_mechanisms_and_attacks_are_discovered_from_their_files(kind):
    package, folder, decorator, _, _, helpers = PLUGINS[kind]
    got = _plugin_registry(kind)
    walked, imported = set(got["walked"]), set(got["imported"])
    assert walked <= imported, f"discovery missed {sorted(walked - imported)}"
    scanned = []
    for path in sorted(folder.glob("*.py")):
        if path.name == "__init__.py":
            continue
        classes = _decorated(path, decorator)
        if path.stem in helpers:
            assert not classes, f"{path.name} registers {classes}: take it off the helpers of PLUGINS[{kind!r}]"
        else:
            assert classes, f"{folder.name}/{path.name} registers nothing with @{decorator}"
        scanned += [[f"{package}.{path.stem}", c] for c in classes]
    assert got["registered"] == sorted(scanned)


@pytest.mark.parametrize("kind", sorted(PLUGINS))
def test_a_mechanism_or_an_attack_in_a_new_file_is_found_without_editing_any_other(tmp_path, kind):
    package = PLUGINS[kind][0]
    (tmp_path / "zz_discovery_probe.py").write_text(textwrap.dedent(PROBES[kind]))
    got = _plugin_registry(kind, str(tmp_path))
    assert [f"{package}.zz_discovery_probe", "DiscoveryProbe"] in got["registered"]
    assert len(got["registered"]) == len(_plugin_registry(kind)["registered"]) + 1


FORBIDDEN = {
    r"^\s*(import ray\b|from ray\b)": "Ray (the engine places and runs the methods)",
    r"\blogging\b": "logging (metrics go back in LocalResult / ServerResult)",
    r"\bopen\(": "file I/O (the engine and RunFolder read and write)",
    r"\bprint\(": "printing (metrics go back in LocalResult / ServerResult)",
}


def test_methods_hold_no_ray_logging_or_io():
    hits = []
    for path in sorted(METHODS_DIR.rglob("*.py")):
        for no, line in enumerate(path.read_text().splitlines(), 1):
            for pattern, what in FORBIDDEN.items():
                if re.search(pattern, line):
                    hits.append(f"{path.relative_to(ROOT)}:{no}: {what}: {line.strip()}")
    assert not hits, "\n".join(hits)
