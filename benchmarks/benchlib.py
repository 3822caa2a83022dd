"""Pieces the benchmarks share: the width-64 random CLIP of the peer workload, importing raysim from a
source tree (for a process whose Python is not raysim's own venv), and the memory of a process tree.

Imported by the benchmark scripts (their folder is sys.path[0] when run as `python benchmarks/X.py`)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the repository root
BENCH_MODEL = "raysim-bench-w64"

# A tiny random CLIP of width 64 (text and image towers), the peer workload's model: raysim-tiny's shape at
# half the width. Random weights (pretrained=""): the benchmark times the system, not the accuracy.
BENCH_MODEL_CONFIG: dict[str, Any] = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "head_width": 32, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}


def register_bench_model() -> str:
    """Make BENCH_MODEL known to open_clip in this process (as the tests register theirs: a JSON file and
    `open_clip.add_model_config`); every process that builds the model calls it. Returns the name."""
    import open_clip

    if BENCH_MODEL not in open_clip.list_models():
        folder = Path(tempfile.gettempdir()) / f"raysim-bench-configs-{os.getuid()}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{BENCH_MODEL}.json"
        tmp = folder / f".{BENCH_MODEL}.json.{os.getpid()}"
        tmp.write_text(json.dumps(BENCH_MODEL_CONFIG, indent=2))
        os.replace(tmp, path)  # atomic: processes registering at once never read a partial file
        open_clip.add_model_config(path)
    return BENCH_MODEL


def ray_setup_hook() -> None:
    """Ray `worker_process_setup_hook`: the benchmark model registered in every Ray worker (actors build it).
    Workers import this module by name: the driver puts benchmarks/ on PYTHONPATH before ray.init."""
    register_bench_model()


def bench_pythonpath() -> str:
    """PYTHONPATH for child processes (Ray workers) that import this module by name."""
    here = str(Path(__file__).resolve().parent)
    return os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)


# ------------------------------------------------------------------------------- raysim from a source tree
# pyproject.toml installs methods/, privacy/ and attacks/ inside the package; a Python without raysim
# installed (Flower's own venv) finds the four packages here with the same mapping.
PACKAGE_DIRS = {"raysim": "raysim", "raysim.methods": "methods", "raysim.privacy": "privacy", "raysim.attacks": "attacks"}


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102
        if fullname not in PACKAGE_DIRS:
            return None  # submodules are found through the package's __path__
        pkg = self.root / PACKAGE_DIRS[fullname]
        return importlib.util.spec_from_file_location(fullname, pkg / "__init__.py", submodule_search_locations=[str(pkg)])


def use_raysim_from(root: Path = ROOT) -> None:
    """Import raysim (and its methods, privacy, attacks) from the source tree at `root` in this process."""
    import importlib.util  # noqa: F401  (spec_from_file_location)

    if not any(isinstance(f, _SourceTreeFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceTreeFinder(Path(root)))


# ------------------------------------------------------------------------------- memory of a process tree
def tree_memory(pid: int | None = None) -> dict[str, Any]:
    """Memory of a process and all its descendants (for a driver that started Ray: the raylet, GCS and every
    Ray worker): RSS summed (counts shared pages, e.g. the object store, once per process that maps them),
    PSS summed (shared pages split between the processes that map them: the machine's real total), and the
    same split into driver / Ray workers (`ray::` processes) / the rest (Ray's own daemons)."""
    try:
        import psutil
    except ImportError:  # not a dependency of raysim's: Ray ships a copy, on sys.path once ray is imported
        import ray  # noqa: F401

        psutil = importlib.import_module("psutil")

    top = psutil.Process(pid or os.getpid())
    out = {"processes": 0, "rss": 0, "pss": 0, "driver_pss": 0, "workers_pss": 0, "workers": 0, "other_pss": 0}
    for p in [top, *top.children(recursive=True)]:
        try:
            m = p.memory_full_info()
            name = " ".join(p.cmdline()[:1]) or p.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        pss = getattr(m, "pss", m.rss)
        out["processes"] += 1
        out["rss"] += m.rss
        out["pss"] += pss
        if p.pid == top.pid:
            out["driver_pss"] += pss
        elif name.startswith("ray::") or "default_worker.py" in " ".join(p.cmdline()):
            out["workers_pss"] += pss
            out["workers"] += 1
        else:
            out["other_pss"] += pss
    return out


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"
