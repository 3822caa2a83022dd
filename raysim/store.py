"""The run's state on disk: the server's shared state and each client's private state per round.

Layout under `out_dir/state/`:
  server/<round>.pt            global shared state after that round
  clients/<cid>/<round>.pt     a client's private state (and privacy ledger) after a round it changed in
  progress.json                {"completed_round": r}: written last, once every piece of round r is on disk

With `record_uploads=true`, `out_dir/uploads/<round>.pt` also holds what the server saw in a round (an
attacker's view, read by raysim.attacks): {"pre": broadcast state, "uploads": {cid: {name: tensor}},
"num_samples": {cid: n}}, clients in id order.

A resumed run continues from `completed_round`; versions newer than it (an interrupted round) are
ignored, so a crash at any moment leaves a consistent state to resume from. Files are written to a
temporary name and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch


def atomic_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _versions(folder: Path) -> list[int]:
    if not folder.is_dir():
        return []
    return sorted(int(p.stem) for p in folder.glob("*.pt") if p.stem.isdigit())


class StateStore:
    def __init__(self, out_dir: str | Path) -> None:
        self.root = Path(out_dir) / "state"

    # -- progress ---------------------------------------------------------------------------
    def completed_round(self) -> int:
        p = self.root / "progress.json"
        if not p.is_file():
            return -1
        return int(json.loads(p.read_text())["completed_round"])

    def mark_complete(self, round_idx: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".progress.json.tmp{os.getpid()}"
        tmp.write_text(json.dumps({"completed_round": round_idx}))
        os.replace(tmp, self.root / "progress.json")

    # -- server -----------------------------------------------------------------------------
    def save_server(self, round_idx: int, state: dict) -> None:
        atomic_save(state, self.root / "server" / f"{round_idx:05d}.pt")
        self._prune(self.root / "server", keep_from=round_idx - 1)

    def load_server(self, upto_round: int) -> Optional[dict]:
        return self._load_latest(self.root / "server", upto_round)

    # -- clients ----------------------------------------------------------------------------
    def save_client(self, client_id: int, round_idx: int, state: dict) -> None:
        folder = self.root / "clients" / str(client_id)
        atomic_save(state, folder / f"{round_idx:05d}.pt")

    def load_client(self, client_id: int, upto_round: int) -> Optional[dict]:
        return self._load_latest(self.root / "clients" / str(client_id), upto_round)

    def prune_client(self, client_id: int, completed_round: int) -> None:
        """Drop versions that a resume from `completed_round` (or later) can never need."""
        folder = self.root / "clients" / str(client_id)
        usable = [v for v in _versions(folder) if v <= completed_round]
        if usable:
            self._prune(folder, keep_from=usable[-1])

    # -- what the server saw (record_uploads) ----------------------------------------------
    @property
    def uploads_dir(self) -> Path:
        return self.root.parent / "uploads"

    def save_uploads(self, round_idx: int, record: dict) -> None:
        atomic_save(record, self.uploads_dir / f"{round_idx:05d}.pt")

    def upload_rounds(self) -> list[int]:
        """Recorded rounds, up to the last completed one (a half-finished round is not part of the run)."""
        done = self.completed_round()
        return [r for r in _versions(self.uploads_dir) if r <= done]

    def load_uploads(self, round_idx: int) -> dict:
        return torch.load(self.uploads_dir / f"{round_idx:05d}.pt", map_location="cpu", weights_only=True)

    # -- helpers ----------------------------------------------------------------------------
    @staticmethod
    def _load_latest(folder: Path, upto_round: int) -> Optional[dict]:
        usable = [v for v in _versions(folder) if v <= upto_round]
        if not usable:
            return None
        return torch.load(folder / f"{usable[-1]:05d}.pt", map_location="cpu", weights_only=False)

    @staticmethod
    def _prune(folder: Path, keep_from: int) -> None:
        for v in _versions(folder):
            if v < keep_from:
                (folder / f"{v:05d}.pt").unlink(missing_ok=True)
