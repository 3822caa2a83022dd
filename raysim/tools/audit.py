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
    GIA            gradient inversion of the uploaded prompt tensor (raysim.attacks.gradient_inversion),
                   for the prompt methods that declare loss_parts (PromptFL, FedSEPT, DP-FPL): CLIPCos,
                   GradCos, PSNR, zero-shot Top-1 agreement, and CLIPCos of random images (the no-leak
                   level), under a bounded budget (GIABudget: 4 images, 100 iterations, 1 restart, the
                   first 2 clients of the last round; --gia-* flags) (audit_gia.csv)

Threat model of the prototype attacks (SPEC 3.7): a white-box server that knows each client's model. The
model behind a round-r release is the client's checkpoint of round r for a method that releases after
its local training (FedProto, FedTGP), or the state it entered round r with for one that declares
`release_first` (the VPDR frameworks: release, aggregate, then train). A run that records its uploads keeps every round's client state
(output.keep_client_states=auto), so every recorded round is attacked (`rounds="available"`, the
default; `rounds="last"`: only the last). With keep_client_states=last only the last two rounds' models
are on disk, and the other rounds are listed as not attacked.

Averaging (vpdr.txt E.6.2, SPEC 3.7): a client's metrics are the mean over its attacked classes (FSH) or
its macro-average over classes (MIA); per round the mean over clients; the reported value is the mean
over rounds ± the standard deviation over rounds. The GIA's are averaged the same way.

For a folder of runs (a `raysim sweep` experiment, a `raysim compare` output, any folder holding run
folders) every run is audited (its own audit.md), and FOLDER/audit.md + audit.csv gather one row per run
in the paper's layout (epsilon, LDP mechanism, metrics, utility). With two or more values of dp.epsilon
it draws FOLDER/audit_vs_epsilon.png: the attacks' AUC / Cos Sim / GIA CLIPCos against epsilon with the
utility (HM for the update family, In-Client accuracy for the prototype methods) on the same figure.
Long attacks print progress lines ([k/N], elapsed, estimated time left) to stderr.

A run without uploads/ cannot be audited: the message says to rerun it with output.record_uploads=true
(exit status 2).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
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


class Progress:
    """Progress lines on stderr for a long attack: "label [k/N] what (elapsed, ~left)"."""

    def __init__(self, label: str, total: int, *, enabled: bool = True) -> None:
        self.label, self.total, self.enabled, self.done, self.t0 = label, total, enabled, 0, time.perf_counter()
        if enabled and total:
            _say(f"{label}: {total} to do")

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        spent = time.perf_counter() - self.t0
        left = spent / self.done * (self.total - self.done)
        _say(f"{self.label} [{self.done}/{self.total}] {what} ({spent:.0f}s, ~{left:.0f}s left)")


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
    _rounds_of: Optional[dict[int, list[int]]] = None

    @classmethod
    def open(cls, run_dir: str | Path) -> "RunView":
        from raysim.config import load_yaml
        from raysim.config.checks import build_config, make_method

        run_dir = Path(run_dir).expanduser()
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"{run_dir} holds no config.yaml; pass the out_dir of a run (or a folder of runs)")
        cfg = build_config(load_yaml(run_dir / "config.yaml"))
        return cls(run_dir, cfg, make_method(cfg))

    @property
    def store(self):
        from raysim.storage.store import StateStore

        return StateStore(self.run_dir)

    @property
    def data(self):
        if self._data is None:
            from raysim.engine.loop import prepare_data

            self._data = prepare_data(self.cfg, self.method.needs(), progress=False)
        return self._data

    @property
    def env(self):
        if self._env is None:
            from raysim.engine.hosts import env_spec

            self._env = self.method.build_env(env_spec(self.cfg, self.data.classnames), role="client")
        return self._env

    @property
    def family(self) -> str:
        return attack_family(self.method)

    def client_state(self, cid: int, round_idx: int) -> Optional[dict]:
        """The client's checkpoint written at the end of exactly `round_idx` (None when not on disk)."""
        from raysim.safeio import load_checked

        path = self.store.root / "clients" / str(cid) / f"{round_idx:05d}.pt"
        return load_checked(path) if path.is_file() else None

    def participations(self, cid: int) -> list[int]:
        """The recorded rounds in which the client uploaded."""
        if self._rounds_of is None:
            self._rounds_of = {}
            for r in self.store.upload_rounds():
                for c in self.store.load_uploads(r)["uploads"]:
                    self._rounds_of.setdefault(int(c), []).append(r)
        return self._rounds_of.get(cid, [])

    def state_before(self, cid: int, round_idx: int) -> Optional[dict]:
        """The client's private state as it entered `round_idx`: its checkpoint of the last round it took
        part in before, or its initial state when it took part in none. None when that checkpoint was
        pruned (a run kept with output.keep_client_states=last), or when the run was recorded only from a
        later round on (its earlier participations are unknown)."""
        before = [r for r in self.participations(cid) if r < round_idx]
        if before:
            return self.client_state(cid, before[-1])
        if self.store.upload_rounds()[:1] != [0]:
            return None
        from raysim.engine.hosts import initial_private

        return {"private": initial_private(self.method, self.env, self.data.client(cid), self.cfg.train.seed)}

    def releasing_state(self, cid: int, round_idx: int) -> Optional[dict]:
        """The client state behind its round-`round_idx` release: its checkpoint of that round for a method
        that releases after its local training (the default), the state it entered the round with for one
        that declares `release_first` (the VPDR frameworks, SPEC 3.4: release, aggregate, then train)."""
        if getattr(self.method, "release_first", False):
            return self.state_before(cid, round_idx)
        return self.client_state(cid, round_idx)

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
        dcr = bool(getattr(self.method, "dcr", False))  # a VPDR framework's DCR (<method>.dcr)
        names = "+".join(sorted(n.upper() for n in mechs)) or "-"
        if dcr and names == "VPP":
            return "VPDR"
        return f"{names}+DCR" if dcr else names


PROTOTYPE_UPLOADS = ("protos", "centres")  # one prototype per class (C, d); labelled centres (K, d) + centre_labels


def attack_family(method: Any) -> str:
    """"prototype" for a method that uploads a prototype release (`protos`: one per class, or `centres`
    with their `centre_labels`: FedPLVM's local cluster centres) and has a client model with features(x);
    "update" otherwise (its uploads are trained tensors: the update MIA applies)."""
    releases = getattr(method, "releases", {})
    for key in PROTOTYPE_UPLOADS:
        spec = releases.get(key)
        if spec is not None and spec.kind == "prototype" and callable(getattr(method, "model", None)):
            return "prototype"
    return "update"


def released_prototypes(upload: dict[str, torch.Tensor], labels: torch.Tensor, num_classes: int
                        ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """(class -> its released prototype(s): (d,) or (k, d) for k centres, and per-class counts the FSH
    picks its classes by). `protos` uploads: the classes with a positive public count (without one, the
    client's class counts from `labels`, its training labels: white box); `centres`: each class's
    centres, counted by how many it has."""
    if "protos" in upload:
        protos = upload["protos"].float()
        counts = upload.get("counts")
        counts = torch.bincount(labels, minlength=num_classes).float() if counts is None else counts.float()
        return {c: protos[c] for c in range(len(protos)) if counts[c] > 0}, counts
    centres, labels = upload["centres"].float(), upload["centre_labels"].long()
    return ({int(c): centres[labels == c] for c in torch.unique(labels).tolist()},
            torch.bincount(labels, minlength=num_classes).float())


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


def with_records(store: Any, jobs: list[tuple[int, int]]):
    """(round, client, that round's upload record) for each (round, client) job, in order, reading each
    round's record once (the jobs come grouped by round)."""
    record, at = None, -1
    for r, cid in jobs:
        if at != r:
            record, at = store.load_uploads(r), r
        yield r, cid, record


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
    jobs = [(r, cid) for r in todo for cid in sorted(store.load_uploads(r)["uploads"]) if clients is None or cid in clients]
    bar = Progress(f"audit {view.run_dir.name}: prototype attacks", len(jobs), enabled=progress)
    for r, cid, record in with_records(store, jobs):
        saved = view.releasing_state(cid, r)
        if saved is None:
            out.skipped.append(f"round {r}, client {cid}: the model behind its round-{r} release is no longer on disk "
                               "(the run kept only its last client states: rerun with output.keep_client_states=all)")
            bar.step(f"round {r} client {cid}: skipped (model not on disk)")
            continue
        upload = record["uploads"][cid]
        cdata = data.client(cid)
        model = method.model(env, saved["private"]).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        extract, classify = extractor_of(method, model), classifier_of(model)
        protos, counts = released_prototypes(upload, cdata.y_train, cdata.num_classes)
        # the FSH target of a class: its prototype, or the first of its released centres
        released = torch.zeros(cdata.num_classes, next(iter(protos.values())).shape[-1]) if protos else torch.zeros(0)
        for c, p in protos.items():
            released[c] = p.reshape(-1, p.shape[-1])[0]
        train_f = _features(extract, cdata.x_train, env.device)
        line = f"round {r} client {cid}"
        if mia:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + r * 1009 + cid)
            mi, ni = _subsample(cdata.y_train, max_per_class, gen), _subsample(cdata.y_test, max_per_class, gen)
            test_f = _features(extract, cdata.x_test, env.device)
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
        bar.step(line)
        if r not in out.rounds:
            out.rounds.append(r)
    return out


def clients_then_rounds(rows: list[dict[str, Any]], columns: Sequence[str]) -> dict[str, tuple[float, float]]:
    """column -> (mean over rounds of the mean over clients, std over rounds of those per-round means): the
    paper's mean ± std (vpdr.txt E.6.2, SPEC 3.7: average over clients, then over rounds). Rows are per
    (round, client[, class]); several rows of one (round, client) are averaged first. One round: std 0."""
    if not rows:
        return {c: (math.nan, math.nan) for c in columns}
    import pandas as pd

    df = pd.DataFrame(rows).groupby(["round", "client"], as_index=False)[list(columns)].mean()
    per_round = df.groupby("round")[list(columns)].mean()
    mean, std = per_round.mean(), per_round.std(ddof=0)
    return {c: (float(mean[c]), float(std[c])) for c in columns}


def per_round_means(rows: list[dict[str, Any]], columns: Sequence[str]) -> Any:
    """DataFrame: one row per round, each column the mean over clients (of their per-class means)."""
    import pandas as pd

    if not rows:
        return pd.DataFrame(columns=["round", *columns])
    df = pd.DataFrame(rows).groupby(["round", "client"], as_index=False)[list(columns)].mean()
    return df.groupby("round", as_index=False)[list(columns)].mean()


# -- gradient inversion of prompt uploads ---------------------------------------------------------

GIA_COLUMNS = ("CLIPCos", "GradCos", "PSNR", "Top-1")
GIA_REFERENCE = ("rand CLIPCos", "rand Top-1")  # random images (the inversion's start): the no-leak level
GIA_ROUNDS = ("last", "all")


@dataclass(frozen=True)
class GIABudget:
    """How much gradient inversion an audit runs (fedsept.txt 5.5, SPEC 1.12: 2,000 iterations x 4
    restarts per client). The default is small so that an audit of the offline benchmark takes about a
    minute on a CPU: `images` dummies per client, `iterations` Adam steps, `restarts`, the first `clients`
    uploading clients (0 = all) of the last recorded round (`rounds="all"`: every recorded round)."""

    images: int = 4
    iterations: int = 100
    restarts: int = 1
    clients: int = 2
    rounds: str = "last"
    lr: float = 0.1
    tv_weight: float = 1e-4

    def __post_init__(self) -> None:
        if self.images < 1 or self.iterations < 1 or self.restarts < 1 or self.clients < 0 or not self.lr > 0 or self.tv_weight < 0:
            raise ConfigError("gia: images >= 1, iterations >= 1, restarts >= 1, clients >= 0 (0 = all), lr > 0, tv_weight >= 0")
        if self.rounds not in GIA_ROUNDS:
            raise ConfigError(f"gia rounds must be one of {', '.join(GIA_ROUNDS)}, got {self.rounds!r}")


DEFAULT_GIA = GIABudget()


def gia_applies(view: RunView) -> bool:
    """Gradient inversion attacks a CLIP prompt method that declares its loss split (`loss_parts`:
    PromptFL, FedSEPT, DP-FPL) and uploads that shared tensor."""
    from raysim.methods.families.prompt import ClipPromptMethod

    m = view.method
    return isinstance(m, ClipPromptMethod) and type(m).loss_parts is not ClipPromptMethod.loss_parts


def _client_images(view: RunView, size: int) -> Callable[[int], torch.Tensor]:
    """cid -> the client's training images (normalised, at the CLIP input size), in its train order."""
    from raysim.data import DATASETS, LoadSpec
    from raysim.data.partition import is_pooled

    cfg = view.cfg
    bundle = DATASETS.get(cfg.data.dataset)(LoadSpec(data_root=cfg.data.data_root, image_size=size, download=False,
                                                     seed=cfg.train.seed, cache_dir=cfg.output.cache_dir))
    pooled = is_pooled(cfg.data.partition)

    def images(cid: int) -> torch.Tensor:
        rows = view.data.train_idx[cid]
        n = len(bundle.train.labels)  # a pooled partition's indices run over train, then test
        pick = [bundle.test.images[int(i) - n] if pooled and int(i) >= n else bundle.train.images[int(i)] for i in rows]
        return torch.stack([torch.as_tensor(p[0] if isinstance(p, (tuple, list)) else p) for p in pick]).float()

    return images


def dummy_labels(labels: torch.Tensor, k: int) -> torch.Tensor:
    """The labels the server gives its k dummies: the client's classes by how many samples it holds
    (most first, ties lower id first), cycled when it holds fewer than k classes. Labels are known to
    the attacker in the SPEC 1.12 setting (the batch's label counts leak from the update)."""
    counts = torch.bincount(labels)
    order = sorted((c for c in range(len(counts)) if counts[c] > 0), key=lambda c: (-int(counts[c]), c))
    return torch.tensor([order[i % len(order)] for i in range(k)], dtype=torch.long)


@dataclass
class GIAAudit:
    rows: list[dict[str, Any]] = field(default_factory=list)  # one per round and client
    skipped: list[str] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)


def gia_attacks(view: RunView, *, budget: GIABudget = DEFAULT_GIA, clients: Optional[Sequence[int]] = None, seed: int = 0,
                progress: bool = True) -> GIAAudit:
    """Invert each attacked client's recorded update of the shared prompt tensor (raysim.attacks.gradient_inversion).

    The server's view: theta_pre (the round's broadcast), theta_post (the upload), the client's lr and
    weight decay, the labels, and (white box, the upper bound) the client's private state as it entered
    the round (FedSEPT's R and router; its checkpoint of its previous round, or its initial state).
    g^ = -(theta_post - theta_pre) / lr is the summed update of the client's local steps: exact for one
    plain SGD step on one batch (benchmarks/gia_fedsept.py), the direction of the average gradient over
    its data for several small steps; gradient matching by cosine needs only the direction. The dummies'
    gradient is the mean over a batch of `budget.images` images with the labels of `dummy_labels`;
    each reconstruction is scored against the client's closest training image (reconstruction_metrics)."""
    from raysim.attacks.gradient_inversion import (
        TextJacobianCache,
        invert_gradient,
        observed_gradient,
        pixel_range,
        prompt_shared_grad,
        reconstruction_metrics,
    )
    from raysim.models.clip import ModelSpec, image_size_of, load_clip

    out = GIAAudit()
    store, cfg, method, env = view.store, view.cfg, view.method, view.env
    recorded = store.upload_rounds()
    todo = recorded[-1:] if budget.rounds == "last" else recorded
    jobs: list[tuple[int, int]] = []
    for r in todo:
        ids = [c for c in sorted(store.load_uploads(r)["uploads"]) if clients is None or c in clients]
        jobs += [(r, c) for c in (ids[:budget.clients] if budget.clients else ids)]
    if not jobs:
        return out
    clip = load_clip(ModelSpec(cfg.model.name, cfg.model.pretrained, cache_dir=cfg.output.cache_dir), device=env.device)
    size = image_size_of(clip)
    images_of = _client_images(view, size)
    low, high = pixel_range()
    cache = TextJacobianCache()
    bar = Progress(f"audit {view.run_dir.name}: gradient inversion ({budget.images} images, {budget.iterations} iterations x "
                   f"{budget.restarts} restarts per client)", len(jobs), enabled=progress)
    for r, cid, record in with_records(store, jobs):
        saved = view.state_before(cid, r)
        if saved is None:
            out.skipped.append(f"round {r}, client {cid}: its state entering round {r} is no longer on disk "
                               "(rerun with output.keep_client_states=all)")
            bar.step(f"round {r} client {cid}: skipped (state not on disk)")
            continue
        t0 = time.perf_counter()
        grad = prompt_shared_grad(method, env, clip, record["pre"], saved["private"], cache=cache)
        name = grad.name
        post = record["uploads"][cid][name].to(env.device)
        g_hat = observed_gradient(record["pre"][name].to(env.device), post, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        target = grad.target(g_hat)
        cdata = view.data.client(cid)
        labels = dummy_labels(cdata.y_train, budget.images)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + r * 1009 + cid)
        with torch.enable_grad():
            inv = invert_gradient(grad.fn, target, labels, image_size=size, iterations=budget.iterations, restarts=budget.restarts,
                                  lr=budget.lr, tv_weight=budget.tv_weight, generator=gen)
        originals = images_of(cid).to(env.device)
        got = reconstruction_metrics(inv.images, originals, clip=clip, env=env, grad_cos=inv.grad_cos).as_dict()
        noise = torch.randn((budget.images, 3, size, size), generator=gen).to(env.device)
        noise = torch.max(torch.min(noise, high.to(env.device)), low.to(env.device))
        ref = reconstruction_metrics(noise, originals, clip=clip, env=env).as_dict()
        out.rows.append({"round": r, "client": cid, **got, "rand CLIPCos": ref["CLIPCos"], "rand Top-1": ref["Top-1"],
                         "rand PSNR": ref["PSNR"], "seconds": time.perf_counter() - t0})
        if r not in out.rounds:
            out.rounds.append(r)
        bar.step(f"round {r} client {cid}: CLIPCos {got['CLIPCos']:.3f} (random images {ref['CLIPCos']:.3f}), "
                 f"GradCos {got['GradCos']:.3f}")
    return out


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
    gia: Optional[GIAAudit] = None

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
        m, s = r.summary.get("CLIPCos", (math.nan, math.nan)), r.summary.get("rand CLIPCos", (math.nan, 0))
        gia = [_pm(*m, ".4f"), "-" if math.isnan(s[0]) else f"{s[0]:.4f}"]
        for attack in ("update-only", "update-and-query"):
            m, s = r.summary.get(f"{attack} mean_auc", (math.nan, math.nan)), r.summary.get(f"{attack} final_auc", (math.nan, 0))
            body.append([_eps(r.epsilon), r.ldp, r.method, attack, "-" if math.isnan(m[0]) else f"{m[0]:.4f}",
                         "-" if math.isnan(s[0]) else f"{s[0]:.4f}", *gia, _pct(r.utility.get("hm", math.nan))])
    return markdown_table(["ε", "LDP", "method", "attacker", "mean AUC", "final AUC", "GIA CLIPCos", "rand CLIPCos", "HM"], body,
                          align="llll" + "rrrrr")


def gia_table(res: AuditResult) -> str:
    """Per round: the GIA metrics' mean over the attacked clients, then the mean ± std over rounds."""
    from raysim.metrics import markdown_table

    assert res.gia is not None
    cols = [*GIA_COLUMNS, *GIA_REFERENCE]
    fmt = {"CLIPCos": ".4f", "GradCos": ".4f", "PSNR": ".2f", "Top-1": ".2f", "rand CLIPCos": ".4f", "rand Top-1": ".2f"}
    body = []
    for _, row in per_round_means(res.gia.rows, cols).iterrows():
        body.append([str(int(row["round"])), *(f"{row[c]:{fmt[c]}}" for c in cols)])
    body.append(["mean ± std", *(_pm(*res.summary.get(c, (math.nan, math.nan)), fmt[c]) for c in cols)])
    return markdown_table(["round", *cols], body, align="l" + "r" * len(cols))


def _pct(v: float) -> str:
    return "-" if v is None or math.isnan(v) else f"{100 * v:.2f}"


def audit_run(run_dir: str | Path, *, rounds: str = "available", fsh: Optional[FSHConfig] = DEFAULT_FSH, mia: bool = True,
              max_per_class: int = 800, clients: Optional[Sequence[int]] = None, seed: int = 0, nonmembers: str = "other_clients",
              gia: Optional[GIABudget] = DEFAULT_GIA, progress: bool = True, write: bool = True) -> AuditResult:
    """Audit one run folder (see the module docstring); writes RUN_DIR/audit.md and its CSVs when `write`."""
    view = RunView.open(run_dir)
    if not view.store.upload_rounds():
        raise ConfigError(record_hint(view.run_dir))
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, int(view.cfg.execution.num_threads)))  # as the run's hosts (oversubscribed small ops crawl)
    try:
        return _audit_run(view, rounds=rounds, fsh=fsh, mia=mia, max_per_class=max_per_class, clients=clients, seed=seed,
                          nonmembers=nonmembers, gia=gia, progress=progress, write=write)
    finally:
        torch.set_num_threads(threads)


def _audit_run(view: RunView, *, rounds: str, fsh: Optional[FSHConfig], mia: bool, max_per_class: int,
               clients: Optional[Sequence[int]], seed: int, nonmembers: str, gia: Optional[GIABudget], progress: bool,
               write: bool) -> AuditResult:
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
        if gia is not None and gia_applies(view):
            res.gia = gia_attacks(view, budget=gia, clients=clients, seed=seed, progress=progress)
            res.summary.update(clients_then_rounds(res.gia.rows, GIA_COLUMNS + GIA_REFERENCE))
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
                  "± = std over rounds (of the per-round means over clients)", "", prototype_table([res])]
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
        if res.gia is not None:
            lines += ["", "## Gradient inversion of the uploaded prompt (fedsept.txt 5.5, SPEC 1.12)", "",
                      f"rounds attacked: {', '.join(map(str, res.gia.rounds)) or 'none'}; "
                      f"{len(res.gia.rows)} (round, client) inversions; per round the mean over clients, ± = std over rounds. "
                      "CLIPCos: cosine of the CLIP image embeddings of each reconstruction and the client's closest training "
                      "image; `rand`: the same for random images (the inversion's start), the no-leak level.", "",
                      gia_table(res)]
            if res.gia.skipped:
                lines += ["", "not attacked:", "", *[f"- {s}" for s in res.gia.skipped[:20]]]
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
    if res.gia is not None:
        pd.DataFrame(res.gia.rows).to_csv(d / "audit_gia.csv", index=False)


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
        from raysim.storage.store import StateStore

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


ATTACK_LINES = {"prototype": (("auc", "MIA ROC-AUC"), ("Cos Sim", "FSH Cos Sim")),
                "update": (("update-only mean_auc", "update-only AUC"), ("update-and-query mean_auc", "update-and-query AUC"),
                           ("CLIPCos", "GIA CLIPCos"))}
UTILITY_LINE = {"prototype": ("in_client", "In-Client acc"), "update": ("hm", "HM")}


@dataclass
class Series:
    family: str
    label: str  # "MIA ROC-AUC (fedproto IGPP)"
    kind: str  # "attack" (left axis) or "utility" (right axis)
    group: int  # the (method, LDP) line's colour index
    epsilons: list[float]  # inf = no DP
    values: list[float]


def epsilon_series(results: list[AuditResult]) -> list[Series]:
    """The lines of audit_vs_epsilon.png: per family and (method, LDP mechanism), each attack metric the
    runs have and the utility, against epsilon. A method's no-DP run joins each of its DP lines."""
    out: list[Series] = []
    for fam in sorted({r.family for r in results}):
        runs = [r for r in results if r.family == fam]
        groups: dict[str, list[AuditResult]] = {}
        for r in runs:
            groups.setdefault(r.method if r.ldp == "NoLDP" else f"{r.method} {r.ldp}", []).append(r)
        nodp = [r for r in runs if math.isinf(r.epsilon)]
        dp_methods = {r.method for r in runs if math.isfinite(r.epsilon)}
        groups = {k: v for k, v in groups.items() if any(math.isfinite(r.epsilon) for r in v) or v[0].method not in dp_methods}
        for gi, (name, rs) in enumerate(sorted(groups.items())):
            rs = sorted(rs + [n for n in nodp if n.method == rs[0].method and n not in rs], key=lambda r: r.epsilon)
            eps = [r.epsilon for r in rs]
            for key, label in ATTACK_LINES[fam]:
                ys = [r.summary.get(key, (math.nan, 0))[0] for r in rs]
                if not all(math.isnan(y) for y in ys):
                    out.append(Series(fam, f"{label} ({name})", "attack", gi, eps, ys))
            key, label = UTILITY_LINE[fam]
            out.append(Series(fam, f"{label} ({name})", "utility", gi, eps, [r.utility.get(key, math.nan) for r in rs]))
    return out


def plot_vs_epsilon(results: list[AuditResult], path: Path) -> Optional[Path]:
    """Attack metrics (left axis: MIA AUC, FSH Cos Sim, GIA CLIPCos) and utility (right axis, dashed)
    against epsilon, one colour per (method, LDP mechanism); no DP is drawn at the right end. None when
    the runs have fewer than two epsilons."""
    eps = sorted({r.epsilon for r in results})
    if len(eps) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [e for e in eps if math.isfinite(e)]
    inf_x = (max(finite) * 1.5 if finite else 1.0) if math.inf in eps else None
    series = epsilon_series(results)
    families = sorted({s.family for s in series})
    fig, axes = plt.subplots(1, len(families), figsize=(6.5 * len(families), 4.2), squeeze=False)
    for ax, fam in zip(axes[0], families):
        right = ax.twinx()
        marks: dict[str, str] = {}
        for line in (s for s in series if s.family == fam):
            xs = [inf_x if math.isinf(e) else e for e in line.epsilons]
            if line.kind == "utility":
                right.plot(xs, line.values, marker="x", linestyle="--", color=f"C{line.group}", alpha=0.6, label=line.label)
            else:
                metric = line.label.split(" (")[0]
                mark = marks.setdefault(metric, "os^dv"[len(marks) % 5])
                ax.plot(xs, line.values, marker=mark, linestyle="-", color=f"C{line.group}", label=line.label)
        ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
        ticks = finite + ([inf_x] if inf_x is not None else [])
        ax.set_xticks(ticks, [f"{e:g}" for e in finite] + (["no DP"] if inf_x is not None else []))
        ax.set_xlabel("ε (local DP budget)")
        ax.set_ylabel("attack (AUC, Cos Sim)" if fam == "prototype" else "attack (AUC, GIA CLIPCos)")
        right.set_ylabel(f"utility ({UTILITY_LINE[fam][1]}, dashed)")
        ax.set_title("prototype attacks (FSH, MIA)" if fam == "prototype" else "update MIA, gradient inversion")
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
    ap.add_argument("--no-gia", action="store_true", help="skip the gradient inversion of prompt uploads")
    ap.add_argument("--gia-images", type=int, default=GIABudget.images, help="GIA: dummy images per client (default 4)")
    ap.add_argument("--gia-iterations", type=int, default=GIABudget.iterations,
                    help="GIA: Adam steps per restart (default 100; SPEC 1.12: 2000)")
    ap.add_argument("--gia-restarts", type=int, default=GIABudget.restarts, help="GIA: restarts, best kept (default 1; SPEC: 4)")
    ap.add_argument("--gia-clients", type=int, default=GIABudget.clients,
                    help="GIA: the first N uploading clients of each attacked round (default 2; 0 = all)")
    ap.add_argument("--gia-rounds", choices=GIA_ROUNDS, default=GIABudget.rounds, help="GIA: the last recorded round (default) or all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    path = Path(args.path).expanduser()
    try:
        fsh = None if args.no_fsh else FSHConfig(max_steps=args.fsh_steps, patience=args.fsh_patience, classes=args.fsh_classes,
                                                 objective=args.fsh_objective, min_steps=min(FSHConfig.min_steps, args.fsh_steps))
        gia = None if args.no_gia else GIABudget(images=args.gia_images, iterations=args.gia_iterations, restarts=args.gia_restarts,
                                                 clients=args.gia_clients, rounds=args.gia_rounds)
        kw = dict(rounds=args.rounds, fsh=fsh, mia=not args.no_mia, max_per_class=args.max_per_class, clients=args.clients,
                  seed=args.seed, nonmembers=args.nonmembers, gia=gia, progress=not args.quiet)
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
