"""What an attack is, and the walk over recorded releases that the per-release attacks share.

An attack is a small class registered in `ATTACKS` (one module per attack, found by `discover()`):

    name      its key (the audit's option names, the outputs' names)
    family    the audit report section it belongs in: "prototype" (vpdr.txt 5.4) or "update" (fedsept.txt 5.5)
    order     where it runs, and its metrics land in audit_summary.csv, among the attacks that apply
    applies(run, method) -> bool     from the method's declared hooks (release kinds, `loss_parts`, `model`)
    run(run, method, *, rounds, clients, seed, options, progress) -> AttackOutput

Attacks read only a `RunFolder` (raysim.storage.runfolder: config, uploads, client states, the run's
method, data and client environment rebuilt) and the method's declared hooks, never the engine.

A `ReleaseAttack` scores one recorded release at a time with the white-box model behind it (FSH, the
prototype MIA); `walk_releases` builds that model once per (round, client) for every release attack of
the audit and hands each its `Release`.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, cast

import torch

from raysim.errors import ConfigError
from raysim.registry import Registry

ROUNDS = ("available", "last")
PROTOTYPE_UPLOADS = ("protos", "centres")  # one prototype per class (C, d); labelled centres (K, d) + centre_labels


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Progress:
    """Progress lines on stderr for a long attack: "label [k/N] what (elapsed, ~left)"."""

    def __init__(self, label: str, total: int, *, enabled: bool = True) -> None:
        self.label, self.total, self.enabled, self.done, self.t0 = label, total, enabled, 0, time.perf_counter()
        if enabled and total:
            say(f"{label}: {total} to do")

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        spent = time.perf_counter() - self.t0
        left = spent / self.done * (self.total - self.done)
        say(f"{self.label} [{self.done}/{self.total}] {what} ({spent:.0f}s, ~{left:.0f}s left)")


def record_hint(run_dir: Any) -> str:
    return (f"{run_dir} has no recorded uploads (uploads/): the attacks need what the server saw. Record them by "
            f"rerunning with output.record_uploads=true (raysim run ... output.record_uploads=true), or continue this run "
            f"with output.resume={run_dir} output.record_uploads=true train.rounds=N to record its further rounds")


# -- the method's declared hooks ----------------------------------------------------------------

def releases_prototypes(method: Any) -> bool:
    """True for a method that uploads a prototype release (`protos`: one per class, or `centres` with their
    `centre_labels`: FedPLVM's local cluster centres) and has a client model with features(x)."""
    releases = getattr(method, "releases", {})
    for key in PROTOTYPE_UPLOADS:
        spec = releases.get(key)
        if spec is not None and spec.kind == "prototype" and callable(getattr(method, "model", None)):
            return True
    return False


def attack_family(method: Any) -> str:
    """"prototype" for a method with a prototype release (`releases_prototypes`); "update" otherwise (its
    uploads are trained tensors: the update MIA applies)."""
    return "prototype" if releases_prototypes(method) else "update"


def declares(method: Any, hook: str) -> bool:
    """True when the method's class defines `hook` itself, below the family base that introduced it (whose
    default refuses: e.g. the prompt family's `loss_parts`)."""
    owners = [c for c in type(method).__mro__ if hook in vars(c)]
    return len(owners) >= 2


def extractor_of(method: Any, model: torch.nn.Module) -> Callable:
    """The features the method releases prototypes of, differentiable w.r.t. the images: the method's
    `release_feature_fn(model)` where it has one (e.g. a backbone-path release), else model.features."""
    hook = getattr(method, "release_feature_fn", None)
    return hook(model) if callable(hook) else cast(Callable, model.features)


def classifier_of(model: torch.nn.Module) -> Callable:
    """Features -> logits of the client's own head."""
    head = getattr(model, "head_logits", None)
    return head if callable(head) else cast(Callable, model.head)


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


def features(extract: Callable, x: torch.Tensor, device: Any, batch: int = 256) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([extract(x[i:i + batch].to(device)).float().cpu() for i in range(0, len(x), batch)]) if len(x) else \
            torch.zeros(0)


# -- averaging (vpdr.txt E.6.2, SPEC 3.7) -----------------------------------------------------------

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


# -- attacks ------------------------------------------------------------------------------------

@dataclass
class AttackOutput:
    """What one attack made of a run: its rows (a list of dicts, or a DataFrame), the (round, client)
    pairs it could not attack and why, the rounds it attacked, and its metrics as (mean, std)."""

    rows: Any = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)
    summary: dict[str, tuple[float, float]] = field(default_factory=dict)


class Attack:
    name: str = ""
    family: str = "update"
    order: int = 100
    summary_order: Optional[int] = None  # where its metrics land in audit_summary.csv (default: `order`)

    def applies(self, run: Any, method: Any) -> bool:
        raise NotImplementedError

    def run(self, run: Any, method: Any, *, rounds: str = "available", clients: Optional[Sequence[int]] = None, seed: int = 0,
            options: Any = None, progress: bool = True) -> AttackOutput:
        raise NotImplementedError


ATTACKS: Registry[Attack] = Registry("attack")


def register_attack(cls: type) -> type:
    """Class decorator: register one instance of the attack under its `name`."""
    ATTACKS.add(cls())
    return cls


@dataclass
class Release:
    """One client's recorded release and the white-box model behind it (SPEC 3.7)."""

    round: int
    client: int
    upload: dict[str, torch.Tensor]
    data: Any  # the client's ClientData
    device: Any
    extract: Callable  # images -> the released features
    classify: Callable  # features -> logits of the client's own head
    protos: dict[int, torch.Tensor]  # class -> its released prototype(s)
    counts: torch.Tensor
    released: torch.Tensor  # (C, d): each class's prototype, or the first of its centres (zeros elsewhere)
    train_features: torch.Tensor


class ReleaseAttack(Attack):
    """An attack that scores one release at a time (`score`); `run` walks the releases for it alone."""

    family = "prototype"

    def applies(self, run: Any, method: Any) -> bool:
        return releases_prototypes(method)

    def score(self, release: Release, *, seed: int, options: Any) -> tuple[list[dict[str, Any]], str, list[str]]:
        """(rows, a note for the progress line, skipped lines)."""
        raise NotImplementedError

    def summarize(self, rows: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
        raise NotImplementedError

    def run(self, run: Any, method: Any, *, rounds: str = "available", clients: Optional[Sequence[int]] = None, seed: int = 0,
            options: Any = None, progress: bool = True) -> AttackOutput:
        outputs, _, _ = walk_releases(run, method, [(self, options)], rounds=rounds, clients=clients, seed=seed, progress=progress)
        return outputs[self.name]


def walk_releases(run: Any, method: Any, attacks: Sequence[tuple[ReleaseAttack, Any]], *, rounds: str = "available",
                  clients: Optional[Sequence[int]] = None, seed: int = 0, progress: bool = True
                  ) -> tuple[dict[str, AttackOutput], list[str], list[int]]:
    """Every recorded release whose releasing model is on disk, scored by each of `attacks` ((attack, its
    options)). Returns per attack its output, and the skipped lines and attacked rounds of the walk."""
    if rounds not in ROUNDS:
        raise ConfigError(f"rounds must be one of {', '.join(ROUNDS)}, got {rounds!r}")
    recorded = run.upload_rounds()
    if not recorded:
        raise ConfigError(record_hint(run.run_dir))
    todo = recorded[-1:] if rounds == "last" else recorded
    outputs = {a.name: AttackOutput() for a, _ in attacks}
    skipped: list[str] = []
    attacked: list[int] = []
    env, data = run.env, run.data
    jobs = [(r, cid) for r in todo for cid in sorted(run.uploads(r)["uploads"]) if clients is None or cid in clients]
    bar = Progress(f"audit {run.run_dir.name}: prototype attacks", len(jobs), enabled=progress)
    for r, cid, record in run.records(jobs):
        saved = run.releasing_state(cid, r)
        if saved is None:
            skipped.append(f"round {r}, client {cid}: the model behind its round-{r} release is no longer on disk "
                           "(the run kept only its last client states: rerun with output.keep_client_states=all)")
            bar.step(f"round {r} client {cid}: skipped (model not on disk)")
            continue
        upload = record["uploads"][cid]
        cdata = data.client(cid)
        model = method.model(env, saved["private"]).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        extract = extractor_of(method, model)
        protos, counts = released_prototypes(upload, cdata.y_train, cdata.num_classes)
        # the FSH target of a class: its prototype, or the first of its released centres
        released = torch.zeros(cdata.num_classes, next(iter(protos.values())).shape[-1]) if protos else torch.zeros(0)
        for c, p in protos.items():
            released[c] = p.reshape(-1, p.shape[-1])[0]
        release = Release(r, cid, upload, cdata, env.device, extract, classifier_of(model), protos, counts, released,
                          features(extract, cdata.x_train, env.device))
        line = f"round {r} client {cid}"
        for attack, options in attacks:
            rows, note, skips = attack.score(release, seed=seed, options=options)
            outputs[attack.name].rows.extend(rows)
            skipped.extend(skips)
            line += note
        bar.step(line)
        if r not in attacked:
            attacked.append(r)
    for attack, _ in attacks:
        out = outputs[attack.name]
        out.rounds, out.skipped, out.summary = list(attacked), list(skipped), attack.summarize(out.rows)
    return outputs, skipped, attacked
