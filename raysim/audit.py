"""`raysim audit RUN_DIR | SWEEP_DIR | COMPARE_DIR`: for a run, what each client spent and what an attacker got.

For one run folder (made with output.record_uploads=true) it reads what the server saw (uploads/), the
clients' checkpoints (state/) and their privacy ledgers, runs every attack that applies to the run's
method and writes RUN_DIR/audit.md plus CSVs:

  ledger           per client and mechanism: sigma, sampling rate q, steps, rounds, epsilon spent of its
                   target (audit_ledger.csv)
  prototype methods (an upload `protos` that is a prototype release, a client model with features(x):
                   FedProto, FedTGP, the VPDR frameworks), vpdr.txt section 5.4 / SPEC 3.7:
    FSH            feature-space hijacking of every attacked client's release (raysim.attacks.fsh):
                   Cos Sim, cFFD, Top-1 Hit (audit_fsh.csv: one row per round, client and class)
    prototype MIA  per client up to 800 member (train) and 800 non-member (its own test split) features
                   per class from the client's own extractor, scored against its released prototype of
                   their class (raysim.attacks.prototype_mia): AUC, TPR@1%FPR, TPR@0.1%FPR, advantage,
                   F1 (audit_mia.csv: one row per round and client)
  other methods (the FedSEPT family: prompt uploads), fedsept.txt section 5.5 / SPEC 1.12:
    update MIA     the update-only and update-and-query logistic attackers (raysim.attacks.update_mia):
                   mean AUC over rounds, final-round AUC, HM (audit_update_mia.csv)

Threat model of the prototype attacks (SPEC 3.7): a white-box server that knows each client's model. The
model behind a round-r release is the client's checkpoint of round r (the prototype methods release after
their local training). The store keeps each client's last two checkpoints, so the attacks cover the
recorded rounds whose releasing models are still on disk (`rounds="available"`, the default: the last
two rounds under full participation), or only the last recorded round (`rounds="last"`).

Averaging (the paper's table): a client's metrics are the mean over its attacked classes (FSH) or its
macro-average over classes (MIA); per round the mean over clients; the reported mean is the mean over
rounds and the +- is the standard deviation over clients (of the clients' values averaged over rounds).

For a folder of runs (a `raysim sweep` experiment, a `raysim compare` output, any folder holding run
folders) every run is audited (its own audit.md), and FOLDER/audit.md + audit.csv gather one row per run
in the paper's layout (epsilon, LDP mechanism, metrics, utility). With two or more values of dp.epsilon
it draws FOLDER/audit_vs_epsilon.png: the attacks' AUC / Cos Sim against epsilon with the utility (HM
for the update family, In-Client accuracy for the prototype methods) on the same figure.

A run without uploads/ cannot be audited: the message says to rerun it with output.record_uploads=true
(exit status 2).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, cast

import numpy as np
import torch

from raysim.attacks.fsh import FSHConfig, attack_client
from raysim.attacks.prototype_mia import prototype_mia
from raysim.errors import ConfigError, RaysimError

FSH_COLUMNS = ("Cos Sim", "cFFD", "Top-1 Hit (%)")
FSH_REFERENCE = ("start Cos Sim", "start Top-1 Hit (%)")  # the random starting dummies (no leak)
MIA_COLUMNS = ("auc", "tpr@1%fpr", "tpr@0.1%fpr", "advantage", "f1")
MIA_HEADERS = {"auc": "ROC-AUC", "tpr@1%fpr": "TPR@1%FPR", "tpr@0.1%fpr": "TPR@0.1%FPR", "advantage": "Advantage", "f1": "F1 Score"}
ROUNDS = ("available", "last")
DEFAULT_FSH = FSHConfig()  # SPEC 3.7


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def record_hint(run_dir: Path) -> str:
    return (f"{run_dir} has no recorded uploads (uploads/): the attacks need what the server saw. Record them by "
            f"rerunning with output.record_uploads=true (raysim run ... output.record_uploads=true), or continue this run "
            f"with output.resume={run_dir} output.record_uploads=true train.rounds=N to record its further rounds")


# -- the run ----------------------------------------------------------------------------------------

@dataclass
class RunView:
    """A run folder as the auditor reads it."""

    run_dir: Path
    cfg: Any
    method: Any
    _data: Any = None
    _env: Any = None

    @classmethod
    def open(cls, run_dir: str | Path) -> "RunView":
        from raysim.actors import make_method
        from raysim.config import build_config, load_yaml

        run_dir = Path(run_dir).expanduser()
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"{run_dir} holds no config.yaml; pass the out_dir of a run (or a folder of runs)")
        cfg = build_config(load_yaml(run_dir / "config.yaml"))
        return cls(run_dir, cfg, make_method(cfg))

    @property
    def store(self):
        from raysim.store import StateStore

        return StateStore(self.run_dir)

    @property
    def data(self):
        if self._data is None:
            from raysim.engine import prepare_data

            self._data = prepare_data(self.cfg, self.method.needs(), progress=False)
        return self._data

    @property
    def env(self):
        if self._env is None:
            from raysim.actors import env_spec

            self._env = self.method.build_env(env_spec(self.cfg, self.data.classnames), role="client")
        return self._env

    @property
    def family(self) -> str:
        return attack_family(self.method)

    def client_state(self, cid: int, round_idx: int) -> Optional[dict]:
        """The client's checkpoint written at the end of exactly `round_idx` (None when not on disk)."""
        from raysim.store import load_checked

        path = self.store.root / "clients" / str(cid) / f"{round_idx:05d}.pt"
        return load_checked(path) if path.is_file() else None

    def release_state(self, cid: int, round_idx: int) -> Optional[dict]:
        """The client state behind its round-`round_idx` upload (None when not on disk): the checkpoint of
        that round (the method uploads after its local training), or for a `release_first` method (the
        VPDR frameworks, SPEC 3.4: release, then train) the state it entered the round with: its checkpoint
        of its previous participation, or before its first its initial state."""
        if not getattr(self.method, "release_first", False):
            return self.client_state(cid, round_idx)
        from raysim.actors import initial_private
        from raysim.sampling import participants

        t = self.cfg.train
        earlier = [r for r in range(round_idx) if cid in participants(t.seed, r, t.num_clients, t.participation)]
        if earlier:
            return self.client_state(cid, earlier[-1])
        return {"private": initial_private(self.method, self.env, self.data.client(cid), t.seed)}

    def latest_client_state(self, cid: int) -> Optional[dict]:
        return self.store.load_client(cid, self.store.completed_round())

    def utility(self) -> dict[str, float]:
        from raysim.metrics import summarize

        path = self.run_dir / "results.csv"
        return summarize(path, last=max(1, self.cfg.eval.last)) if path.is_file() else {}

    def ldp(self) -> str:
        """The paper's LDP column: NoLDP, or the prototype mechanism (IGPP, VPP; VPDR = VPP + DCR), or for
        other methods the mechanisms of the uploads."""
        from raysim.privacy.mechanisms import resolve_all

        dp = getattr(self.method, "dp", None) or self.cfg.dp
        if not self.cfg.dp.enabled:
            return "NoLDP"
        mechs = {m.name for m in resolve_all(self.method.releases, dp, method=self.method.name).values()
                 if m is not None and m.name != "public"}
        knob = str(getattr(self.method.opts, "privacy", ""))
        if knob == "vpdr":
            return "VPDR"
        names = "+".join(sorted(n.upper() for n in mechs)) or "-"
        return f"{names}+DCR" if knob == "dcr" else names


def attack_family(method: Any) -> str:
    """"prototype" for a method that uploads a prototype release `protos` and has a client model with
    features(x); "update" otherwise (its uploads are trained tensors: the update MIA applies)."""
    spec = getattr(method, "releases", {}).get("protos")
    if spec is not None and spec.kind == "prototype" and callable(getattr(method, "model", None)):
        return "prototype"
    return "update"


# -- the ledger -------------------------------------------------------------------------------------

def ledger_rows(view: RunView) -> list[dict[str, Any]]:
    """Per client and mechanism: sigma, q, steps, rounds and the client's epsilon spent / target."""
    from raysim.privacy.ledger import PrivacyLedger

    rows: list[dict[str, Any]] = []
    for cid in range(view.cfg.train.num_clients):
        saved = view.latest_client_state(cid)
        base = {"client": cid, "target_epsilon": float(view.cfg.dp.epsilon), "delta": float(view.cfg.dp.delta)}
        if saved is None:
            rows.append({**base, "mechanism": "(never took part)", "sigma": math.nan, "q": math.nan, "steps": 0, "rounds": 0,
                         "epsilon_spent": 0.0, "valid": True})
            continue
        led = (saved.get("privacy") or {}).get("ledger") or saved.get("ledger")
        if not led:
            rows.append({**base, "mechanism": "none (no DP)", "sigma": math.nan, "q": math.nan, "steps": 0, "rounds": 0,
                         "epsilon_spent": math.inf if not view.cfg.dp.enabled else 0.0, "valid": True})
            continue
        ledger = PrivacyLedger.from_dict(led)
        spent = float(ledger.epsilon())
        groups: dict[tuple, dict[str, Any]] = {}
        for r in ledger.releases:
            key = (r.mechanism, float(r.sigma), float(r.sample_rate), r.epsilon is not None, r.valid)
            g = groups.setdefault(key, {"steps": 0, "rounds": set(), "pure": 0.0})
            g["steps"] += int(r.steps)
            g["rounds"].add(int(r.round))
            g["pure"] += float(r.epsilon or 0.0)
        for (mech, sigma, q, pure, valid), g in groups.items():
            rows.append({**base, "target_epsilon": float(ledger.target_epsilon), "delta": float(ledger.delta), "mechanism": mech,
                         "sigma": math.nan if pure else sigma, "q": q, "steps": g["steps"], "rounds": len(g["rounds"]),
                         "epsilon_spent": spent, "valid": valid, **({"pure_epsilon": g["pure"]} if pure else {})})
    return rows


def ledger_markdown(rows: list[dict[str, Any]]) -> str:
    from raysim.metrics import markdown_table

    def f(v: Any, fmt: str = ".4g") -> str:
        return "-" if isinstance(v, float) and math.isnan(v) else ("inf" if v == math.inf else format(v, fmt))

    body = []
    for r in rows:
        sigma = f"(pure eps {r['pure_epsilon']:.4g})" if "pure_epsilon" in r else f(r["sigma"])
        body.append([str(r["client"]), r["mechanism"] + ("" if r["valid"] else " (NOT a valid guarantee)"), sigma, f(r["q"]),
                     str(r["steps"]), str(r["rounds"]), f"{f(r['epsilon_spent'])} / {f(r['target_epsilon'])}"])
    return markdown_table(["client", "mechanism", "sigma", "q", "steps", "rounds", "epsilon spent / target"], body, align="llrrrrr")


# -- the prototype attacks --------------------------------------------------------------------------

def _features(extract: Callable, x: torch.Tensor, device: Any, batch: int = 256) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([extract(x[i:i + batch].to(device)).float().cpu() for i in range(0, len(x), batch)]) if len(x) else \
            torch.zeros(0)


def _subsample(labels: torch.Tensor, limit: int, gen: torch.Generator) -> torch.Tensor:
    """Row indices: up to `limit` rows of each class, drawn at random (seeded)."""
    keep = []
    for c in torch.unique(labels).tolist():
        rows = torch.nonzero(labels == c).flatten()
        keep.append(rows[torch.randperm(len(rows), generator=gen)[:limit]])
    return torch.sort(torch.cat(keep)).values if keep else torch.zeros(0, dtype=torch.long)


def extractor_of(method: Any, model: torch.nn.Module) -> Callable:
    """The features the method releases prototypes of, differentiable w.r.t. the images: the method's
    `release_feature_fn(model)` where it has one (e.g. a backbone-path release), else model.features."""
    hook = getattr(method, "release_feature_fn", None)
    return hook(model) if callable(hook) else cast(Callable, model.features)


def classifier_of(model: torch.nn.Module) -> Callable:
    """Features -> logits of the client's own head."""
    head = getattr(model, "head_logits", None)
    return head if callable(head) else cast(Callable, model.head)


def _on(fn: Callable, device: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: fn(x.to(device)).float()


@dataclass
class PrototypeAudit:
    fsh: list[dict[str, Any]] = field(default_factory=list)  # one row per round, client, class
    mia: list[dict[str, Any]] = field(default_factory=list)  # one row per round, client
    skipped: list[str] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)


def prototype_attacks(view: RunView, *, rounds: str = "available", fsh: Optional[FSHConfig] = DEFAULT_FSH, mia: bool = True,
                      max_per_class: int = 800, clients: Optional[Sequence[int]] = None, seed: int = 0,
                      progress: bool = True) -> PrototypeAudit:
    """FSH and the prototype MIA on every recorded release whose releasing model is on disk."""
    if rounds not in ROUNDS:
        raise ConfigError(f"rounds must be one of {', '.join(ROUNDS)}, got {rounds!r}")
    store = view.store
    recorded = store.upload_rounds()
    if not recorded:
        raise ConfigError(record_hint(view.run_dir))
    todo = recorded[-1:] if rounds == "last" else recorded
    out = PrototypeAudit()
    method, env, data = view.method, view.env, view.data
    for r in todo:
        record = store.load_uploads(r)
        attacked = [c for c in sorted(record["uploads"]) if clients is None or c in clients]
        done_any = False
        for cid in attacked:
            saved = view.release_state(cid, r)
            if saved is None:
                out.skipped.append(f"round {r}, client {cid}: the model behind its round-{r} release is no longer on disk")
                continue
            done_any = True
            upload = record["uploads"][cid]
            cdata = data.client(cid)
            model = method.model(env, saved["private"]).eval()
            for p in model.parameters():
                p.requires_grad_(False)
            extract, classify = extractor_of(method, model), classifier_of(model)
            released = upload["protos"].float()
            counts = upload.get("counts", torch.bincount(cdata.y_train, minlength=cdata.num_classes)).float()
            train_f = _features(extract, cdata.x_train, env.device)
            line = f"audit {view.run_dir.name}: round {r} client {cid}"
            if mia:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + r * 1009 + cid)
                mi, ni = _subsample(cdata.y_train, max_per_class, gen), _subsample(cdata.y_test, max_per_class, gen)
                test_f = _features(extract, cdata.x_test, env.device)
                protos = {c: released[c] for c in range(len(counts)) if counts[c] > 0}
                try:
                    res = prototype_mia(train_f[mi], cdata.y_train[mi], test_f[ni], cdata.y_test[ni], protos, max_per_class=max_per_class)
                except ValueError:
                    out.skipped.append(f"round {r}, client {cid}: MIA: no class with a prototype, members and non-members")
                else:
                    out.mia.append({"round": r, "client": cid, **res.as_dict(), "members": len(mi), "nonmembers": len(ni)})
                    line += f": MIA AUC {res.auc:.3f}"
            if fsh is not None:
                with torch.enable_grad():
                    per_class = attack_client(
                        _on(extract, env.device), _on(classify, env.device), released.to(env.device), counts, train_f,
                        cdata.y_train, shape=tuple(cdata.x_train.shape[1:]), cfg=fsh, seed=seed * 1_000_003 + r * 1009 + cid)
                for c, m in per_class.items():
                    out.fsh.append({"round": r, "client": cid, "class": c, **m.as_dict()})
                if per_class:
                    line += (f"; FSH {len(per_class)} classes: Cos Sim {np.mean([m.cos_sim for m in per_class.values()]):.3f}, "
                             f"Top-1 Hit {np.mean([m.top1_hit for m in per_class.values()]):.0f}%")
            if progress:
                _say(line)
        if done_any:
            out.rounds.append(r)
    return out


def clients_then_rounds(rows: list[dict[str, Any]], columns: Sequence[str]) -> dict[str, tuple[float, float]]:
    """column -> (mean over rounds of the mean over clients, std over clients of their round-averaged value).
    Rows are per (round, client[, class]); several rows of one (round, client) are averaged first."""
    if not rows:
        return {c: (math.nan, math.nan) for c in columns}
    import pandas as pd

    df = pd.DataFrame(rows).groupby(["round", "client"], as_index=False)[list(columns)].mean()
    mean = df.groupby("round")[list(columns)].mean().mean()
    std = df.groupby("client")[list(columns)].mean().std(ddof=0)
    return {c: (float(mean[c]), float(std[c])) for c in columns}


# -- one run ----------------------------------------------------------------------------------------

@dataclass
class AuditResult:
    run_dir: Path
    family: str
    epsilon: float
    ldp: str
    method: str
    utility: dict[str, float]
    ledger: list[dict[str, Any]]
    summary: dict[str, tuple[float, float]] = field(default_factory=dict)  # metric -> (mean, std)
    prototype: Optional[PrototypeAudit] = None
    update: Any = None  # DataFrame of the update MIA

    def row(self) -> dict[str, Any]:
        """One row of the paper layout (flat: metric and metric_std)."""
        out: dict[str, Any] = {"run": str(self.run_dir), "method": self.method, "epsilon": self.epsilon, "ldp": self.ldp}
        for k, (m, s) in self.summary.items():
            out[k], out[f"{k} std"] = m, s
        for k in ("in_client", "cross_client", "hm"):
            out[k] = float(self.utility.get(k, math.nan))
        return out


def _pm(m: float, s: float, fmt: str) -> str:
    return "-" if math.isnan(m) else f"{m:{fmt}} ± {s:{fmt}}"


def _eps(e: float) -> str:
    return "-" if math.isinf(e) else f"{e:g}"


FMT = {"Cos Sim": ".4f", "cFFD": ".1f", "Top-1 Hit (%)": ".2f", "auc": ".4f", "tpr@1%fpr": ".4f", "tpr@0.1%fpr": ".4f",
       "advantage": ".4f", "f1": ".4f"}


def prototype_table(results: list[AuditResult]) -> str:
    """vpdr.txt's FSH / MIA table: epsilon, LDP, Cos Sim, cFFD, Top-1 Hit, ROC-AUC, TPR@1%FPR, Advantage, F1;
    then TPR@0.1%FPR, the utility and the no-leak reference of FSH (its random starting dummies)."""
    from raysim.metrics import markdown_table

    header = ["ε", "LDP", "method", "Cos Sim ↓", "cFFD ↑", "Top-1 Hit(%) ↓", "ROC-AUC →0.5", "TPR@1%FPR ↓", "Advantage →0",
              "F1 Score ↓", "TPR@0.1%FPR ↓", "In-Client acc", "start Cos Sim", "start Hit(%)"]
    cols = [*FSH_COLUMNS, "auc", "tpr@1%fpr", "advantage", "f1", "tpr@0.1%fpr"]
    body = []
    for r in results:
        ref = [r.summary.get(k, (math.nan, 0))[0] for k in FSH_REFERENCE]
        body.append([_eps(r.epsilon), r.ldp, r.method, *(_pm(*r.summary.get(c, (math.nan, math.nan)), FMT[c]) for c in cols),
                     _pct(r.utility.get("in_client", math.nan)), "-" if math.isnan(ref[0]) else f"{ref[0]:.4f}",
                     "-" if math.isnan(ref[1]) else f"{ref[1]:.2f}"])
    return markdown_table(header, body, align="lll" + "r" * (len(header) - 3))


def update_table(results: list[AuditResult]) -> str:
    """fedsept.txt Figure 5's numbers: per run and attacker, mean AUC over rounds, final AUC, HM."""
    from raysim.metrics import markdown_table

    body = []
    for r in results:
        for attack in ("update-only", "update-and-query"):
            m, s = r.summary.get(f"{attack} mean_auc", (math.nan, math.nan)), r.summary.get(f"{attack} final_auc", (math.nan, 0))
            body.append([_eps(r.epsilon), r.ldp, r.method, attack, "-" if math.isnan(m[0]) else f"{m[0]:.4f}",
                         "-" if math.isnan(s[0]) else f"{s[0]:.4f}", _pct(r.utility.get("hm", math.nan))])
    return markdown_table(["ε", "LDP", "method", "attacker", "mean AUC", "final AUC", "HM"], body, align="llll" + "rrr")


def _pct(v: float) -> str:
    return "-" if v is None or math.isnan(v) else f"{100 * v:.2f}"


def audit_run(run_dir: str | Path, *, rounds: str = "available", fsh: Optional[FSHConfig] = DEFAULT_FSH, mia: bool = True,
              max_per_class: int = 800, clients: Optional[Sequence[int]] = None, seed: int = 0, nonmembers: str = "other_clients",
              progress: bool = True, write: bool = True) -> AuditResult:
    """Audit one run folder (see the module docstring); writes RUN_DIR/audit.md and its CSVs when `write`."""
    view = RunView.open(run_dir)
    if not view.store.upload_rounds():
        raise ConfigError(record_hint(view.run_dir))
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, int(view.cfg.execution.num_threads)))  # as the run's hosts (oversubscribed small ops crawl)
    try:
        return _audit_run(view, rounds=rounds, fsh=fsh, mia=mia, max_per_class=max_per_class, clients=clients, seed=seed,
                          nonmembers=nonmembers, progress=progress, write=write)
    finally:
        torch.set_num_threads(threads)


def _audit_run(view: RunView, *, rounds: str, fsh: Optional[FSHConfig], mia: bool, max_per_class: int,
               clients: Optional[Sequence[int]], seed: int, nonmembers: str, progress: bool, write: bool) -> AuditResult:
    res = AuditResult(view.run_dir, view.family, float(view.cfg.dp.epsilon), view.ldp(), view.cfg.method, view.utility(),
                      ledger_rows(view))
    if view.family == "prototype":
        pa = prototype_attacks(view, rounds=rounds, fsh=fsh, mia=mia, max_per_class=max_per_class, clients=clients, seed=seed,
                               progress=progress)
        res.prototype = pa
        res.summary = {**clients_then_rounds(pa.fsh, FSH_COLUMNS + FSH_REFERENCE), **clients_then_rounds(pa.mia, MIA_COLUMNS)}
    else:
        from raysim.attacks.update_mia import audit_run as update_audit

        if progress:
            _say(f"audit {view.run_dir.name}: update MIA (update-only, update-and-query) over {len(view.store.upload_rounds())} rounds")
        df = update_audit(view.run_dir, target_clients=clients, seed=seed, nonmembers=nonmembers)
        res.update = df
        for _, row in df.iterrows():
            res.summary[f"{row['attack']} mean_auc"] = (float(row["mean_auc"]), 0.0)
            res.summary[f"{row['attack']} final_auc"] = (float(row["final_auc"]), 0.0)
    if write:
        write_run(res)
    return res


def run_markdown(res: AuditResult) -> str:
    lines = [f"# Privacy audit of {res.run_dir}", "",
             f"method {res.method}, dp.epsilon={_eps(res.epsilon) if math.isfinite(res.epsilon) else 'inf'} ({res.ldp}), "
             f"{'prototype attacks (vpdr.txt 5.4, SPEC 3.7)' if res.family == 'prototype' else 'update MIA (fedsept.txt 5.5, SPEC 1.12)'}",
             "", "## Privacy ledger (per client)", "", ledger_markdown(res.ledger)]
    if res.family == "prototype":
        pa = res.prototype
        assert pa is not None
        lines += ["## Attacks (white-box server: each client's model of the round of its release)", "",
                  f"rounds attacked: {', '.join(map(str, pa.rounds)) or 'none'}; metrics: mean over clients, then over rounds; "
                  "± = std over clients", "", prototype_table([res])]
        if pa.fsh:
            cs, hit = res.summary["start Cos Sim"][0], res.summary["start Top-1 Hit (%)"][0]
            lines += ["", f"no-leak reference (the attack's random starting dummies, same metrics): Cos Sim {cs:.4f}, "
                          f"Top-1 Hit {hit:.2f}%. An attack leaks where it beats these, not where it beats 0 and 1/C."]
        if pa.skipped:
            lines += ["", "not attacked:", "", *[f"- {s}" for s in pa.skipped[:20]],
                      *([f"- ... and {len(pa.skipped) - 20} more"] if len(pa.skipped) > 20 else [])]
    else:
        from raysim.attacks.update_mia import markdown

        lines += ["## Update MIA (logistic attackers on what the server saw)", "", update_table([res]), "", markdown(res.update)]
    return "\n".join(lines) + "\n"


def write_run(res: AuditResult) -> None:
    import pandas as pd

    d = res.run_dir
    (d / "audit.md").write_text(run_markdown(res))
    pd.DataFrame(res.ledger).to_csv(d / "audit_ledger.csv", index=False)
    pd.DataFrame([res.row()]).to_csv(d / "audit_summary.csv", index=False)
    if res.prototype is not None:
        pd.DataFrame(res.prototype.fsh, columns=["round", "client", "class", *FSH_COLUMNS, *FSH_REFERENCE]).to_csv(
            d / "audit_fsh.csv", index=False)
        pd.DataFrame(res.prototype.mia).to_csv(d / "audit_mia.csv", index=False)
    if res.update is not None:
        res.update.to_csv(d / "audit_update_mia.csv", index=False)


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
        from raysim.store import StateStore

        if not StateStore(run).upload_rounds():
            unrecorded.append(run)
            continue
        if kw.get("progress", True):
            _say(f"audit: run {i + 1}/{len(runs)}: {run.relative_to(folder)}")
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


def plot_vs_epsilon(results: list[AuditResult], path: Path) -> Optional[Path]:
    """Attack metrics (left axis) and utility (right axis) against epsilon, one line per (method, LDP
    mechanism); no DP is drawn at the right end. None when the runs have fewer than two epsilons."""
    eps = sorted({r.epsilon for r in results})
    if len(eps) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [e for e in eps if math.isfinite(e)]
    inf_x = (max(finite) * 1.5 if finite else 1.0) if math.inf in eps else None
    families = sorted({r.family for r in results})
    fig, axes = plt.subplots(1, len(families), figsize=(6.5 * len(families), 4.2), squeeze=False)
    for ax, fam in zip(axes[0], families):
        runs = [r for r in results if r.family == fam]
        metrics = [("auc", "MIA ROC-AUC"), ("Cos Sim", "FSH Cos Sim")] if fam == "prototype" else \
            [("update-only mean_auc", "update-only AUC"), ("update-and-query mean_auc", "update-and-query AUC")]
        util_key, util_name = ("in_client", "In-Client acc") if fam == "prototype" else ("hm", "HM")
        right = ax.twinx()
        groups: dict[str, list[AuditResult]] = {}
        for r in runs:
            key = r.method if r.ldp == "NoLDP" else f"{r.method} {r.ldp}"
            groups.setdefault(key, []).append(r)
        nodp = [r for r in runs if math.isinf(r.epsilon)]
        dp_methods = {r.method for r in runs if math.isfinite(r.epsilon)}
        groups = {k: v for k, v in groups.items() if any(math.isfinite(r.epsilon) for r in v) or v[0].method not in dp_methods}
        for gi, (name, rs) in enumerate(sorted(groups.items())):  # no-DP runs join each DP line of their method
            rs = sorted(rs + [n for n in nodp if n.method == rs[0].method and n not in rs], key=lambda r: r.epsilon)
            xs = [inf_x if math.isinf(r.epsilon) else r.epsilon for r in rs]
            for mi, (k, label) in enumerate(metrics):
                ys = [r.summary.get(k, (math.nan, 0))[0] for r in rs]
                ax.plot(xs, ys, marker="os^"[mi % 3], linestyle="-", color=f"C{gi}", label=f"{label} ({name})")
            ys = [r.utility.get(util_key, math.nan) for r in rs]
            right.plot(xs, ys, marker="x", linestyle="--", color=f"C{gi}", alpha=0.6, label=f"{util_name} ({name})")
        ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
        ticks = finite + ([inf_x] if inf_x is not None else [])
        ax.set_xticks(ticks, [f"{e:g}" for e in finite] + (["no DP"] if inf_x is not None else []))
        ax.set_xlabel("ε (local DP budget)")
        ax.set_ylabel("attack (AUC, Cos Sim)")
        right.set_ylabel(f"utility ({util_name}, dashed)")
        ax.set_title("prototype attacks (FSH, MIA)" if fam == "prototype" else "update MIA")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = right.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=6, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -- the command --------------------------------------------------------------------------------------

def main(argv: Optional[Sequence[str]] = None) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(prog="raysim audit", description=(__doc__ or "").split("\n")[0])
    ap.add_argument("path", help="a run folder recorded with output.record_uploads=true, or a folder of runs (sweep, compare)")
    ap.add_argument("--rounds", choices=ROUNDS, default="available",
                    help="prototype attacks: every recorded round whose releasing models are on disk (default), or the last")
    ap.add_argument("--clients", type=int, nargs="*", default=None, help="attack only these clients (default: all)")
    ap.add_argument("--no-fsh", action="store_true", help="skip feature-space hijacking")
    ap.add_argument("--no-mia", action="store_true", help="skip the prototype MIA")
    ap.add_argument("--fsh-steps", type=int, default=FSHConfig.max_steps, help="FSH: most optimisation steps (SPEC: 100000)")
    ap.add_argument("--fsh-patience", type=int, default=FSHConfig.patience,
                    help="FSH: early stop after this many steps without improvement")
    ap.add_argument("--fsh-classes", type=int, default=FSHConfig.classes, help="FSH: classes attacked per client (SPEC: 3)")
    ap.add_argument("--fsh-objective", choices=("mse", "cos"), default="mse")
    ap.add_argument("--max-per-class", type=int, default=800, help="MIA: members and non-members per class (SPEC: 800)")
    ap.add_argument("--nonmembers", choices=("other_clients", "own_test"), default="other_clients", help="update MIA non-members")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    path = Path(args.path).expanduser()
    try:
        fsh = None if args.no_fsh else FSHConfig(max_steps=args.fsh_steps, patience=args.fsh_patience, classes=args.fsh_classes,
                                                 objective=args.fsh_objective, min_steps=min(FSHConfig.min_steps, args.fsh_steps))
        kw = dict(rounds=args.rounds, fsh=fsh, mia=not args.no_mia, max_per_class=args.max_per_class, clients=args.clients,
                  seed=args.seed, nonmembers=args.nonmembers, progress=not args.quiet)
        if (path / "config.yaml").is_file():
            res = audit_run(path, **kw)
            sys.stdout.write(run_markdown(res))
            _say(f"wrote {path / 'audit.md'}")
        else:
            audit_folder(path, **kw)
            sys.stdout.write((path / "audit.md").read_text())
            _say(f"wrote {path / 'audit.md'} and audit.csv")
    except RaysimError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
