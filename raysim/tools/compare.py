"""`raysim compare`: several methods on one setting (or a grid of settings), one paper-layout table.

    raysim compare --methods zeroshot,promptfl,fedsept,fedsept:variant=wo_r --rounds 10 dp.epsilon=1
    raysim compare benchmarks/tables/fedtsp_table1.yaml --rounds 3
    raysim compare --methods fedproto,fedtgp,fedtsp --grid data.beta=0.1,0.5,1.0 --layout fedtsp

A method entry is `name` or `name:key=value;key=value`: a key without a dot sets an option of the
method's own section (`fedsept:rank=8`), a dotted key any config key for that entry only
(`promptfl:train.ctx_init=`). `--grid key=v1,v2` adds a column group per value (several grids: their
product); the remaining `key=value` arguments apply to every run. A spec file (YAML) holds the same:

    title: ...
    layout: in_cross            # in_cross (FedSEPT) | fedtsp (FedTSP Table 1/3) | vpdr (VPDR Table 1)
    rounds: 10
    methods: [promptfl, "fedsept:rank=8", {label: "FedSEPT w/o R", method: fedsept, fedsept: {variant: wo_r}}]
    grid: {data.beta: [0.1, 0.5]}
    setting: {data: {dataset: synthetic-large}, train: {num_clients: 10}}

Runs go one after another into OUT/<cell>/<entry>/ (their usual run folders). The comparison is
resumable: a finished run is read back, an interrupted one is resumed (`output.resume`), so running the
same command again completes a table without redoing work. It writes OUT/table.md, table.csv and
table.png (plus the layout's own figures) and prints the Markdown.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from raysim.errors import ConfigError
from raysim.registry import Registry


# -- what to run ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """One row: a method and the overrides that make it this row."""

    label: str
    method: str
    overrides: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass
class CompareSpec:
    methods: list[Entry]
    grid: dict[str, list[Any]] = field(default_factory=dict)
    setting: dict[str, Any] = field(default_factory=dict)
    layout: str = "in_cross"
    rounds: int = 0  # 0: the config's own
    title: str = ""

    def cells(self) -> list[dict[str, Any]]:
        """The grid's product, in order: one column group each ([{}] without a grid)."""
        keys = list(self.grid)
        return [dict(zip(keys, values)) for values in itertools.product(*(self.grid[k] for k in keys))] or [{}]


def parse_entry(text: str) -> Entry:
    """`fedsept:rank=8;variant=wo_r` -> Entry(label=text, method=fedsept, overrides={fedsept: {...}})."""
    from raysim.config import deep_merge, parse_overrides

    name, _, own = text.strip().partition(":")
    if not name:
        raise ConfigError(f"--methods: empty method name in {text!r}; write name or name:key=value;key=value")
    overrides: dict[str, Any] = {}
    for item in [kv for kv in own.split(";") if kv.strip()]:
        key = item.split("=", 1)[0].strip()
        overrides = deep_merge(overrides, parse_overrides([item if "." in key else f"{name}.{item}"]))
    return Entry(label=text.strip(), method=name, overrides=overrides)


def entry_from(item: Any) -> Entry:
    if isinstance(item, str):
        return parse_entry(item)
    if isinstance(item, dict) and "method" in item:
        rest = {k: v for k, v in item.items() if k not in ("label", "method")}
        from raysim.config import move_flat_keys

        return Entry(label=str(item.get("label", item["method"])), method=str(item["method"]), overrides=move_flat_keys(rest))
    raise ConfigError(f"methods: each entry is 'name[:key=value;...]' or a mapping with 'method' (and 'label'); got {item!r}")


def parse_grid(items: Sequence[str]) -> dict[str, list[Any]]:
    import yaml

    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise ConfigError(f"--grid {item!r}: write key=v1,v2 (for example --grid data.beta=0.1,0.5,1.0)")
        grid[key.strip()] = [yaml.safe_load(v) for v in values.split(",")]
    return grid


def spec_from_args(argv: Sequence[str]) -> tuple[CompareSpec, argparse.Namespace]:
    from raysim.config import deep_merge, load_yaml, move_flat_key, move_flat_keys, parse_user_overrides

    p = argparse.ArgumentParser(prog="raysim compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="", help="comma-separated entries: name or name:key=value;key=value")
    p.add_argument("--grid", action="append", default=[], help="key=v1,v2: a column group per value (repeatable)")
    p.add_argument("--layout", default="", help=f"table layout: {', '.join(LAYOUTS.names())}")
    p.add_argument("--rounds", type=int, default=0, help="rounds of every run (default: the spec's or the config's)")
    p.add_argument("--out", default="", help="folder of the runs and tables (default runs/compare-<time>)")
    p.add_argument("--title", default="")
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
    unknown = set(raw) - {"title", "layout", "rounds", "methods", "grid", "setting"}
    if unknown:
        raise ConfigError(f"{a.spec}: unknown keys {sorted(unknown)}; a spec has title, layout, rounds, methods, grid, setting")
    methods = [entry_from(m) for m in raw.get("methods", [])]
    if a.methods:
        methods = [parse_entry(m) for m in a.methods.split(",") if m.strip()]
    if not methods:
        raise ConfigError("compare: no methods; pass --methods promptfl,fedsept or a spec file with 'methods:'")
    labels = [m.label for m in methods]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"compare: two entries share a label ({labels}); give one a 'label' in the spec")
    # the spec file and the command line are user input: old flat keys are moved into their sections here, once
    grid = {move_flat_key(str(k)): list(v) if isinstance(v, list) else [v] for k, v in (raw.get("grid") or {}).items()}
    grid.update({move_flat_key(k): v for k, v in parse_grid(a.grid).items()})
    setting = deep_merge(move_flat_keys(dict(raw.get("setting") or {})), parse_user_overrides(a.overrides))
    layout = a.layout or str(raw.get("layout", "in_cross"))
    LAYOUTS.get(layout)  # unknown layout: a ConfigError naming the known ones
    spec = CompareSpec(methods=methods, grid=grid, setting=setting, layout=layout,
                       rounds=int(a.rounds or raw.get("rounds", 0)), title=a.title or str(raw.get("title", "")))
    return spec, a


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text.replace(":", "-").replace("=", "_")).strip("_") or "default"


def cell_label(cell: dict[str, Any]) -> str:
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in cell.items())


def run_values(spec: CompareSpec, entry: Entry, cell: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    from raysim.config import merge_config, unflatten

    values = merge_config(spec.setting, {"method": entry.method})
    for k, v in cell.items():
        values = merge_config(values, unflatten({k: v}))
    values = merge_config(values, entry.overrides)
    extra: dict[str, Any] = {"output": {"out_dir": str(out_dir), "progress": False}}
    if spec.rounds:
        extra["train"] = {"rounds": spec.rounds}
    return merge_config(values, extra)


# -- one finished run, read back from its folder ---------------------------------------------------
@dataclass
class RunRecord:
    entry: Entry
    cell: dict[str, Any]
    out_dir: Path
    seconds: float  # wall time of this comparison's run (0 when read back from an earlier one)

    def rows(self, name: str) -> list[dict[str, str]]:
        with open(self.out_dir / name, newline="") as f:
            return list(csv.DictReader(f))

    def config(self) -> Any:
        from raysim.engine.loop import resume_config

        return resume_config(self.out_dir)


def earlier_run(folder: Path, cfg: Any) -> str:
    """What `folder` holds for this entry: "none", "finished" or "partial" (to resume). A run there with
    other settings (anything but the resumable keys, e.g. execution) is refused, never reused."""
    from raysim.config import load_yaml
    from raysim.config.checks import build_config
    from raysim.engine.loop import flat_config
    from raysim.storage.store import StateStore

    if not (folder / "config.yaml").is_file():
        return "none"
    saved_cfg = build_config(load_yaml(folder / "config.yaml"))
    saved, now, allowed = flat_config(saved_cfg), flat_config(cfg), cfg.resumable_keys()
    diff = sorted(k for k in set(saved) | set(now) if k not in allowed and saved.get(k) != now.get(k))
    if diff or saved_cfg.train.rounds > cfg.train.rounds:
        what = ", ".join(f"{k}={saved.get(k)!r} (now {now.get(k)!r})" for k in diff) or f"train.rounds={saved_cfg.train.rounds}"
        raise ConfigError(f"{folder} holds a run with other settings: {what}; pass another --out, or delete that folder to redo it")
    done = StateStore(folder).completed_round() + 1
    return "finished" if done >= cfg.train.rounds and (folder / "summary.md").is_file() else "partial"


def plan(spec: CompareSpec, out: Path) -> list[tuple[dict[str, Any], Entry, Path, Any]]:
    """(cell, entry, run folder, validated config) of every run, in order: a typo in the last entry
    fails before the first run starts."""
    from raysim.config.checks import build_config

    cells = spec.cells()
    todo = [(cell, entry) for cell in cells for entry in spec.methods]
    configs: list[tuple[dict[str, Any], Entry, Path, Any]] = []
    for cell, entry in todo:
        folder = out / (slug(cell_label(cell)) if cell else "") / slug(entry.label)
        values = run_values(spec, entry, cell, folder)
        try:
            configs.append((cell, entry, folder, build_config(values)))
        except ConfigError as e:
            where = f" ({cell_label(cell)})" if cell else ""
            raise ConfigError(f"compare entry {entry.label!r}{where}: {e}") from None
    return configs


def execute(spec: CompareSpec, out: Path, *, log: Callable[[str], None]) -> list[RunRecord]:
    """Run every (cell, entry) not finished yet in out/, in order; resume interrupted ones."""
    from raysim.engine.loop import run

    configs = plan(spec, out)
    records = []
    t_all = time.perf_counter()
    for i, (cell, entry, folder, cfg) in enumerate(configs, 1):
        where = f" [{cell_label(cell)}]" if cell else ""
        state = earlier_run(folder, cfg)
        if state == "finished":
            log(f"[{i}/{len(configs)}] {entry.label}{where}: done earlier, read from {folder}")
            records.append(RunRecord(entry, cell, folder, 0.0))
            continue
        if state == "partial":
            cfg.output.resume = str(folder)
            log(f"[{i}/{len(configs)}] {entry.label}{where}: resuming {folder}")
        t0 = time.perf_counter()
        run(cfg)
        dt = time.perf_counter() - t0
        log(f"[{i}/{len(configs)}] {entry.label}{where}: {cfg.train.rounds} rounds in {dt:.1f}s -> {folder}")
        records.append(RunRecord(entry, cell, folder, dt))
    log(f"compare: {len(configs)} runs in {time.perf_counter() - t_all:.0f}s")
    return records


# -- table layouts -------------------------------------------------------------------------------
@dataclass
class Table:
    """Rows = entries, columns grouped by cell; `values[row][col]` are fractions (nan = missing).
    `marks`: "rank2" (best bold, second underlined), "rank3" (+ third italic), "pairs" (the better of
    rows that share a method, bold)."""

    header: list[str]  # column names (without the row-label column)
    rows: list[str]
    values: list[list[float]]
    marks: str = "rank2"
    higher_better: list[bool] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)  # per row: pairing key for marks="pairs"
    notes: list[str] = field(default_factory=list)

    def ranks(self) -> list[list[int]]:
        """rank[row][col]: 1 = best ... (0 = unmarked)."""
        n_rows, n_cols = len(self.rows), len(self.header)
        better = self.higher_better or [True] * n_cols
        out = [[0] * n_cols for _ in range(n_rows)]
        if self.marks == "pairs":
            by_group: dict[str, list[int]] = defaultdict(list)
            for r, g in enumerate(self.groups):
                by_group[g].append(r)
            sets = [rows for rows in by_group.values() if len(rows) > 1]
            depth = 1
        else:
            sets = [list(range(n_rows))]
            depth = 3 if self.marks == "rank3" else 2
        for c in range(n_cols):
            for rows in sets:
                vals = sorted({round(self.values[r][c], 6) for r in rows if not math.isnan(self.values[r][c])},
                              reverse=better[c])
                for r in rows:
                    v = self.values[r][c]
                    if not math.isnan(v) and round(v, 6) in vals[:depth]:
                        out[r][c] = vals.index(round(v, 6)) + 1
        return out

    def markdown(self, title: str = "") -> str:
        from raysim.metrics import markdown_table

        style = {1: "**{}**", 2: "<u>{}</u>", 3: "*{}*"}
        ranks = self.ranks()
        cells = [[name, *(style.get(ranks[r][c], "{}").format(_pct(self.values[r][c])) for c in range(len(self.header)))]
                 for r, name in enumerate(self.rows)]
        legend = {"rank2": "best in bold, second underlined", "rank3": "best in bold, second underlined, third in italics",
                  "pairs": "the better of each pair in bold"}[self.marks]
        text = markdown_table(["Method", *self.header], cells, title=title)
        return text + "\n" + " ".join([f"Accuracies in %; {legend}.", *self.notes]) + "\n"

    def write_csv(self, path: Path) -> None:
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["method", *self.header])
            for name, vals in zip(self.rows, self.values):
                w.writerow([name, *("" if math.isnan(v) else f"{100 * v:.4f}" for v in vals)])


def _pct(v: float) -> str:
    return "–" if math.isnan(v) else f"{100 * v:.2f}"


class Layout:
    """How a paper lays its comparison table out, from the finished runs' folders."""

    name = ""

    def table(self, records: list[RunRecord], spec: CompareSpec) -> Table:
        raise NotImplementedError

    def primary(self, table: Table) -> list[int]:
        """The columns the bar chart shows (one per cell)."""
        return list(range(len(table.header)))

    def figures(self, records: list[RunRecord], spec: CompareSpec, out: Path) -> list[Path]:
        return []

    def extra(self, records: list[RunRecord], spec: CompareSpec) -> str:
        """More Markdown under the table (e.g. FedTSP's semantic structure of the global prototypes)."""
        return ""


LAYOUTS: Registry[type[Layout]] = Registry("comparison layout")


def grid_table(records: list[RunRecord], spec: CompareSpec, metrics: list[str], score: Callable[[RunRecord], dict[str, float]],
               **kw: Any) -> Table:
    """Rows = entries, columns = cell x metric, filled by score(record)[metric]."""
    cells = spec.cells()
    header = [f"{cell_label(c)} {m}".strip() for c in cells for m in metrics]
    by_key = {(r.entry.label, cell_label(r.cell)): score(r) for r in records}
    values = [[by_key.get((e.label, cell_label(c)), {}).get(m, math.nan) for c in cells for m in metrics] for e in spec.methods]
    return Table(header, [e.label for e in spec.methods], values, groups=[e.method for e in spec.methods], **kw)


@LAYOUTS.add
class InCrossLayout(Layout):
    """FedSEPT's tables: In-Client / Cross-Client / HM per setting, the mean of the last `eval.last`
    evaluated rounds (SPEC 1.10); best bold, second underlined."""

    name = "in_cross"

    def table(self, records, spec):
        from raysim.metrics import summarize

        def score(r: RunRecord) -> dict[str, float]:
            s = summarize(r.out_dir / "results.csv", last=max(1, r.config().eval.last))
            return {"In-Client": s["in_client"], "Cross-Client": s["cross_client"], "HM": s["hm"]}

        return grid_table(records, spec, ["In-Client", "Cross-Client", "HM"], score, marks="rank2",
                          notes=["Mean of the last eval.last evaluated rounds (SPEC 1.10)."])

    def primary(self, table):
        return [i for i, h in enumerate(table.header) if h.endswith("HM")]


@LAYOUTS.add
class FedTSPLayout(Layout):
    """FedTSP's Table 1 / 3: per setting (e.g. Dirichlet alpha per dataset) the sample-weighted local
    accuracy at the best round (SPEC 2.10.6), top three marked; figures: the convergence curves (Figure 6)
    and local vs global accuracy (Figure 4)."""

    name = "fedtsp"

    def table(self, records, spec):
        from raysim.engine.evaluation import fedtsp_round_metrics

        def score(r: RunRecord) -> dict[str, float]:
            per_round = fedtsp_round_metrics(r.out_dir / "client_results.csv")
            if not per_round:
                return {}
            best = max(per_round.values(), key=lambda m: m["local"])
            return {"": best["local"]}

        return grid_table(records, spec, [""], score, marks="rank3",
                          notes=["Sample-weighted accuracy over the clients' own test splits, best round (FedTSP's protocol)."])

    def extra(self, records, spec):
        """fedtsp.txt Figure 1's measures of the final global prototypes (FedTSP's text prototypes,
        FedProto / FedTGP's prototypes), where the run keeps some and its dataset has a known hierarchy."""
        from raysim.metrics import markdown_table

        rows = []
        for r in records:
            s = semantic_structure(r)
            if s is not None:
                rows.append([f"{r.entry.label} {cell_label(r.cell)}".strip(), f"{s['spearman']:.3f}", f"{s['semantic_gap']:.3f}"])
        if not rows:
            return ""
        return "\n" + markdown_table(["Method", "Spearman rho vs hierarchy", "semantic gap"], rows,
                                      title="Semantic structure of the global prototypes (fedtsp.txt Figure 1)")

    def figures(self, records, spec, out):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from raysim.engine.evaluation import fedtsp_round_metrics

        cells = spec.cells()
        paths = []
        fig, axes = plt.subplots(1, len(cells), figsize=(4.5 * len(cells), 3.6), squeeze=False)
        fig2, axes2 = plt.subplots(1, len(cells), figsize=(4.5 * len(cells), 3.6), squeeze=False)
        for ax, ax2, cell in zip(axes[0], axes2[0], cells):
            for r in [r for r in records if r.cell == cell]:
                per_round = fedtsp_round_metrics(r.out_dir / "client_results.csv")
                if not per_round:
                    continue
                xs = [k + 1 for k in per_round]
                ax.plot(xs, [100 * m["local"] for m in per_round.values()], marker="o", ms=2, label=r.entry.label)
                best = max(per_round.values(), key=lambda m: m["local"])
                ax2.scatter(100 * best["global"], 100 * best["local"], label=r.entry.label)
                ax2.annotate(r.entry.label, (100 * best["global"], 100 * best["local"]), fontsize=7)
            for a, xl, yl in ((ax, "round", "local accuracy (%)"), (ax2, "global accuracy (%)", "local accuracy (%)")):
                a.set_title(cell_label(cell) or spec.title or "comparison", fontsize=9)
                a.set_xlabel(xl)
                a.set_ylabel(yl)
                a.grid(alpha=0.3)
            ax.legend(fontsize=7)
        for f, name in ((fig, "convergence.png"), (fig2, "local_vs_global.png")):
            f.tight_layout()
            f.savefig(out / name, dpi=110)
            plt.close(f)
            paths.append(out / name)
        return paths


def semantic_structure(r: RunRecord) -> Optional[dict[str, float]]:
    from raysim.data import DATASETS, LoadSpec
    from raysim.methods.fedtsp.fedtsp_semantics import semantic_report
    from raysim.storage.store import StateStore

    cfg = r.config()
    state = StateStore(r.out_dir).load_server(cfg.train.rounds - 1) or {}
    protos = state.get("text_protos", state.get("protos"))
    if protos is None or float(protos.abs().sum()) == 0:
        return None
    try:
        spec = LoadSpec(data_root=cfg.data.data_root, image_size=32, cache_dir=cfg.output.cache_dir)
        return semantic_report(protos, cfg.data.dataset, DATASETS.get(cfg.data.dataset)(spec).classnames)
    except ConfigError:
        return None


@LAYOUTS.add
class VPDRLayout(Layout):
    """VPDR's Table 1: per-domain accuracy (the mean over that domain's clients of their own-test accuracy),
    AVG and STD (sample std, ddof = 1, as the paper's column) over clients, at the last round (SPEC 3.4);
    the better of each pair of rows of one method (e.g. IGPP vs VPDR) in bold. A run without domains has one column `all`."""

    name = "vpdr"

    def table(self, records: list[RunRecord], spec: CompareSpec) -> Table:
        from raysim.engine.evaluation import vpdr_table

        domains: list[str] = []
        scores: dict[tuple[str, str], dict[str, float]] = {}
        for r in records:
            t = vpdr_table(r.out_dir / "client_results.csv")  # the run's protocol numbers (STD ddof = 1)
            domains += [d for d in t if d not in ("AVG", "STD") and d not in domains]
            scores[(r.entry.label, cell_label(r.cell))] = t
        metrics = [*domains, "AVG", "STD"]
        shared = any((r.out_dir / "config.yaml").is_file() and r.config().data.partition == "dirichlet_shared_test"
                     for r in records)
        where = ("every client tests on the one shared test set (partition dirichlet_shared_test)" if shared
                 else "each client tests on its own split")
        table = grid_table(records, spec, metrics, lambda r: scores[(r.entry.label, cell_label(r.cell))], marks="pairs",
                           notes=[f"Last round; {where}; STD over clients (lower is better)."])
        table.higher_better = [not h.endswith("STD") for h in table.header]
        return table

    def primary(self, table):
        return [i for i, h in enumerate(table.header) if h.endswith("AVG")]


def bar_chart(table: Table, columns: list[int], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_rows = len(table.rows)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(columns) * max(1, n_rows) * 0.35 + 2), 3.8))
    width = 0.8 / max(1, n_rows)
    for r, name in enumerate(table.rows):
        xs = [c + (r - (n_rows - 1) / 2) * width for c in range(len(columns))]
        ax.bar(xs, [100 * table.values[r][c] if not math.isnan(table.values[r][c]) else 0 for c in columns], width, label=name)
    ax.set_xticks(range(len(columns)))
    ax.set_xticklabels([table.header[c] for c in columns], fontsize=8, rotation=15)
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
             f"{cfg.train.rounds} rounds", _model_name(cfg), f"seed {cfg.train.seed}"]
    parts += [] if "dp.epsilon" in varied else [eps]  # a grid over epsilon labels its own columns
    return ", ".join(parts) + (f" (varied: {', '.join(varied)})" if varied else "")


def _model_name(cfg: Any) -> str:
    """The model a table was measured on: the method's own backbone where it has one (the VPDR frameworks'
    `backbone`), else the run's CLIP model."""
    from raysim.config.checks import method_options

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
            runs = plan(spec, out)
            for cell, entry, folder, cfg in runs:
                print(f"{entry.label}{f' [{cell_label(cell)}]' if cell else ''}: {cfg.method}, {cfg.train.rounds} rounds -> {folder}")
            print(f"{len(runs)} runs, layout {spec.layout}", file=sys.stderr)
            return 0
        records = execute(spec, out, log=lambda s: print(s, file=sys.stderr, flush=True))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(write_outputs(records, spec, out))
    print(f"tables and figures in {out}", file=sys.stderr)
    return 0
