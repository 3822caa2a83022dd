"""Class descriptions for text-semantic prototypes (FedTSP, SPEC 2.7) and the prompts built from them.

Descriptions live in `raysim/assets/descriptions/<dataset>.json` in the format of the official files:
`{classname: {"Fine-grained Descriptions": [3 sentences], ...}}` (other keys, such as "Short Label" or
"Hard Negatives", are ignored). They were written for this project. Class names are matched after
normalisation (lower case, `_` -> space), so torchvision names (`aquarium_fish`) and the loaders' pretty
names (`aquarium fish`) both work.

The prompts of class c are the k strings "A photo of a {name}: {description_j}" (fedtsp.txt Eq. 3); the
handcrafted ablation is the single string "A photo of a {name}.".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

import raysim
from raysim.errors import ConfigError

ASSET_DIR = Path(raysim.__file__).resolve().parent / "assets" / "descriptions"
KEY = "Fine-grained Descriptions"


def normalize_name(name: str) -> str:
    return " ".join(name.replace("_", " ").lower().split())


def description_file(dataset: str) -> Path | None:
    """The bundled file of `dataset` (variants such as synthetic-small share their family's file)."""
    for cand in (dataset.lower(), dataset.lower().split("-")[0]):
        p = ASSET_DIR / f"{cand}.json"
        if p.is_file():
            return p
    return None


def bundled_datasets() -> list[str]:
    return sorted(p.stem for p in ASSET_DIR.glob("*.json"))


def load_descriptions(dataset: str = "", path: str | Path = "") -> dict[str, list[str]]:
    """{normalised class name: [descriptions]} from `path`, else from the bundled file of `dataset`."""
    p = Path(path).expanduser() if path else description_file(dataset)
    if p is None or not p.is_file():
        where = f"file {path!r}" if path else f"bundled descriptions for dataset {dataset!r}"
        raise ConfigError(
            f"no {where}. Bundled: {', '.join(bundled_datasets())}. Write a JSON file "
            '{classname: {"Fine-grained Descriptions": [...]}} and pass fedtsp.descriptions=/path/file.json, '
            "or use fedtsp.handcrafted=true."
        )
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"description file {p} is not valid JSON: {e}") from None
    return parse_descriptions(raw, source=str(p))


def parse_descriptions(raw: Mapping, source: str = "descriptions") -> dict[str, list[str]]:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: expected a JSON object keyed by class name")
    out: dict[str, list[str]] = {}
    for name, entry in raw.items():
        descs = entry.get(KEY) if isinstance(entry, Mapping) else entry
        if not isinstance(descs, list) or not descs or not all(isinstance(d, str) and d.strip() for d in descs):
            raise ConfigError(f"{source}: class {name!r} needs a non-empty list of strings under {KEY!r}")
        out[normalize_name(name)] = [d.strip() for d in descs]
    return out


def class_prompts(
    classnames: Sequence[str],
    *,
    dataset: str = "",
    descriptions: Mapping[str, Sequence[str]] | None = None,
    path: str | Path = "",
    handcrafted: bool = False,
    k: int = 3,
) -> list[list[str]]:
    """Per class, its prompt strings: k "A photo of a {name}: {description}", or "A photo of a {name}."."""
    names = [c.replace("_", " ").strip() for c in classnames]
    if handcrafted:
        return [[f"A photo of a {n}."] for n in names]
    table = {normalize_name(k_): list(v) for k_, v in descriptions.items()} if descriptions is not None else (
        load_descriptions(dataset, path)
    )
    missing = [n for n in names if normalize_name(n) not in table]
    if missing:
        raise ConfigError(
            f"no descriptions for classes {missing[:5]}{' ...' if len(missing) > 5 else ''} "
            f"(dataset {dataset!r}); add them to the description file or use fedtsp.handcrafted=true"
        )
    return [[f"A photo of a {n}: {d}" for d in table[normalize_name(n)][:k]] for n in names]
