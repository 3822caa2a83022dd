"""Run outputs: results.csv (one row per round), client_results.csv (one row per client per evaluated
round), TensorBoard scalars, and summary.md in the papers' format (In / Cross / HM, mean of the last
5 evaluated rounds)."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, Iterable, Optional

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
    "seconds",
]
CLIENT_COLUMNS = ["round", "client", "in_client", "cross_client", "in_top5", "cross_top5", "n_in", "n_cross", "epsilon"]
TIMING_COLUMNS = ("seconds",)


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
        if self.tb is not None:
            if final_metrics and hparams:
                clean = {k: v for k, v in hparams.items() if isinstance(v, (int, float, str, bool))}
                self.tb.add_hparams(clean, {f"final/{k}": v for k, v in final_metrics.items() if math.isfinite(v)}, run_name=".")
            self.tb.close()


def summarize(results_csv: Path, last: int = 5) -> dict[str, float]:
    """Mean In / Cross over the last `last` evaluated rounds; HM from the two means (SPEC 1.10)."""
    import pandas as pd

    df = pd.read_csv(results_csv)
    ev = df.dropna(subset=["in_client"]).tail(last)
    if ev.empty:
        return {"in_client": float("nan"), "cross_client": float("nan"), "hm": float("nan")}
    a, b = float(ev["in_client"].mean()), float(ev["cross_client"].mean())
    return {"in_client": a, "cross_client": b, "hm": harmonic_mean(a, b), "rounds_averaged": float(len(ev))}


def summary_table(rows: list[tuple[str, dict[str, float]]], title: str = "") -> str:
    """Markdown in the papers' format: accuracies in percent, one row per method."""
    lines = []
    if title:
        lines += [f"### {title}", ""]
    lines += ["| Method | In-Client | Cross-Client | HM |", "|---|---:|---:|---:|"]
    for name, m in rows:
        lines.append(
            f"| {name} | {100 * m['in_client']:.2f} | {100 * m['cross_client']:.2f} | {100 * m['hm']:.2f} |"
        )
    return "\n".join(lines) + "\n"
