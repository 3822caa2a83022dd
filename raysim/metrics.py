"""Run outputs: results.csv (one row per round), client_results.csv (one row per client per evaluated
round), TensorBoard scalars, summary.md in the papers' format (In / Cross / HM, mean of the last
5 evaluated rounds) and curves.png (accuracy, loss and epsilon per round). `markdown_table` writes every
Markdown table raysim and its benchmarks print."""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

ROUND_COLUMNS = [
    "round",
    "in_client",
    "cross_client",
    "hm",
    "train_loss",
    "bytes_up",
    "bytes_down",
    "epsilon_max",
    "participants",
    "dropped",
    "eval_clients",  # clients evaluated in the round (eval.clients; empty on rounds without evaluation)
    "seconds",
]
CLIENT_COLUMNS = ["round", "client", "in_client", "cross_client", "in_top5", "cross_top5", "n_in", "n_cross", "epsilon", "domain"]
TIMING_COLUMNS = ("seconds",)
CURVES = "curves.png"

log = logging.getLogger(__name__)


def harmonic_mean(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)) or a + b <= 0:
        return float("nan") if not (math.isfinite(a) and math.isfinite(b)) else 0.0
    return 2 * a * b / (a + b)


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        return "" if math.isnan(v) else repr(round(v, 10))
    return v


class CsvTable:
    """An append-only CSV with a fixed header; on resume, rows after a round are dropped first."""

    def __init__(self, path: Path, columns: list[str]) -> None:
        self.path = path
        self.columns = columns

    def truncate_after(self, round_idx: int) -> None:
        if not self.path.is_file():
            return
        with self.path.open(newline="") as f:
            rows = [r for r in csv.DictReader(f) if int(r["round"]) <= round_idx]
        self._write(rows, mode="w")

    def append(self, rows: Iterable[dict[str, Any]]) -> None:
        self._write([{k: _fmt(r.get(k, "")) for k in self.columns} for r in rows], mode="a")

    def _write(self, rows: list[dict[str, Any]], mode: str) -> None:
        new = mode == "w" or not self.path.is_file()
        with self.path.open(mode, newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.columns)
            if new:
                w.writeheader()
            w.writerows(rows)


TB_WRITER_THREAD = "_AsyncWriterThread"  # tensorboard.summary.writer.event_file_writer's background writer


def _quiet_writer_thread_errors() -> None:
    """TensorBoard writes event files from a thread of its own; when a write fails (a full disk) the thread keeps
    the error, which the run's next add_scalar / flush raises in the main thread (and the front door reports as one
    line), and dies printing its traceback through threading.excepthook. That second copy, a traceback, is dropped
    here (logged at debug level); every other thread's exception is printed as before."""
    import threading

    previous = threading.excepthook
    if getattr(previous, "raysim_quiet_tb", False):
        return

    def hook(args: Any) -> None:
        thread = args.thread
        if type(thread).__name__ == TB_WRITER_THREAD and getattr(thread, "exception", None) is args.exc_value:
            log.debug("TensorBoard's writer thread stopped: %s (raised again in the run)", args.exc_value)
            return
        previous(args)

    hook.raysim_quiet_tb = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class RunLogger:
    def __init__(self, out_dir: Path, *, tensorboard: bool, hparams: Optional[dict[str, Any]] = None,
                 extra_columns: tuple[str, ...] = ()) -> None:
        """`extra_columns`: the method's declared metrics, as train_<name> (client mean) and server_<name>."""
        self.out_dir = out_dir
        self.extra_columns = tuple(extra_columns)
        self.rounds = CsvTable(out_dir / "results.csv", ROUND_COLUMNS + list(self.extra_columns))
        self.clients = CsvTable(out_dir / "client_results.csv", CLIENT_COLUMNS)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_writer_thread_errors()
            self.tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
            if hparams:
                self.tb.add_text("config", "\n".join(f"    {k}: {v}" for k, v in sorted(hparams.items())), 0)

    def resume_at(self, completed_round: int) -> None:
        self.rounds.truncate_after(completed_round)
        self.clients.truncate_after(completed_round)

    def log_round(self, row: dict[str, Any], client_rows: list[dict[str, Any]]) -> None:
        self.rounds.append([row])
        if client_rows:
            self.clients.append(client_rows)
        if self.tb is not None:
            r = int(row["round"])
            for key, tag in (
                ("in_client", "accuracy/in_client"),
                ("cross_client", "accuracy/cross_client"),
                ("hm", "accuracy/hm"),
                ("train_loss", "train/loss"),
                ("bytes_up", "comm/bytes_up"),
                ("bytes_down", "comm/bytes_down"),
                ("epsilon_max", "privacy/epsilon_max"),
                ("dropped", "clients/dropped"),
                ("seconds", "time/round_seconds"),
                *((k, k.replace("_", "/", 1)) for k in self.extra_columns),
            ):
                v = row.get(key)
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(tag, v, r)
            for c in client_rows:
                eps = c.get("epsilon")
                if isinstance(eps, float) and math.isfinite(eps):
                    self.tb.add_scalar(f"privacy/epsilon_client_{c['client']}", eps, r)
            self.tb.flush()

    def close(self, final_metrics: Optional[dict[str, float]] = None, hparams: Optional[dict[str, Any]] = None) -> None:
        """End of a run (a resumed one too): curves.png from the whole results.csv, TensorBoard closed."""
        if self.rounds.path.is_file():
            try:
                write_curves(self.rounds.path, self.out_dir / CURVES)
            except Exception as e:  # a plot must never cost a finished run its other outputs
                log.warning("could not write %s: %s", self.out_dir / CURVES, e)
        if self.tb is not None:
            if final_metrics and hparams:
                clean = {k: v for k, v in hparams.items() if isinstance(v, (int, float, str, bool))}
                self.tb.add_hparams(clean, {f"final/{k}": v for k, v in final_metrics.items() if math.isfinite(v)}, run_name=".")
            self.tb.close()


def summarize(results_csv: Path, last: int = 5) -> dict[str, float]:
    """Mean In / Cross over the last `last` evaluated rounds; HM from the two means (SPEC 1.10)."""
    import pandas as pd

    df = results_csv if isinstance(results_csv, pd.DataFrame) else pd.read_csv(results_csv)
    ev = df.dropna(subset=["in_client"]).tail(last)
    if ev.empty:
        return {"in_client": float("nan"), "cross_client": float("nan"), "hm": float("nan")}
    a, b = float(ev["in_client"].mean()), float(ev["cross_client"].mean())
    return {"in_client": a, "cross_client": b, "hm": harmonic_mean(a, b), "rounds_averaged": float(len(ev))}


def markdown_table(
    header: Sequence[str], rows: Iterable[Sequence[Any]], *, align: Optional[str] = None, title: str = ""
) -> str:
    """One Markdown table: `header` cells, then `rows` of cells (each written with str(), so format
    numbers first). `align` has one letter per column, "l" (`---`) or "r" (`---:`); by default the first
    column is left-aligned and the others right-aligned (labels, then numbers). `title` adds a `### title`
    line and a blank line above the table. Ends with a newline."""
    header = [str(h) for h in header]
    align = align if align is not None else "l" + "r" * (len(header) - 1)
    if len(align) != len(header) or set(align) - {"l", "r"}:
        raise ValueError(f"align={align!r} needs one of 'l'/'r' per column ({len(header)} columns)")
    lines = [f"### {title}", ""] if title else []
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    for row in rows:
        cells = [str(c) for c in row]
        if len(cells) != len(header):
            raise ValueError(f"a row has {len(cells)} cells for {len(header)} columns: {cells}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summary_table(rows: list[tuple[str, dict[str, float]]], title: str = "") -> str:
    """Markdown in the papers' format: accuracies in percent, one row per method."""
    return markdown_table(
        ["Method", "In-Client", "Cross-Client", "HM"],
        [[name, *(f"{100 * m[k]:.2f}" for k in ("in_client", "cross_client", "hm"))] for name, m in rows],
        title=title,
    )


def write_curves(results_csv: Path, path: Path) -> Path:
    """curves.png: In-Client, Cross-Client and HM (%) on the evaluated rounds, the mean training loss per
    round, and epsilon_max per round when DP is on (any finite value)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    df = pd.read_csv(results_csv)
    rounds = df["round"] + 1  # 1-based on the axis: "after round 1"
    eps = df["epsilon_max"] if "epsilon_max" in df else pd.Series(dtype=float)
    dp = bool(eps.notna().any()) and bool(((eps != math.inf) & eps.notna()).any())
    panels = 3 if dp else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.4))
    ax = axes[0]
    ev = df.dropna(subset=["in_client"])
    for col, label in (("in_client", "In-Client"), ("cross_client", "Cross-Client"), ("hm", "HM")):
        if col in ev and ev[col].notna().any():
            ax.plot(ev["round"] + 1, 100 * ev[col], marker="o", ms=3, label=label)
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("accuracy (evaluated rounds)")
    if ax.lines:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[1]
    ax.plot(rounds, df["train_loss"], color="tab:red")
    ax.set_xlabel("round")
    ax.set_ylabel("train loss")
    ax.set_title("mean client training loss")
    ax.grid(alpha=0.3)
    if dp:
        ax = axes[2]
        ax.plot(rounds, eps, color="tab:purple")
        ax.set_xlabel("round")
        ax.set_ylabel("epsilon")
        ax.set_title("epsilon_max (over clients)")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path
