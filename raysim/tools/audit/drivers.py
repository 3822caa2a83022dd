"""The audit's drivers: one run (every attack of `ATTACKS` that applies to its method), or every run of a folder."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from raysim.attacks import attacks as registered_attacks
from raysim.attacks.base import Attack, AttackOutput, ReleaseAttack, attack_family, record_hint, say, walk_releases
from raysim.attacks.fsh import FSHConfig
from raysim.attacks.gradient_inversion import DEFAULT_GIA, GIABudget
from raysim.errors import ConfigError
from raysim.storage.runfolder import RunFolder
from raysim.tools.audit.report import (
    AuditResult,
    GIAAudit,
    PrototypeAudit,
    ldp_of,
    ledger_rows,
    plot_vs_epsilon,
    prototype_table,
    update_table,
    write_run,
)

DEFAULT_FSH = FSHConfig()  # SPEC 3.7


def audit_run(run_dir: str | Path, *, rounds: str = "available", fsh: Optional[FSHConfig] = DEFAULT_FSH, mia: bool = True,
              max_per_class: int = 800, clients: Optional[Sequence[int]] = None, seed: int = 0, nonmembers: str = "other_clients",
              gia: Optional[GIABudget] = DEFAULT_GIA, progress: bool = True, write: bool = True) -> AuditResult:
    """Audit one run folder (see the package docstring); writes RUN_DIR/audit.md and its CSVs when `write`.
    `fsh` / `gia` None and `mia` False switch those attacks off; the options of each attack by its name:
    fsh an FSHConfig, prototype_mia max_per_class, update_mia the non-members, gradient_inversion a GIABudget."""
    run = RunFolder.open(run_dir, missing="{path} holds no config.yaml; pass the out_dir of a run (or a folder of runs)")
    if not run.upload_rounds():
        raise ConfigError(record_hint(run.run_dir))
    options: dict[str, Any] = {"fsh": fsh, "prototype_mia": max_per_class if mia else None, "update_mia": nonmembers,
                               "gradient_inversion": gia}
    enabled = {"fsh": fsh is not None, "prototype_mia": mia, "gradient_inversion": gia is not None}
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, int(run.cfg.execution.num_threads)))  # as the run's hosts (oversubscribed small ops crawl)
    try:
        return _audit_run(run, options=options, enabled=enabled, rounds=rounds, clients=clients, seed=seed, progress=progress,
                          write=write)
    finally:
        torch.set_num_threads(threads)


def _audit_run(run: RunFolder, *, options: dict[str, Any], enabled: dict[str, bool], rounds: str,
               clients: Optional[Sequence[int]], seed: int, progress: bool, write: bool) -> AuditResult:
    method = run.method
    applicable = [a for a in registered_attacks() if a.applies(run, method)]
    family = applicable[0].family if applicable else attack_family(method)
    res = AuditResult(run.run_dir, family, float(run.cfg.dp.epsilon), ldp_of(run), run.cfg.method, run.utility(), ledger_rows(run))
    outputs: dict[str, AttackOutput] = {}
    per_release = [a for a in applicable if isinstance(a, ReleaseAttack)]
    if per_release:  # one walk over the releases: each (round, client)'s model is built once for all of them
        chosen = [(a, options.get(a.name)) for a in per_release if enabled.get(a.name, True)]
        walked, skipped, attacked = walk_releases(run, method, chosen, rounds=rounds, clients=clients, seed=seed, progress=progress)
        outputs.update(walked)
        res.prototype = PrototypeAudit(fsh=_rows(walked, "fsh"), mia=_rows(walked, "prototype_mia"), skipped=skipped,
                                       rounds=attacked)
    for attack in applicable:
        if isinstance(attack, ReleaseAttack) or not enabled.get(attack.name, True):
            continue
        outputs[attack.name] = attack.run(run, method, rounds=rounds, clients=clients, seed=seed, options=options.get(attack.name),
                                          progress=progress)
    for attack in sorted(_ran(applicable, outputs), key=lambda a: (a.order if a.summary_order is None else a.summary_order)):
        res.summary.update(outputs[attack.name].summary)
    if "update_mia" in outputs:
        res.update = outputs["update_mia"].rows
    if "gradient_inversion" in outputs:
        g = outputs["gradient_inversion"]
        res.gia = GIAAudit(rows=g.rows, skipped=g.skipped, rounds=g.rounds)
    if write:
        write_run(res)
    return res


def _rows(outputs: dict[str, AttackOutput], name: str) -> list[dict[str, Any]]:
    return list(outputs[name].rows) if name in outputs else []


def _ran(applicable: list[Attack], outputs: dict[str, AttackOutput]) -> list[Attack]:
    return [a for a in applicable if a.name in outputs]


# -- a folder of runs -------------------------------------------------------------------------------

def find_runs(folder: Path) -> list[Path]:
    """Run folders (a config.yaml and a state/ folder) under `folder`, in path order."""
    return sorted(p.parent for p in folder.rglob("config.yaml") if (p.parent / "state").is_dir())


def audit_folder(folder: str | Path, **kw: Any) -> list[AuditResult]:
    """Audit every recorded run under `folder`; write FOLDER/audit.md, audit.csv and (over two or more
    epsilons) audit_vs_epsilon.png. Runs without recorded uploads are listed, not audited."""
    import pandas as pd

    folder = Path(folder).expanduser()
    runs = find_runs(folder)
    if not runs:
        raise ConfigError(f"{folder} holds no run folders (config.yaml + state/); pass a run, a sweep experiment or a compare output")
    results, unrecorded = [], []
    for i, run in enumerate(runs):
        if not RunFolder(run).upload_rounds():
            unrecorded.append(run)
            continue
        if kw.get("progress", True):
            say(f"audit: run {i + 1}/{len(runs)}: {run.relative_to(folder)}")
        results.append(audit_run(run, **kw))
    if not results:
        raise ConfigError(record_hint(unrecorded[0]) if unrecorded else f"nothing to audit in {folder}")
    results.sort(key=lambda r: (r.family, r.method, -math.inf if math.isinf(r.epsilon) else r.epsilon, r.ldp, str(r.run_dir)))
    rows = [{**r.row(), "run": str(r.run_dir.relative_to(folder))} for r in results]
    pd.DataFrame(rows).to_csv(folder / "audit.csv", index=False)
    lines = [f"# Privacy audit of {folder}", "", f"{len(results)} runs audited (each run's own audit.md has its ledger)."]
    protos = [r for r in results if r.family == "prototype"]
    updates = [r for r in results if r.family == "update"]
    if protos:
        lines += ["", "## FSH / prototype MIA (vpdr.txt 5.4)", "", prototype_table(protos)]
    if updates:
        lines += ["", "## Update MIA (fedsept.txt 5.5, Figure 5)", "", update_table(updates)]
    lines += ["", "## Runs", "", *[f"- {r['run']}: {r['method']}, dp.epsilon={r['epsilon']:g} ({r['ldp']})" for r in rows]]
    if unrecorded:
        lines += ["", "not audited (no recorded uploads; rerun with output.record_uploads=true):", "",
                  *[f"- {p.relative_to(folder)}" for p in unrecorded]]
    fig = plot_vs_epsilon(results, folder / "audit_vs_epsilon.png")
    if fig is not None:
        lines += ["", f"![attacks and utility against epsilon]({fig.name})"]
    (folder / "audit.md").write_text("\n".join(lines) + "\n")
    return results


