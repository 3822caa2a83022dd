"""The documentation site: generated reference pages cover the code, the nav's pages exist, README stays a
short front door. Fast and offline: the hook's generators are called directly, no `mkdocs build`."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "hooks" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mkdocs_config() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def _nav_pages(nav) -> list[str]:
    out = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def _keys(section: str, cls: type) -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default) and not isinstance(default, type):  # a subsection, e.g. dp.vpp
            keys += _keys(f"{section}.{f.name}", type(default))
        else:
            keys.append(f"{section}.{f.name}")
    return keys


def test_config_reference_lists_every_field_of_every_section(gen):
    sections = gen.sections()
    assert {"data", "model", "train", "eval", "execution", "output", "dp"} <= set(sections)
    page = gen.config_markdown()
    for name, cls in sections.items():
        assert f"## `{name}`" in page
        for key in _keys(name, cls):
            assert f"| `{key}` |" in page, f"the config reference lacks {key}"
    # the field comment is the description, and resumable keys say so
    rows = {r["key"]: r for name, cls in sections.items() for r in gen.config_rows(name, cls)}
    assert "seed" in rows["train.seed"]["description"] and rows["train.rounds"]["resume"] == "yes"
    assert rows["train.seed"]["resume"] == "" and rows["execution.backend"]["resume"] == "yes"


def test_field_comments_read_the_line_and_the_block_above():
    @dataclasses.dataclass
    class Section:
        plain: int = 1
        trailing: int = 2  # on the line
        # a block above,
        # two lines long
        above: str = "x#y"
        both: float = 0.5  # and a tail
        # a block that a blank line ends

        last: bool = False

    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "hooks" / "gen_reference.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    comments = gen.field_comments(Section)
    assert comments["plain"] == "" and comments["trailing"] == "on the line"
    assert comments["above"] == "a block above, two lines long" and comments["both"] == "and a tail"
    assert comments["last"] == ""


def test_methods_reference_lists_every_registered_method(gen):
    from raysim.methods import get_method, method_names

    page = gen.methods_markdown()
    names = method_names()
    assert "promptfl" in names and "fedsept" in names
    for name in names:
        assert f"\n## {name}\n" in page, f"the methods reference lacks {name}"
        for upload, spec in get_method(name).releases.items():
            assert f"| `{upload}` | `{spec.kind}` |" in page, (name, upload)


def test_other_reference_pages_list_their_registries(gen):
    from raysim.data import DATASETS, PARTITIONERS
    from raysim.privacy.mechanisms import MECHANISMS

    for markdown, registry in ((gen.mechanisms_markdown(), MECHANISMS), (gen.datasets_markdown(), DATASETS),
                               (gen.partitioners_markdown(), PARTITIONERS), (gen.protocols_markdown(), gen.protocols())):
        for name in registry.names():
            assert f"| `{name}` |" in markdown, name


def test_every_marker_in_the_docs_has_a_generator(gen):
    for page in DOCS.rglob("*.md"):
        for name in gen.MARKER.findall(page.read_text()):
            assert name in gen.GENERATORS, f"{page}: unknown generated section {name!r}"


def test_every_nav_page_exists_and_every_page_is_in_the_nav():
    config = _mkdocs_config()
    assert config["theme"]["name"] == "material" and config["strict"] is True
    pages = _nav_pages(config["nav"])
    missing = [p for p in pages if not (DOCS / p).is_file()]
    assert not missing, f"mkdocs.yml's nav names missing pages: {missing}"
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert on_disk == set(pages), f"pages outside the nav: {sorted(on_disk - set(pages))}"


LINK = re.compile(r"\]\(([^)\s]+)[^)]*\)")


def test_readme_is_a_short_front_door_without_outside_links():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    assert "make test" in text  # CI runs the test command README states
    assert "../shared" not in text and "http://" not in text and "https://" not in text
    for target in LINK.findall(text):
        path = target.split("#", 1)[0]
        assert not path.startswith(("/", "..")) and "://" not in path, target
        assert (ROOT / path).resolve().is_relative_to(ROOT) and (ROOT / path).exists(), target


def test_docs_point_nowhere_outside_the_repository():
    for page in DOCS.rglob("*.md"):
        text = page.read_text()
        assert "../shared" not in text, page
        for target in LINK.findall(text):
            assert "://" not in target, f"{page}: external link {target}"
            path = target.split("#", 1)[0]
            if path:
                assert (page.parent / path).resolve().is_relative_to(DOCS.resolve()), f"{page}: {target}"


def test_family_and_source_come_from_the_module_path(gen):
    class Target:
        pass

    Target.__module__ = "raysim.methods.fedsept.promptfl"  # the target layout: methods/<paper>/<name>.py
    assert gen.family_of(Target) == "fedsept" and gen._source_path(Target) == "methods/fedsept/promptfl.py"
    Target.__module__ = "raysim.methods.promptfl"  # the flat layout before it
    assert gen.family_of(Target) == "flat" and gen._source_path(Target) == "methods/promptfl.py"


def test_registries_are_found_on_either_layout(gen):
    found = gen._import_first(("raysim.no_such_module", "SECTIONS"), ("raysim.registry", "Registry"))
    from raysim.registry import Registry

    assert found is Registry
    with pytest.raises(ImportError):
        gen._import_first(("raysim.no_such_module", "X"))
    assert _mkdocs_config()["hooks"] == ["docs/hooks/gen_reference.py"]
