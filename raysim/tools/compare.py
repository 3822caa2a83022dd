"""`raysim compare`: several methods on one setting (or a grid of settings), one paper-layout table.

    raysim compare --methods zeroshot,promptfl,fedsept,fedsept:variant=wo_r --rounds 10 dp.epsilon=1
    raysim compare benchmarks/tables/fedtsp_table1.yaml --rounds 3
    raysim compare --methods fedproto,fedtgp,fedtsp --grid data.beta=0.1,0.5,1.0 --layout fedtsp

A method entry is `name` or `name:key=value;key=value`: a key without a dot sets an option of the
method's own section (`fedsept:rank=8`), a dotted key any config key for that entry only
(`promptfl:train.ctx_init=`). `--grid key=v1,v2` adds a column group per value (several grids: their
product); the remaining `key=value` arguments apply to every run. An entry's own keys win over all of these:
an entry with its own train.rounds keeps it under --rounds (or a spec's rounds:), which sets every other
entry's. A spec file (YAML) holds the same:

    title: ...
    layout: in_cross            # in_cross (FedSEPT) | fedtsp (FedTSP Table 1/3) | vpdr (VPDR Table 1)
    columns: [{label: CIFAR-10, data.dataset: cifar10}, ...]   # optional: named column groups, each setting several keys
    rounds: 10
    methods: [promptfl, "fedsept:rank=8", {label: "FedSEPT w/o R", method: fedsept, fedsept: {variant: wo_r}}]
    grid: {data.beta: [0.1, 0.5]}
    setting: {data: {dataset: synthetic-large}, train: {num_clients: 10}}

With `--seeds 1,2,3` (`seeds: [1, 2, 3]` in a spec) every (cell, entry) runs once per train.seed into
OUT/<cell>/<entry>/seed-<s>/ and each cell shows the mean ± sample std over the seeds (one seed keeps
OUT/<cell>/<entry>/). The runs go onto the Ray cluster the runs' execution.address names (init_ray's
rules), as many at once as fit (`--max-concurrent N`; 1 runs them one after another in this process), each
reserving what it needs: an inline run execution.num_threads CPUs, a Ray-backend run a placement group of
its actors' bundles (as a sweep trial). Results are bitwise those of the runs made one by one. The
comparison is resumable: a finished run is read back, an interrupted one is resumed (`output.resume`), so
running the same command again completes a table without redoing work. A cell whose config equals an
earlier cell's in all but its output folder (a no-DP row under a grid over dp.epsilon) is not run again: it
reads that run (the log and the dry run say which). It writes OUT/table.md, table.csv and
table.png (plus the layout's own figures) and prints the Markdown. Ctrl-C stops it with exit code 130 and a
line naming the --out to give to resume.

Each entry's label names its folder: a label must hold letters or digits, must not be . or .., a path, or
sanitise (every run of characters other than letters, digits, . _ - becomes _) to another label's folder.
A comparison plans at most 10,000 runs (cells x entries x seeds), counted before anything is expanded.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from raysim.errors import ConfigError, RaysimError, os_error_line, shown
from raysim.tools.layouts import (  # noqa: F401 (the layouts and what they read live there; re-exported)
    LAYOUTS,
    CompareSpec,
    Entry,
    FedTSPLayout,
    InCrossLayout,
    Layout,
    RunRecord,
    Table,
    VPDRLayout,
    bar_chart,
    cell_label,
    grid_table,
    semantic_structure,
)


def parse_entry(text: str) -> Entry:
    """`fedsept:rank=8;variant=wo_r` -> Entry(label=text, method=fedsept, overrides={fedsept: {...}})."""
    from raysim.config import deep_merge, parse_overrides

    name, _, own = text.strip().partition(":")
    if not name:
        raise ConfigError(f"--methods: empty method name in {shown(text)}; write name or name:key=value;key=value")
    overrides: dict[str, Any] = {}
    for item in [kv for kv in own.split(";") if kv.strip()]:
        key = item.split("=", 1)[0].strip()
        overrides = deep_merge(overrides, parse_overrides([item if "." in key else f"{name}.{item}"]))
    return Entry(label=text.strip(), method=name, overrides=overrides)


def entry_from(item: Any) -> Entry:
    if isinstance(item, str):
        return parse_entry(item)
    if isinstance(item, dict) and isinstance(item.get("method"), str) and isinstance(item.get("label", ""), (str, int, float)):
        rest = {k: v for k, v in item.items() if k not in ("label", "method")}
        from raysim.config import move_flat_keys

        return Entry(label=str(item.get("label", item["method"])), method=str(item["method"]), overrides=move_flat_keys(rest))
    raise ConfigError(f"methods: each entry is 'name[:key=value;...]' or a mapping with 'method' (and 'label'); got {shown(item)}")


def parse_grid(items: Sequence[str]) -> dict[str, list[Any]]:
    from raysim.config import parse_yaml

    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise ConfigError(f"--grid {shown(item)}: write key=v1,v2 (for example --grid data.beta=0.1,0.5,1.0)")
        texts = values.split(",")
        if len(texts) > MAX_RUNS:  # one key's values alone exceed the runs a comparison may plan
            raise ConfigError(f"--grid {shown(key)} lists {len(texts):,} values; a comparison plans at most {MAX_RUNS:,} runs")
        grid[key.strip()] = [parse_yaml(v, what=f"--grid {shown(key)}") for v in texts]
    return grid


def spec_list(value: Any, what: str) -> list[Any]:
    """A spec's list (methods, seeds, a grid key's values): a list, or one value as a list of one, of at most
    MAX_RUNS items (each is at least one run)."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if len(items) > MAX_RUNS:
        raise ConfigError(f"{what} lists {len(items):,} items; a comparison plans at most {MAX_RUNS:,} runs")
    return items


def spec_from_args(argv: Sequence[str]) -> tuple[CompareSpec, argparse.Namespace]:
    from raysim.config import deep_merge, load_yaml, move_flat_key, move_flat_keys, parse_user_overrides
    from raysim.config.load import _coerce, check_sections, expand_dotted_keys

    p = argparse.ArgumentParser(prog="raysim compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="", help="comma-separated entries: name or name:key=value;key=value")
    p.add_argument("--grid", action="append", default=[], help="key=v1,v2: a column group per value (repeatable)")
    p.add_argument("--layout", default="", help=f"table layout: {', '.join(LAYOUTS.names())}")
    p.add_argument("--rounds", type=int, default=0,
                   help="rounds of every run but an entry that sets its own train.rounds (default: the spec's or the config's)")
    p.add_argument("--out", default="", help="folder of the runs and tables (default runs/compare-<time>)")
    p.add_argument("--title", default="")
    p.add_argument("--seeds", default="", help="comma-separated train.seed values: each run once per seed, cells mean ± std")
    p.add_argument("--max-concurrent", type=int, default=0,
                   help="runs at once on the Ray cluster (default: as many as it holds; 1: one after another in this process)")
    p.add_argument("--dry-run", action="store_true", help="validate every run's config and list the runs; run nothing, write nothing")
    p.add_argument("overrides", nargs="*", metavar="[SPEC.yaml] key=value",
                   help="a comparison spec (YAML), then config key=value applied to every run (dp.epsilon=1 data.dataset=digits)")
    a = p.parse_intermixed_args(list(argv))
    specs = [w for w in a.overrides if "=" not in w]
    if len(specs) > 1 or (specs and not specs[0].endswith((".yaml", ".yml"))):
        raise ConfigError(f"compare: expected one spec file (.yaml) and key=value overrides, got {specs}")
    a.spec = specs[0] if specs else ""
    a.overrides = [w for w in a.overrides if "=" in w]
    raw: dict[str, Any] = load_yaml(a.spec) if a.spec else {}
    unknown = set(raw) - {"title", "layout", "rounds", "methods", "grid", "setting", "seeds", "columns"}
    if unknown:
        raise ConfigError(f"{a.spec}: unknown keys {shown(sorted(map(str, unknown)))}; a spec has title, layout, rounds, methods, "
                          "grid, setting, seeds, columns")
    if a.max_concurrent < 0:
        raise ConfigError(f"--max-concurrent must be >= 1 (or left out: as many as the cluster holds), got {a.max_concurrent}")
    if a.rounds < 0:
        raise ConfigError(f"--rounds must be >= 1 (or left out: the spec's or the config's), got {a.rounds}")
    spec_rounds = _coerce(raw.get("rounds") or 0, int, f"{a.spec}: rounds")
    if spec_rounds < 0:
        raise ConfigError(f"{a.spec}: rounds must be >= 1 (or left out: the config's), got {spec_rounds}")
    raw_grid = raw.get("grid") or {}
    if not isinstance(raw_grid, dict):
        raise ConfigError(f"{a.spec}: grid is a mapping of config keys to their values (grid: {{data.beta: [0.1, 0.5]}}), "
                          f"got {shown(raw_grid)}")
    for key in ("title", "layout"):
        if not isinstance(raw.get(key, ""), (str, int, float)):
            raise ConfigError(f"{a.spec}: {key} must be a string, got {shown(raw[key])}")
    if a.methods:
        methods = [parse_entry(m) for m in spec_list(a.methods.split(","), "--methods") if m.strip()]
    else:
        methods = [entry_from(m) for m in spec_list(raw.get("methods") or [], f"{a.spec}: methods")]
    if not methods:
        raise ConfigError("compare: no methods; pass --methods promptfl,fedsept or a spec file with 'methods:'")
    check_labels(methods)
    # the spec file and the command line are user input: old flat keys are moved into their sections here, once
    grid = {move_flat_key(str(k)): spec_list(v, f"{a.spec}: grid {shown(k)}") for k, v in raw_grid.items()}
    grid.update({move_flat_key(k): v for k, v in parse_grid(a.grid).items()})
    raw_setting = raw.get("setting") or {}
    if not isinstance(raw_setting, dict):
        raise ConfigError(f"{a.spec}: setting is a mapping of config keys (setting: {{data: {{dataset: digits}}}}), "
                          f"got {str(raw_setting)[:40]!r}")
    check_sections(raw_setting, f"{a.spec}: setting")
    setting = deep_merge(move_flat_keys(expand_dotted_keys(raw_setting)), parse_user_overrides(a.overrides))
    rounds_given = a.rounds or spec_rounds
    if "train.rounds" in grid and rounds_given:
        raise ConfigError(
            f"compare: --grid train.rounds={','.join(str(v) for v in grid['train.rounds'])} sets each column's rounds, and "
            f"{'--rounds' if a.rounds else 'the spec' + chr(39) + 's rounds:'} {rounds_given} would override them all under the grid's "
            "labels; drop one of the two"
        )
    layout = a.layout or str(raw.get("layout", "in_cross"))
    LAYOUTS.get(layout)  # unknown layout: a ConfigError naming the known ones
    seeds = parse_seeds(spec_list(a.seeds.split(",") if a.seeds else raw.get("seeds") or [], "seeds"))
    if "train.seed" in grid and seeds:
        raise ConfigError("compare: train.seed is both a --grid key and --seeds; seeds are replicates, pass them once as --seeds")
    columns = parse_columns(raw.get("columns"), a.spec)
    spec = CompareSpec(methods=methods, grid=grid, setting=setting, layout=layout, seeds=seeds, columns=columns,
                       rounds=int(a.rounds or spec_rounds), title=a.title or str(raw.get("title", "")))
    check_size(spec)
    return spec, a


MAX_RUNS = 10_000  # runs one comparison may plan (cells x entries x seeds); each is a config built and checked first


def check_size(spec: CompareSpec) -> None:
    """Refuse a comparison of more than MAX_RUNS runs, counted from the grid's, the entries' and the seeds'
    lengths before anything is expanded (10^6 seeds would otherwise be planned one config at a time)."""
    n = spec.size()
    if n > MAX_RUNS:
        sizes = " x ".join([f"{len(spec.methods)} entries", *([f"{len(spec.columns)} columns"] if spec.columns else []),
                            *(f"{len(v)} {k}" for k, v in spec.grid.items()),
                            f"{max(1, len(spec.seeds))} seeds"])
        raise ConfigError(f"compare: {sizes} make {n:,} runs; a comparison plans at most {MAX_RUNS:,}: split it into "
                          "several comparisons (several --out folders)")


def check_labels(methods: Sequence[Entry]) -> None:
    """Each entry's label names its folder OUT/<cell>/<slug(label)>: a label must give a plain folder name
    (not empty, not . or .., not an absolute path or ~), and no two labels the same one once sanitised
    ("x y" and "x_y" are both x_y) or the same label twice."""
    seen: dict[str, str] = {}
    for m in methods:
        label = m.label
        name = slug(label)
        if label.strip() in (".", "..") or name in (".", "..") or (label.startswith(("/", "~", "\\")) and slug(label) != "default"):
            raise ConfigError(f"compare: the label {shown(label)} would name a folder outside --out; give the entry a plain label")
        if not label.strip() or not re.search(r"[A-Za-z0-9]", label):
            raise ConfigError(f"compare: the label {shown(label)} names no folder; give the entry a label with letters or digits")
        if name in seen:
            same = "twice" if seen[name] == label else f"and {shown(seen[name])}: both are the folder {name!r}"
            raise ConfigError(f"compare: the labels {shown(label)} {same} once sanitised; give one a 'label' of its own in the spec")
        seen[name] = label


def parse_columns(raw: Any, where: str) -> dict[str, dict[str, Any]]:
    """A spec's `columns:` (a list of {label: ..., key: value, ...}, keys dotted or as sections): {label: sections}."""
    from raysim.config import move_flat_keys
    from raysim.config.load import check_sections, expand_dotted_keys

    if raw is None:
        return {}
    if not isinstance(raw, list) or not all(isinstance(c, dict) and isinstance(c.get("label"), str) for c in raw):
        raise ConfigError(f"{where}: columns is a list of mappings, each with a label and the keys it sets "
                          "(columns: [{label: CIFAR-10, data.dataset: cifar10, data.beta: 0.1}])")
    if len(raw) > MAX_RUNS:
        raise ConfigError(f"{where}: {len(raw):,} columns; a comparison plans at most {MAX_RUNS:,} runs")
    out: dict[str, dict[str, Any]] = {}
    for c in raw:
        label = c["label"]
        same = [o for o in out if slug(o) == slug(label)]
        if same:  # each column's cells get the folder column_<slug(label)>
            raise ConfigError(f"{where}: the columns {shown(same[0])} and {shown(label)} name one folder "
                              f"({slug(label)!r}); give each a label of its own")
        body = {k: v for k, v in c.items() if k != "label"}
        check_sections(expand_dotted_keys(body), f"{where}: column {shown(label)}")
        out[label] = move_flat_keys(expand_dotted_keys(body))
    return out


def parse_seeds(items: Any) -> list[int]:
    """--seeds 1,2,3 / `seeds: [1, 2, 3]`: distinct integers (train.seed of each replicate)."""
    items = items if isinstance(items, (list, tuple)) else [items]
    try:
        seeds = [int(str(s).strip()) for s in items if str(s).strip()]
    except ValueError:
        raise ConfigError(f"seeds: write integers (--seeds 1,2,3 or seeds: [1, 2, 3]), got {shown(items)}") from None
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds: {shown(seeds)} repeats a seed")
    return seeds


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text.replace(":", "-").replace("=", "_")).strip("_") or "default"


def run_values(spec: CompareSpec, entry: Entry, cell: dict[str, Any], out_dir: Path,
               seed: Optional[int] = None) -> dict[str, Any]:
    from raysim.config import get_dotted, merge_config, unflatten

    values = merge_config(spec.setting, {"method": entry.method})
    for k, v in cell.items():
        values = merge_config(values, spec.columns[v] if k == "column" else unflatten({k: v}))
    values = merge_config(values, entry.overrides)
    extra: dict[str, Any] = {"output": {"out_dir": str(out_dir), "progress": False}}
    if spec.rounds and get_dotted(entry.overrides, "train.rounds") is None:  # an entry's own train.rounds wins
        extra["train"] = {"rounds": spec.rounds}
    if seed is not None:
        extra.setdefault("train", {})["seed"] = seed
    return merge_config(values, extra)


def earlier_run(folder: Path, cfg: Any) -> str:
    """What `folder` holds for this entry: "none", "finished" or "partial" (to resume). A run there with
    other settings (anything but the resumable keys, e.g. execution) is refused, never reused."""
    from raysim.storage.runfolder import RunFolder, flat

    earlier = RunFolder(folder)
    if not earlier.is_run():
        return "none"
    saved_cfg = earlier.cfg
    diff = earlier.differences(cfg)
    if diff or saved_cfg.train.rounds > cfg.train.rounds:
        saved, now = flat(saved_cfg), flat(cfg)
        what = (", ".join(f"{k}={shown(saved.get(k))} (now {shown(now.get(k))})" for k in diff[:5])
                or f"train.rounds={saved_cfg.train.rounds}")
        raise ConfigError(f"{folder} holds a run with other settings: {what}; pass another --out, or delete that folder to redo it")
    done = earlier.completed_round() + 1
    return "finished" if done >= cfg.train.rounds and (folder / "summary.md").is_file() else "partial"


def plan(spec: CompareSpec, out: Path) -> list[tuple[dict[str, Any], Entry, Path, Any]]:
    """(cell, entry, run folder, validated config) of every run, in order: a typo in the last entry
    fails before the first run starts. With several seeds each (cell, entry) has a run per seed in
    <entry>/seed-<s>/; one seed (or none) keeps the single-run folder <entry>/."""
    from raysim.build import build_config

    check_size(spec)  # before the grid is expanded
    check_labels(spec.methods)
    cells = spec.cells()
    seeds: list[Optional[int]] = list(spec.seeds) or [None]
    todo = [(cell, entry, seed) for cell in cells for entry in spec.methods for seed in seeds]
    folders = [run_folder(out, cell, entry, seed if len(seeds) > 1 else None) for cell, entry, seed in todo]
    check_folders(out, todo, folders)
    configs: list[tuple[dict[str, Any], Entry, Path, Any]] = []
    for (cell, entry, seed), folder in zip(todo, folders):
        values = run_values(spec, entry, cell, folder, seed)
        try:
            configs.append((cell, entry, folder, build_config(values)))
        except ConfigError as e:
            where = f" ({cell_label(cell)})" if cell else ""
            raise ConfigError(f"compare entry {entry.label!r}{where}: {e}") from None
    return configs


def run_folder(out: Path, cell: dict[str, Any], entry: Entry, seed: Optional[int]) -> Path:
    """OUT/<cell>/<entry>/[seed-<s>/] of one run (no <cell> part without a grid)."""
    folder = out / (slug(cell_label(cell)) if cell else "") / slug(entry.label)
    return folder / f"seed-{seed}" if seed is not None else folder


def check_folders(out: Path, todo: Sequence[tuple[dict[str, Any], Entry, Optional[int]]], folders: Sequence[Path]) -> None:
    """Every run gets a folder of its own inside `out`: two grid values that sanitise alike (data.ctx "x y"
    and "x_y") would share one, and are refused naming both."""
    root = out.resolve()
    seen: dict[Path, int] = {}
    for i, folder in enumerate(folders):
        if root not in folder.resolve().parents:
            raise ConfigError(f"compare: the run {shown(str(folder))} would be written outside --out {shown(str(out))}; "
                              "give its entry a plain label")
        if folder in seen:
            (cell_a, entry_a, _), (cell_b, entry_b, _) = todo[seen[folder]], todo[i]
            a = f"{entry_a.label} [{cell_label(cell_a)}]" if cell_a else entry_a.label
            b = f"{entry_b.label} [{cell_label(cell_b)}]" if cell_b else entry_b.label
            raise ConfigError(f"compare: {shown(a)} and {shown(b)} would both be written to {shown(str(folder))} (their labels or "
                              "grid values are the same once sanitised); make them differ in letters or digits")
        seen[folder] = i


def same_runs(configs: Sequence[tuple[dict[str, Any], Entry, Path, Any]]) -> dict[int, int]:
    """{i: j} for every planned run i whose config equals that of an earlier run j in all but its output
    section (e.g. a no-DP row under a grid over dp.epsilon: the same run in every epsilon column). Such a
    run is made once, and its cells read run j's folder."""
    from raysim.storage.runfolder import flat

    first: dict[str, int] = {}
    same: dict[int, int] = {}
    for i, (_, _, _, cfg) in enumerate(configs):
        key = repr(sorted((k, repr(v)) for k, v in flat(cfg).items() if not k.startswith("output.")))
        if key in first:
            same[i] = first[key]
        else:
            first[key] = i
    return same


def execute(spec: CompareSpec, out: Path, *, log: Callable[[str], None], max_concurrent: int = 1) -> list[RunRecord]:
    """Run every (cell, entry, seed) not finished yet in out/; resume interrupted ones. Every folder is
    checked (finished / partial / other settings: refused) before the first run starts. max_concurrent 1:
    one after another in this process; otherwise as Ray tasks on the cluster (0: as many as it holds),
    raysim/tools/compare_ray.py."""
    configs = plan(spec, out)
    same = same_runs(configs)
    states = ["same" if i in same else earlier_run(folder, cfg) for i, (_, _, folder, cfg) in enumerate(configs)]
    records: list[Optional[RunRecord]] = [None] * len(configs)
    todo = []
    t_all = time.perf_counter()
    for i, ((cell, entry, folder, cfg), state) in enumerate(zip(configs, states)):
        name = run_name(entry, cell, cfg, spec)
        if state == "same":
            j = same[i]
            earlier = run_name(configs[j][1], configs[j][0], configs[j][3], spec)
            log(f"[{i + 1}/{len(configs)}] {name}: the same config as [{j + 1}] {earlier}"
                f" (only its cell differs); made once, read from {configs[j][2]}")
            continue
        if state == "finished":
            log(f"[{i + 1}/{len(configs)}] {name}: done earlier, read from {folder}")
            records[i] = RunRecord(entry, cell, folder, 0.0, seed=cfg.train.seed if spec.seeds else None)
            continue
        if state == "partial":
            cfg.output.resume = str(folder)
            log(f"[{i + 1}/{len(configs)}] {name}: resuming {folder}")
        todo.append(i)
    if todo and max_concurrent != 1:
        from raysim.tools.compare_ray import run_concurrently

        names = {i: run_name(configs[i][1], configs[i][0], configs[i][3], spec) for i in todo}
        seconds = run_concurrently({i: configs[i][3] for i in todo}, names, max_concurrent=max_concurrent, log=log)
    else:
        from raysim.engine.loop import run

        seconds = {}
        for i in todo:
            cell, entry, folder, cfg = configs[i]
            t0 = time.perf_counter()
            run(cfg)
            seconds[i] = time.perf_counter() - t0
            log(f"[{i + 1}/{len(configs)}] {run_name(entry, cell, cfg, spec)}: {cfg.train.rounds} rounds in {seconds[i]:.1f}s -> {folder}")
    for i in todo:
        cell, entry, folder, cfg = configs[i]
        records[i] = RunRecord(entry, cell, folder, seconds[i], seed=cfg.train.seed if spec.seeds else None)
    for i, j in same.items():  # the cell of run i, the results of run j
        cell, entry, _, cfg = configs[i]
        records[i] = RunRecord(entry, cell, configs[j][2], 0.0, seed=cfg.train.seed if spec.seeds else None)
    made = len(configs) - len(same)
    log(f"compare: {len(configs)} cells" + (f" from {made} distinct runs" if same else "") +
        f" in {time.perf_counter() - t_all:.0f}s")
    return [r for r in records if r is not None]


def run_name(entry: Entry, cell: dict[str, Any], cfg: Any, spec: CompareSpec) -> str:
    """How a run is named in the log: the entry, its cell, its seed when seeds are replicates."""
    where = f" [{cell_label(cell)}]" if cell else ""
    return f"{entry.label}{where}" + (f" seed {cfg.train.seed}" if len(spec.seeds) > 1 else "")


def describe(records: list[RunRecord], spec: CompareSpec) -> str:
    """One line of what the table was measured on, from the first run's config."""
    configs = [r.config() for r in records]
    cfg = configs[0]
    levels = sorted({c.dp.epsilon if c.dp.enabled else math.inf for c in configs})
    eps = ("no DP" if not cfg.dp.enabled else f"dp.epsilon={cfg.dp.epsilon:g}") if len(levels) == 1 else \
        "dp.epsilon per row: " + " / ".join("no DP" if math.isinf(e) else f"{e:g}" for e in levels)
    varied = [k for k in spec.grid]
    skew = f" beta={cfg.data.beta:g}" if cfg.data.partition in ("dirichlet", "pfllib", "dirichlet_shared_test") else ""
    parts = [cfg.data.dataset, cfg.data.partition + ("" if "data.beta" in varied else skew), f"{cfg.train.num_clients} clients",
             f"{cfg.train.rounds} rounds", _model_name(cfg), _seeds_text(configs)]
    parts += [] if "dp.epsilon" in varied else [eps]  # a grid over epsilon labels its own columns
    return ", ".join(parts) + (f" (varied: {', '.join(varied)})" if varied else "")


def _seeds_text(configs: list[Any]) -> str:
    seeds = sorted({c.train.seed for c in configs})
    return f"seed {seeds[0]}" if len(seeds) == 1 else f"{len(seeds)} seeds ({', '.join(map(str, seeds))}; mean ± std)"


def _model_name(cfg: Any) -> str:
    """The model a table was measured on: the method's own backbone where it has one (the VPDR frameworks'
    `backbone`), else the run's CLIP model."""
    from raysim.build import method_options

    backbone = getattr(method_options(cfg), "backbone", "")
    return f"backbone {backbone}" if isinstance(backbone, str) and backbone else cfg.model.name


def write_outputs(records: list[RunRecord], spec: CompareSpec, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    layout = LAYOUTS.get(spec.layout)()
    table = layout.table(records, spec)
    title = spec.title or f"{spec.layout} comparison"
    text = table.markdown(title=f"{title}: {describe(records, spec)}") + layout.extra(records, spec)
    wall = sum(r.seconds for r in records)
    if wall:
        text += f"\nWall time of the runs made by this command: {wall:.0f} s.\n"
    (out / "table.md").write_text(text)
    table.write_csv(out / "table.csv")
    bar_chart(table, layout.primary(table), out / "table.png", title)
    layout.figures(records, spec, out)
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        spec, args = spec_from_args(list(sys.argv[1:] if argv is None else argv))
        out = Path(args.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}")
        if args.dry_run:
            from raysim.tools.estimate import estimate

            runs = plan(spec, out)  # configs only: no data, no weights are loaded
            same = same_runs(runs)
            total = 0.0
            for i, (cell, entry, folder, cfg) in enumerate(runs):
                if i in same:
                    print(f"{run_name(entry, cell, cfg, spec)}: the same run as {run_name(runs[same[i]][1], runs[same[i]][0], cfg, spec)}"
                          f" (made once) -> {runs[same[i]][2]}")
                    continue
                hours = estimate(cfg)["gpu_hours"]
                total += hours
                print(f"{run_name(entry, cell, cfg, spec)}: {cfg.method}, {cfg.train.rounds} rounds, ~{hours:.3g} GPU-hours -> {folder}")
            print(f"estimated GPU-hours: {total:.3g} (FLOP-based, raysim/tools/estimate.py)")
            print(f"{len(runs) - len(same)} runs for {len(runs)} cells, layout {spec.layout}", file=sys.stderr)
            return 0
        records = execute(spec, out, log=lambda s: print(s, file=sys.stderr, flush=True), max_concurrent=args.max_concurrent)
    except KeyboardInterrupt:
        print(f"interrupted: every finished run and completed round in {out} is kept; run the same command with --out {out} "
              "to resume", file=sys.stderr)
        return 130
    except RaysimError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # an unusable --out, a full disk: one line, exit 2
        print(f"error: {os_error_line(e)}", file=sys.stderr)
        return 2
    try:
        text = write_outputs(records, spec, out)
    except KeyboardInterrupt:
        print(f"interrupted: every run is finished; run the same command with --out {out} to write the tables", file=sys.stderr)
        return 130
    except OSError as e:
        print(f"error: {os_error_line(e)}", file=sys.stderr)
        return 2
    print(text)
    print(f"tables and figures in {out}", file=sys.stderr)
    return 0
