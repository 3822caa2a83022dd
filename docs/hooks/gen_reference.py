"""MkDocs hook: the reference pages are generated from the code on every build.

A hand-written page holds a marker such as `<!-- generated: config -->`; `on_page_markdown` replaces it
with the table built from the registries, so `mkdocs build --strict` always shows what the code says.
The generators read only names that stay put while modules move (issue #23's target layout):
`raysim.methods.METHODS`, `raysim.privacy.mechanisms.MECHANISMS`, `raysim.data.DATASETS / PARTITIONERS`,
the config `SECTIONS` (`raysim.config.schema`, else `raysim.config`) and the evaluation `PROTOCOLS`
(`raysim.protocols`, else `raysim.engine.evaluation`). The functions are plain (no MkDocs import), so
tests/test_docs.py calls them directly.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import math
import re
import textwrap
import tokenize
from typing import Any, Callable

MARKER = re.compile(r"<!--\s*generated:\s*([a-z_]+)\s*-->")
FAMILIES = ("fedsept", "fedtsp", "vpdr", "families")


# ------------------------------------------------------------------------------------------ helpers
def _import_first(*candidates: tuple[str, str]) -> Any:
    """The first (module, attribute) that imports; the docs work on the current and the target layout."""
    errors = []
    for module, attr in candidates:
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            errors.append(f"{module}.{attr}: {exc}")
    raise ImportError("; ".join(errors))


def sections() -> dict[str, type]:
    return _import_first(("raysim.config.schema", "SECTIONS"), ("raysim.config", "SECTIONS"))


def protocols() -> Any:
    return _import_first(("raysim.protocols", "PROTOCOLS"), ("raysim.engine.evaluation", "PROTOCOLS"))


def _cell(value: Any) -> str:
    """Text fit for a markdown table cell."""
    return str(value).replace("|", "\\|").replace("\n", " ").strip()


def _text(value: Any) -> str:
    """Prose fit for a markdown table cell (angle brackets shown, not read as HTML)."""
    return _cell(value).replace("<", "&lt;").replace(">", "&gt;")


def _code(value: Any) -> str:
    text = str(value)
    return f"`{text}`" if text else ""


def first_line(doc: str | None) -> str:
    """The first sentence-line of a docstring (up to its first blank line, joined)."""
    if not doc:
        return ""
    para = inspect.cleandoc(doc).split("\n\n", 1)[0]
    return " ".join(line.strip() for line in para.splitlines())


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def _show_default(value: Any) -> str:
    if value is dataclasses.MISSING:
        return "(required)"
    if isinstance(value, float) and math.isinf(value):
        return "`inf`" if value > 0 else "`-inf`"
    if isinstance(value, str):
        return f'`"{value}"`' if value == "" else f"`{value}`"
    if isinstance(value, bool) or value is None:
        return {True: "`true`", False: "`false`", None: "`null`"}[value]
    return f"`{value!r}`"


def _type_name(tp: Any) -> str:
    if isinstance(tp, str):
        return tp
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> its `#` comment in the class source: the comment lines right above the field
    (no blank line between) followed by the comment at the end of its line(s)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    pending: list[str] = []  # a block of comment-only lines
    logical: list[tokenize.TokenInfo] = []
    skip = (tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING)
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError):
        return {}
    for tok in tokens:
        if tok.type in skip:
            continue
        if tok.type in (tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER):
            code = [t for t in logical if t.type != tokenize.COMMENT]
            comments = [t.string.lstrip("#").strip() for t in logical if t.type == tokenize.COMMENT]
            if not logical:  # a blank line ends a comment block
                pending = []
            elif not code:  # a comment-only line
                if tok.type == tokenize.NL:
                    pending.extend(comments)
            elif tok.type == tokenize.NEWLINE:  # the end of a logical code line
                first = code[0]
                is_field = (first.type == tokenize.NAME and first.string in names and len(code) > 1
                            and code[1].string == ":" and first.start[1] == 4)
                if is_field:
                    out[first.string] = "; ".join(p for p in (" ".join(pending), " ".join(comments)) if p)
                pending = []
            if tok.type == tokenize.NEWLINE or not code:
                logical = []
            continue
        logical.append(tok)
    return out


# ------------------------------------------------------------------------------------------ config
def config_rows(section: str, cls: type) -> list[dict[str, str]]:
    """One row per key of a section (a nested dataclass field, e.g. dp.vpp, adds its own keys)."""
    comments = field_comments(cls)
    rows = []
    for f in dataclasses.fields(cls):
        key = f"{section}.{f.name}"
        value = _default(f)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            rows.extend(config_rows(key, type(value)))
            continue
        rows.append({"key": key, "type": _type_name(f.type), "default": _show_default(value),
                     "description": comments.get(f.name, ""), "resume": "yes" if f.metadata.get("resume") else ""})
    return rows


def config_markdown() -> str:
    out = ["The top-level key `method` (default `promptfl`) picks the federated method; each method's own "
           "section (`METHOD.key`) is listed on the [methods page](methods.md).", ""]
    for name, cls in sections().items():
        out.append(f"## `{name}`")
        out.append("")
        doc = first_line(cls.__doc__)
        if doc and not doc.startswith(cls.__name__ + "("):
            out += [_text(doc), ""]
        out.append("| key | type | default | description | may change on resume |")
        out.append("|---|---|---|---|---|")
        for r in config_rows(name, cls):
            out.append(f"| `{r['key']}` | {_code(_cell(r['type']))} | {_cell(r['default'])} | {_text(r['description'])} | {r['resume']} |")
        out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------ methods
def family_of(cls: type) -> str:
    """The paper family from the module path, methods/<paper>/<name>.py; "flat" for the layout before it."""
    parts = cls.__module__.split(".")
    inner = parts[2:-1] if parts[:2] == ["raysim", "methods"] else []
    for p in inner:
        if p in FAMILIES:
            return p
    return "/".join(inner) if inner else "flat"


def _source_path(cls: type) -> str:
    parts = cls.__module__.split(".")
    if parts[:2] == ["raysim", "methods"]:
        return "methods/" + "/".join(parts[2:]) + ".py"
    return "/".join(parts) + ".py"


def method_rows() -> list[dict[str, Any]]:
    from raysim.methods import get_method, method_names

    rows = []
    for name in method_names():
        cls = get_method(name)
        options = []
        opts = getattr(cls, "Options", None)
        if opts is not None and dataclasses.is_dataclass(opts):
            comments = field_comments(opts)
            for f in dataclasses.fields(opts):
                options.append((f.name, _type_name(f.type), _show_default(_default(f)), comments.get(f.name, "")))
        releases = []
        for upload, spec in (getattr(cls, "releases", {}) or {}).items():
            kind = getattr(spec, "kind", str(spec))
            extra = []
            if getattr(spec, "once", False):
                extra.append("once per run")
            if getattr(spec, "note", ""):
                extra.append(spec.note)
            releases.append((upload, kind, "; ".join(extra)))
        rows.append({"name": name, "family": family_of(cls), "source": _source_path(cls),
                     "summary": first_line(cls.__doc__) if cls.__doc__ else first_line(inspect.getmodule(cls).__doc__),
                     "options": options, "releases": releases, "release_first": bool(getattr(cls, "release_first", False))})
    return rows


def methods_markdown() -> str:
    rows = method_rows()
    out = ["| method | family | summary | uploads (release kind) |", "|---|---|---|---|"]
    for r in rows:
        ups = ", ".join(f"`{u}` ({k})" for u, k, _ in r["releases"]) or "nothing"
        out.append(f"| [`{r['name']}`](#{r['name']}) | {r['family']} | {_text(r['summary'])} | {ups} |")
    out.append("")
    for r in rows:
        out += [f"## {r['name']}", "", f"Family: {r['family']}; source: `{r['source']}`."
                + (" Two-phase round (`release_first`)." if r["release_first"] else ""), ""]
        if r["summary"]:
            out += [_text(r["summary"]), ""]
        if r["releases"]:
            out += ["| upload | release kind | note |", "|---|---|---|"]
            out += [f"| `{u}` | `{k}` | {_text(n)} |" for u, k, n in r["releases"]]
        else:
            out.append("Uploads nothing.")
        out.append("")
        if r["options"]:
            out += [f"Options (`{r['name']}.KEY=VALUE`):", "", "| key | type | default | description |", "|---|---|---|---|"]
            out += [f"| `{r['name']}.{n}` | {_code(_cell(t))} | {_cell(d)} | {_text(c)} |" for n, t, d, c in r["options"]]
        else:
            out.append("No options of its own.")
        out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------ mechanisms
def mechanisms_markdown() -> str:
    from raysim.privacy.mechanisms import MECHANISMS

    out = ["| mechanism | applied | what is clipped | sensitivity | neighbouring relation | accountant |",
           "|---|---|---|---|---|---|"]
    for name in MECHANISMS.names():
        c = MECHANISMS.get(name)
        out.append(f"| `{name}` | {_cell(getattr(c, 'applied', ''))} | {_text(c.clipped)} | {_text(c.sensitivity)} "
                   f"| {_text(c.relation)} | {_text(c.accountant)} |")
    out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------ data
def _registry_table(registry: Any, what: str) -> list[str]:
    """name, module, docstring summary; an entry without a docstring takes its module's when the module
    registers nothing else here (a dataset file), else stays blank (one module of several partitioners)."""
    out = [f"| {what} | defined in | summary |", "|---|---|---|"]
    objs = {name: registry.get(name) for name in registry.names()}
    per_module: dict[str, int] = {}
    for obj in objs.values():
        per_module[getattr(obj, "__module__", "")] = per_module.get(getattr(obj, "__module__", ""), 0) + 1
    for name, obj in objs.items():
        module = getattr(obj, "__module__", "")
        doc = first_line(getattr(obj, "__doc__", None))
        if not doc and per_module[module] == 1:
            doc = first_line(getattr(inspect.getmodule(obj), "__doc__", None))
        out.append(f"| `{name}` | `{module}` | {_text(doc)} |")
    return out


def datasets_markdown() -> str:
    from raysim.data import DATASETS

    return "\n".join(_registry_table(DATASETS, "`data.dataset`") + [""])


def partitioners_markdown() -> str:
    from raysim.data import PARTITIONERS

    return "\n".join(_registry_table(PARTITIONERS, "`data.partition`") + [""])


def protocols_markdown() -> str:
    return "\n".join(_registry_table(protocols(), "`eval.protocol`") + [""])


GENERATORS: dict[str, Callable[[], str]] = {
    "config": config_markdown,
    "methods": methods_markdown,
    "mechanisms": mechanisms_markdown,
    "datasets": datasets_markdown,
    "partitioners": partitioners_markdown,
    "protocols": protocols_markdown,
}


def render(markdown: str) -> str:
    """Every `<!-- generated: NAME -->` marker replaced by its table."""

    def one(m: re.Match) -> str:
        name = m.group(1)
        if name not in GENERATORS:
            raise KeyError(f"unknown generated section {name!r}; known: {', '.join(GENERATORS)}")
        return GENERATORS[name]()

    return MARKER.sub(one, markdown)


# ------------------------------------------------------------------------------------------ the hook
def on_config(config: Any, **kwargs: Any) -> Any:
    """```mermaid fences become <pre class="mermaid"> blocks, which the material theme draws as diagrams. Set here,
    not in mkdocs.yml: the fence's format is a Python function, which a YAML tag would name, and mkdocs.yml stays
    plain YAML (yaml.safe_load reads it in the tests)."""
    from pymdownx.superfences import fence_code_format

    fences = config["mdx_configs"].setdefault("pymdownx.superfences", {}).setdefault("custom_fences", [])
    if not any(f.get("name") == "mermaid" for f in fences):
        fences.append({"name": "mermaid", "class": "mermaid", "format": fence_code_format})
    return config


def on_page_markdown(markdown: str, page: Any = None, config: Any = None, files: Any = None, **kwargs: Any) -> str:
    return render(markdown) if MARKER.search(markdown) else markdown
