"""The papers' comparison tables: what a layout reads (the comparison's entries and cells, each finished
run read back from its folder) and how each paper lays its table out (`LAYOUTS`: in_cross for FedSEPT,
fedtsp for FedTSP's Tables 1 and 3, vpdr for VPDR's Table 1), with the bar chart every comparison draws.
`raysim compare` (raysim/tools/compare.py) runs the comparison and writes what the layout makes."""

from __future__ import annotations

import csv
import itertools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

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
    seeds: list[int] = field(default_factory=list)  # replicates (train.seed); [] = the config's own seed, once
    # named column groups, each setting several keys at once (a paper table whose columns are different settings:
    # FedSEPT Table 4's OxfordPets / CIFAR-10 beta 0.1 / OfficeHome beta 0.1): {label: config sections}; the grid's
    # product runs inside each
    columns: dict[str, dict[str, Any]] = field(default_factory=dict)

    def size(self) -> int:
        """How many runs the comparison plans (cells x columns x entries x seeds), counted without expanding the grid."""
        return (math.prod(len(v) for v in self.grid.values()) * max(1, len(self.columns)) * len(self.methods)
                * max(1, len(self.seeds)))

    def cells(self) -> list[dict[str, Any]]:
        """The grid's product, in order: one column group each ([{}] without a grid); with `columns`, that product
        inside each named column, the cell's "column" naming it."""
        keys = list(self.grid)
        product = [dict(zip(keys, values)) for values in itertools.product(*(self.grid[k] for k in keys))] or [{}]
        if not self.columns:
            return product
        return [{"column": name, **cell} for name in self.columns for cell in product]


def cell_label(cell: dict[str, Any]) -> str:
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in cell.items())



# -- one finished run, read back from its folder ---------------------------------------------------
@dataclass
class RunRecord:
    entry: Entry
    cell: dict[str, Any]
    out_dir: Path
    seconds: float  # wall time of this comparison's run (0 when read back from an earlier one)
    seed: Optional[int] = None  # the replicate's train.seed (None: the config's own, a single-seed table)

    def rows(self, name: str) -> list[dict[str, str]]:
        with open(self.out_dir / name, newline="") as f:
            return list(csv.DictReader(f))

    def config(self) -> Any:
        from raysim.storage.runfolder import RunFolder

        return RunFolder(self.out_dir).resume_config()


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
    stds: list[list[float]] = field(default_factory=list)  # per cell: sample std over seeds (nan: n < 2); [] = one seed
    ns: list[list[int]] = field(default_factory=list)  # per cell: how many seeds the mean is over

    @property
    def replicated(self) -> bool:
        """More than one seed behind some cell: cells show mean ± std and the csv has std / n columns."""
        return any(n > 1 for row in self.ns for n in row)

    def cell_text(self, r: int, c: int) -> str:
        v = _pct(self.values[r][c])
        if self.replicated and not math.isnan(self.values[r][c]):
            sd = self.stds[r][c]
            v += f" ± {100 * sd:.2f}" if not math.isnan(sd) else ""
            v += f" (n={self.ns[r][c]})" if self.ns[r][c] != max(n for row in self.ns for n in row) else ""
        return v

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
        cells = [[name, *(style.get(ranks[r][c], "{}").format(self.cell_text(r, c)) for c in range(len(self.header)))]
                 for r, name in enumerate(self.rows)]
        legend = {"rank2": "best in bold, second underlined", "rank3": "best in bold, second underlined, third in italics",
                  "pairs": "the better of each pair in bold"}[self.marks]
        text = markdown_table(["Method", *self.header], cells, title=title)
        seeds = []
        if self.replicated:
            n = max(x for row in self.ns for x in row)
            seeds = [f"Each cell: mean ± sample std (ddof 1) over {n} seeds (a cell over fewer says n=); marks use the means."]
        return text + "\n" + " ".join([f"Accuracies in %; {legend}.", *seeds, *self.notes]) + "\n"

    def write_csv(self, path: Path) -> None:
        """One column per header (the mean, in %); with several seeds each is followed by its std and n."""
        def num(v: float) -> str:
            return "" if math.isnan(v) else f"{100 * v:.4f}"

        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            if not self.replicated:
                w.writerow(["method", *self.header])
                for name, vals in zip(self.rows, self.values):
                    w.writerow([name, *(num(v) for v in vals)])
                return
            w.writerow(["method", *(f"{h} {part}".strip() for h in self.header for part in ("mean", "std", "n"))])
            for r, name in enumerate(self.rows):
                w.writerow([name, *(x for c, v in enumerate(self.values[r])
                                    for x in (num(v), num(self.stds[r][c]), str(self.ns[r][c])))])


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
    """Rows = entries, columns = cell x metric, filled by score(record)[metric]; with several seeds per
    (entry, cell) each value is the mean over the seeds, with its sample std (ddof 1) and n beside it."""
    cells = spec.cells()
    header = [f"{cell_label(c)} {m}".strip() for c in cells for m in metrics]
    by_key: dict[tuple[str, str], list[dict[str, float]]] = defaultdict(list)
    for r in records:
        by_key[(r.entry.label, cell_label(r.cell))].append(score(r))
    stats = [[mean_std_n([s.get(m, math.nan) for s in by_key.get((e.label, cell_label(c)), [])]) for c in cells for m in metrics]
             for e in spec.methods]
    return Table(header, [e.label for e in spec.methods], [[x[0] for x in row] for row in stats],
                 groups=[e.method for e in spec.methods], stds=[[x[1] for x in row] for row in stats],
                 ns=[[x[2] for x in row] for row in stats], **kw)


def mean_std_n(values: list[float]) -> tuple[float, float, int]:
    """Mean, sample std (ddof 1; nan below 2 values) and count of the finite values."""
    xs = [v for v in values if not math.isnan(v)]
    if not xs:
        return math.nan, math.nan, 0
    mean = math.fsum(xs) / len(xs)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else math.nan
    return mean, std, len(xs)


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
        scores: dict[Path, dict[str, float]] = {}
        for r in records:
            t = vpdr_table(r.out_dir / "client_results.csv")  # the run's protocol numbers (STD ddof = 1)
            domains += [d for d in t if d not in ("AVG", "STD") and d not in domains]
            scores[r.out_dir] = t
        metrics = [*domains, "AVG", "STD"]
        shared = any((r.out_dir / "config.yaml").is_file() and r.config().data.partition == "dirichlet_shared_test"
                     for r in records)
        where = ("every client tests on the one shared test set (partition dirichlet_shared_test)" if shared
                 else "each client tests on its own split")
        table = grid_table(records, spec, metrics, lambda r: scores[r.out_dir], marks="pairs",
                           notes=[f"Last round; {where}; STD over clients (lower is better)."])
        if table.replicated:  # the paper's STD is across clients (domains): kept per run, then averaged over seeds
            table.notes.append("With several seeds: each domain and AVG is the mean over seeds, STD the mean over seeds of "
                               "each run's STD over clients; the ± after every value is the spread across seeds.")
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
        err = None
        if table.replicated:  # error bars: the sample std over seeds
            err = [100 * table.stds[r][c] if not math.isnan(table.stds[r][c]) else 0 for c in columns]
        ax.bar(xs, [100 * table.values[r][c] if not math.isnan(table.values[r][c]) else 0 for c in columns], width, label=name,
               yerr=err, capsize=2 if err else 0)
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
