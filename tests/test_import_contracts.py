"""The import-linter settings `make lint` uses see the kinds of import issue #47's circles were made of, and
raysim.config is a leaf at run time too (the contracts themselves run in `make lint`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _settings() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def test_a_circle_of_a_function_import_and_an_annotation_import_breaks_the_cycle_contract(tmp_path):
    # two modules as engine/batched.py and engine/hosts.py were: one imports the other inside a function, the
    # other imports the first only for its annotations; with pyproject's settings the cycle contract sees it
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.b import g\n    return g\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n\ndef g():\n    return 1\n")
    flag = str(_settings()["exclude_type_checking_imports"]).lower()
    (tmp_path / "contracts.toml").write_text(
        f'[tool.importlinter]\nroot_packages = ["pkg"]\nexclude_type_checking_imports = {flag}\n\n'
        '[[tool.importlinter.contracts]]\nname = "no cycles"\ntype = "acyclic_siblings"\nancestors = ["pkg"]\n')
    out = subprocess.run([str(LINT_IMPORTS), "--no-cache", "contracts.toml"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 1 and "no cycles BROKEN" in out.stdout, out.stdout + out.stderr


def test_importing_the_config_package_imports_no_other_part_of_raysim():
    code = ("import sys, raysim.config, raysim.config.rules, raysim.config.limits, raysim.config.load, raysim.config.schema\n"
            "print(sorted(m for m in sys.modules if m.startswith('raysim.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    loaded = set(eval(out.stdout))  # a list literal of module names
    allowed = {"raysim.errors", "raysim.safeio"}
    assert loaded and {m for m in loaded if not m.startswith("raysim.config")} <= allowed, loaded
