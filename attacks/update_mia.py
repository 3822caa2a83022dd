"""Membership inference by an honest-but-curious server (fedsept.txt section 5.5, SPEC 1.12).

The server's view is a run recorded with `output.record_uploads=true` (out_dir/uploads/ROUND.pt: every
client's upload and the broadcast state it started from). Two logistic-regression attackers:

- update-only: per (round, client) features of the uploaded shared tensor: ||upload - pre||_2, the
  uploaded tensor's quantiles at {0, .1, .25, .5, .75, .9, 1}, its sparsity (fraction |x| < 1e-6),
  the drift ||theta_t - theta_t'|| from the client's previous upload (0 at its first) and the mean
  cosine of the client's successive updates over a sliding window of w=3 participations.
- update-and-query: the same, concatenated with per-sample outputs of the target client's final
  personalised model (max softmax probability, top-1 minus top-2 margin, entropy, true-class
  probability, cross-entropy loss), rebuilt from the run's checkpoints.

Members are the training samples of a target client. Non-members (`nonmembers=`):

- "other_clients" (the default, as in the paper and SPEC 1.12): as many training samples drawn from the
  other clients.
- "own_test": samples of the target client's own test split, which nobody trained on, drawn class by
  class to match the members (per class of the target's training set, min(#train, #test) members and
  as many non-members; members of a class without test samples are left out).

Every client takes its turn as the target and the pairs of all targets are pooled into one attacker
data set: split 50/50 (seeded, stratified), z-scored on the attacker-train half, `LogisticRegression`,
ROC-AUC on the other half; per round, then the mean over rounds and the final round.

Update features are client-level: a sample inherits the features of the client that owns it, so in
the pooled set every client's features appear as members (when it is the target) and as non-members
(when another client is). Updates alone therefore cannot tell a client's samples from anyone else's,
and the update-only AUC sits at chance, as in the paper (0.45-0.50). The query features are per
sample and come from the target's own model, which is confident on the data it was trained on (and,
under label skew, on its own classes), so without DP the update-and-query attack succeeds (paper: AUC
0.947, 0.55-0.58 under local DP).

With other_clients non-members and label skew, the query attacker mostly learns "is this sample of one
of the target's classes", which a model that never memorised anything also reveals (and local DP,
which covers only the uploaded tensor, does not hide). "own_test" asks the memorisation question
proper: members and non-members have the same classes and the same update features (the target's
own), so the update-only attacker cannot separate them (its AUC differs from 0.5 only through how the
50/50 split happens to share out each target's pairs) and the update-and-query AUC measures how much
more confident the personalised model is on its training samples than on unseen samples of the same
classes.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.attacks.base import Attack, AttackOutput, register_attack, releases_prototypes, say
from raysim.attacks.prototype_mia import roc_metrics
from raysim.errors import ConfigError, RaysimError
from raysim.storage.runfolder import RunFolder

if TYPE_CHECKING:
    import pandas as pd

QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
UPDATE_FEATURES = ("delta_norm", *(f"q{int(100 * q)}" for q in QUANTILES), "sparsity", "drift", "window_cos")
QUERY_FEATURES = ("max_prob", "margin", "entropy", "true_prob", "ce_loss")
ATTACKS = ("update-only", "update-and-query")
NONMEMBERS = ("other_clients", "own_test")


# -- features ---------------------------------------------------------------------------------

def flatten(tensors: Mapping[str, Tensor]) -> np.ndarray:
    """The uploaded tensors as one float64 vector (names in sorted order)."""
    return np.concatenate([tensors[k].detach().cpu().double().reshape(-1).numpy() for k in sorted(tensors)])


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    den = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b) / den if den > 0 else 0.0


def update_features(history: Sequence[tuple[np.ndarray, np.ndarray]], *, window: int = 3) -> np.ndarray:
    """(T, 11) features (`UPDATE_FEATURES`) of one client's successive uploads.

    `history[i]` = (pre, post): the flat broadcast state the client started from and its flat upload, at
    its i-th participation. The windowed cosine averages cos(delta_j, delta_j+1) over the last `window`
    updates (0 while there is only one)."""
    rows, deltas = [], []
    prev: Optional[np.ndarray] = None
    for pre, post in history:
        delta = post - pre
        deltas.append(delta)
        recent = deltas[-window:]
        cosines = [_cos(a, b) for a, b in zip(recent, recent[1:])]
        rows.append([
            float(np.linalg.norm(delta)),
            *np.quantile(post, QUANTILES).tolist(),
            float(np.mean(np.abs(post) < 1e-6)),
            0.0 if prev is None else float(np.linalg.norm(post - prev)),
            float(np.mean(cosines)) if cosines else 0.0,
        ])
        prev = post
    return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(UPDATE_FEATURES))


def query_features(logits: Tensor, labels: Tensor) -> np.ndarray:
    """(N, 5) per-sample outputs of a model (`QUERY_FEATURES`) for inputs with true labels `labels`."""
    logp = F.log_softmax(logits.detach().double(), dim=-1)
    p = logp.exp()
    top = p.topk(min(2, p.shape[-1]), dim=-1).values
    margin = top[:, 0] - top[:, 1] if top.shape[-1] > 1 else top[:, 0]
    true_logp = logp.gather(1, labels.long().view(-1, 1)).squeeze(1)
    entropy = -(p * logp).sum(-1)
    return torch.stack([top[:, 0], margin, entropy, true_logp.exp(), -true_logp], dim=1).numpy()


def recorded_update_features(run_dir: str | Path | RunFolder) -> dict[int, dict[int, np.ndarray]]:
    """round -> client -> update features, for every recorded round of a run."""
    run = run_dir if isinstance(run_dir, RunFolder) else RunFolder(run_dir)
    rounds = run.upload_rounds()
    if not rounds:
        raise ConfigError(f"run {run_dir} was not recorded: rerun with output.record_uploads=true")
    seen: dict[int, list[tuple[int, np.ndarray, np.ndarray]]] = {}
    for r in rounds:
        record = run.uploads(r)
        for cid, tensors in record["uploads"].items():
            pre = {k: record["pre"].get(k, torch.zeros_like(v)) for k, v in tensors.items()}  # prototypes etc.: from 0
            seen.setdefault(int(cid), []).append((r, flatten(pre), flatten(tensors)))
    out: dict[int, dict[int, np.ndarray]] = {r: {} for r in rounds}
    for cid, hist in seen.items():
        for (r, _, _), feats in zip(hist, update_features([(a, b) for _, a, b in hist])):
            out[r][cid] = feats
    return out


# -- the attack -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pairs:
    """The attacker's candidates: a sample (a row of the training set, or of the test set where
    `in_test`), the client whose update features it carries (`owner`: the client that holds it), the
    target, member?"""

    sample: np.ndarray
    owner: np.ndarray
    target: np.ndarray
    member: np.ndarray
    train: np.ndarray  # bool: in the attacker's training half
    in_test: np.ndarray  # bool: `sample` indexes the test set (own_test non-members)
    nonmembers: str = "other_clients"

    def __len__(self) -> int:
        return len(self.sample)


def check_nonmembers(nonmembers: str) -> str:
    if nonmembers not in NONMEMBERS:
        raise ConfigError(
            f"nonmembers must be one of {', '.join(NONMEMBERS)} (other clients' training samples, or the "
            f"target's own test samples of its classes), got {nonmembers!r}"
        )
    return nonmembers


def membership_pairs(
    train_idx: Sequence[np.ndarray],
    targets: Sequence[int],
    *,
    seed: int = 0,
    nonmembers: str = "other_clients",
    test_idx: Optional[Sequence[np.ndarray]] = None,
    y_train: Optional[np.ndarray] = None,
    y_test: Optional[np.ndarray] = None,
) -> Pairs:
    """Balanced members (a target's training samples) and non-members, pooled over the targets, with a
    seeded, stratified 50/50 attacker train/test split. Non-members: "other_clients", other clients'
    training samples; "own_test", the target's test samples (`test_idx[t]`), class-matched to the
    members (needs `test_idx`, `y_train` and `y_test`; see the module docstring)."""
    from sklearn.model_selection import train_test_split

    check_nonmembers(nonmembers)
    own_test = nonmembers == "own_test"
    if own_test and (test_idx is None or y_train is None or y_test is None):
        raise ConfigError("nonmembers='own_test' needs the clients' test_idx and the labels y_train, y_test")
    rng = np.random.default_rng(seed)
    owner_of = np.full(1 + max(int(i.max()) for i in train_idx if len(i)), -1)
    for cid, idx in enumerate(train_idx):
        owner_of[idx] = cid
    cols: list[list[np.ndarray]] = [[], [], [], [], []]  # sample, owner, target, member, in_test
    for t in targets:
        if own_test:
            assert test_idx is not None and y_train is not None and y_test is not None  # checked above
            mine, theirs = np.asarray(train_idx[t]), np.asarray(test_idx[t])
            members, nonmember = [], []
            for c in np.unique(y_train[mine]):
                tr, te = mine[y_train[mine] == c], theirs[y_test[theirs] == c]
                k = min(len(tr), len(te))
                members.append(rng.choice(tr, size=k, replace=False))
                nonmember.append(rng.choice(te, size=k, replace=False))
            m, nm = (np.concatenate(x) if x else np.zeros(0, np.int64) for x in (members, nonmember))
            n = len(m)
            owner = np.full(2 * n, t)
        else:
            others = np.concatenate([idx for cid, idx in enumerate(train_idx) if cid != t])
            n = min(len(train_idx[t]), len(others))
            m = rng.choice(train_idx[t], size=n, replace=False)
            nm = rng.choice(others, size=n, replace=False)
            owner = owner_of[np.r_[m, nm]]
        parts = (np.r_[m, nm], owner, np.full(2 * n, t), np.r_[np.ones(n), np.zeros(n)], np.r_[np.zeros(n), np.full(n, own_test)])
        for col, part in zip(cols, parts):
            col.append(part)
    sample, owner, target, member, in_test = (np.concatenate(c) for c in cols)
    if len(sample) < 4:
        raise ConfigError(
            f"too few candidate samples ({len(sample)}) for a membership attack; use clients with more data"
            + (" (own_test: with test samples of their training classes)" if own_test else "")
        )
    train_rows, _ = train_test_split(np.arange(len(sample)), test_size=0.5, random_state=seed, stratify=member)
    train = np.zeros(len(sample), dtype=bool)
    train[train_rows] = True
    return Pairs(sample.astype(np.int64), owner.astype(np.int64), target.astype(np.int64), member.astype(bool), train,
                 in_test.astype(bool), nonmembers)


def logistic_auc(x: np.ndarray, member: np.ndarray, train: np.ndarray, *, seed: int = 0) -> float:
    """ROC-AUC on the test half of a z-scored logistic regression fitted on the train half (nan when a
    half lacks members or non-members)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    test = ~train
    if len(set(member[train])) < 2 or len(set(member[test])) < 2:
        return math.nan
    scaler = StandardScaler().fit(x[train])
    model = LogisticRegression(max_iter=1000, random_state=seed).fit(scaler.transform(x[train]), member[train])
    score = model.predict_proba(scaler.transform(x[test]))[:, 1]
    return roc_metrics(score[member[test]], score[~member[test]])[0]


@dataclass
class AttackResult:
    """AUC per recorded round of one attacker."""

    attack: str
    round_aucs: dict[int, float] = field(default_factory=dict)
    pairs: int = 0
    nonmembers: str = "other_clients"

    @property
    def mean_auc(self) -> float:
        vals = [a for a in self.round_aucs.values() if math.isfinite(a)]
        return float(np.mean(vals)) if vals else math.nan

    @property
    def final_auc(self) -> float:
        return self.round_aucs[max(self.round_aucs)] if self.round_aucs else math.nan


def update_mia(
    updates: Mapping[int, Mapping[int, np.ndarray]],
    pairs: Pairs,
    *,
    query: Optional[np.ndarray] = None,
    seed: int = 0,
) -> AttackResult:
    """Per round, the logistic attacker on the owners' update features (plus `query`, per-pair query
    features, for the update-and-query attacker). Pairs whose owner did not upload that round are left out.
    The non-members are whatever `pairs` holds (`membership_pairs(nonmembers=...)`); the result names them."""
    result = AttackResult(ATTACKS[query is not None], pairs=len(pairs), nonmembers=pairs.nonmembers)
    for r in sorted(updates):
        feats = updates[r]
        keep = np.array([int(o) in feats for o in pairs.owner])
        if not keep.any():
            continue
        x = np.stack([feats[int(o)] for o in pairs.owner[keep]])
        if query is not None:
            x = np.concatenate([x, query[keep]], axis=1)
        result.round_aucs[r] = logistic_auc(x, pairs.member[keep], pairs.train[keep], seed=seed)
    return result


# -- rebuilding the final personalised models -------------------------------------------------

def final_model_logits(
    run_dir: str | Path | RunFolder, cfg, data, rows: Mapping[int, np.ndarray], *, in_test: Optional[Mapping[int, np.ndarray]] = None,
) -> dict[int, Tensor]:
    """Logits of each client's final personalised model on its rows `rows[client]` of the training set
    (or of the test set where `in_test[client]`, a bool mask over those rows, is set), from the checkpoints
    of the last completed round; a client that never took part has its initial private state."""
    run = run_dir if isinstance(run_dir, RunFolder) else RunFolder(run_dir, cfg=cfg, data=data)
    method, env = run.method, run.env
    last = run.completed_round()
    server = run.server_state(last)
    if server is None:
        raise ConfigError(f"run {run_dir} has no server checkpoint; was it interrupted before its first round?")
    shared = run.broadcast(server)
    out = {}
    for cid, idx in rows.items():
        test = np.zeros(len(idx), dtype=bool) if in_test is None else np.asarray(in_test[cid], dtype=bool)
        inputs = []
        for tr, te in ((data.x_train, data.x_test), (data.tok_train, data.tok_test)):
            if tr is None:
                continue
            x = np.empty((len(idx), *tr.shape[1:]), dtype=tr.dtype)
            x[~test], x[test] = tr[idx[~test]], te[idx[test]]
            inputs.append(torch.as_tensor(x))
        cdata = data.client(cid)
        saved = run.store.load_client(cid, last)
        private = saved["private"] if saved is not None else run.initial_private(cid)
        with torch.no_grad():
            out[cid] = method.predictor(env, shared, private, cdata)(*inputs).float().cpu()
    return out


def audit_run(
    run_dir: str | Path | RunFolder, *, target_clients: Optional[Sequence[int]] = None, seed: int = 0,
    nonmembers: str = "other_clients",
) -> pd.DataFrame:
    """Both attackers on a recorded run: one row per attack with mean_auc, final_auc, the number of
    recorded rounds, targets and candidate pairs, the run's HM accuracy (a fraction; SPEC 1.12) and the
    kind of non-members. `target_clients`: whose membership is attacked (default: every client; see the
    module docstring for why the pooled design wants several). `nonmembers`: "other_clients" (SPEC) or
    "own_test" (the target's own test samples of its classes; see the module docstring)."""
    import pandas as pd

    from raysim.metrics import summarize

    check_nonmembers(nonmembers)
    run = run_dir if isinstance(run_dir, RunFolder) else RunFolder.open(run_dir)
    cfg = run.cfg
    updates = recorded_update_features(run)
    data = run.data
    targets = list(range(data.num_clients)) if target_clients is None else sorted(set(int(t) for t in target_clients))
    bad = [t for t in targets if not 0 <= t < data.num_clients]
    if bad:
        raise ConfigError(f"target clients {bad} do not exist (the run has clients 0..{data.num_clients - 1})")
    pairs = membership_pairs(data.train_idx, targets, seed=seed, nonmembers=nonmembers, test_idx=data.test_idx,
                             y_train=data.y_train, y_test=data.y_test)
    mine = {t: pairs.target == t for t in targets}
    logits = final_model_logits(run, cfg, data, {t: pairs.sample[m] for t, m in mine.items()},
                                in_test={t: pairs.in_test[m] for t, m in mine.items()})
    labels = np.empty(len(pairs), dtype=np.int64)
    labels[~pairs.in_test] = data.y_train[pairs.sample[~pairs.in_test]]
    labels[pairs.in_test] = data.y_test[pairs.sample[pairs.in_test]]
    query = np.zeros((len(pairs), len(QUERY_FEATURES)))
    for t, m in mine.items():
        query[m] = query_features(logits[t], torch.as_tensor(labels[m]))
    hm = summarize(run.path / "results.csv", last=max(1, cfg.eval.last)).get("hm", math.nan)
    results = [update_mia(updates, pairs, seed=seed), update_mia(updates, pairs, query=query, seed=seed)]
    return pd.DataFrame([
        {"attack": r.attack, "mean_auc": r.mean_auc, "final_auc": r.final_auc, "rounds": len(r.round_aucs),
         "targets": len(targets), "pairs": r.pairs, "hm": hm, "nonmembers": r.nonmembers}
        for r in results
    ])


@register_attack
class UpdateMIA(Attack):
    """The update-only and update-and-query logistic attackers on what the server saw (options: the kind
    of non-members, NONMEMBERS): one row per attacker (mean AUC over rounds, final-round AUC, HM)."""

    name = "update_mia"
    family = "update"
    order = 30

    def applies(self, run: Any, method: Any) -> bool:
        """A method whose uploads are trained tensors (not a prototype release)."""
        return not releases_prototypes(method)

    def run(self, run: Any, method: Any, *, rounds: str = "available", clients: Optional[Sequence[int]] = None, seed: int = 0,
            options: Any = None, progress: bool = True) -> AttackOutput:
        if progress:
            say(f"audit {run.run_dir.name}: update MIA (update-only, update-and-query) over {len(run.upload_rounds())} rounds")
        df = audit_run(run, target_clients=clients, seed=seed, nonmembers=options or "other_clients")
        summary: dict[str, tuple[float, float]] = {}
        for _, row in df.iterrows():
            summary[f"{row['attack']} mean_auc"] = (float(row["mean_auc"]), 0.0)
            summary[f"{row['attack']} final_auc"] = (float(row["final_auc"]), 0.0)
        return AttackOutput(rows=df, rounds=run.upload_rounds(), summary=summary)


def markdown(df: pd.DataFrame) -> str:
    from raysim.metrics import markdown_table

    return markdown_table(
        list(df.columns), [[f"{v:.4f}" if isinstance(v, float) else str(v) for v in row] for _, row in df.iterrows()]
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m raysim.attacks.update_mia", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", help="out_dir of a run made with output.record_uploads=true")
    ap.add_argument("--targets", type=int, nargs="*", default=None, help="target clients (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nonmembers", choices=NONMEMBERS, default="other_clients",
                    help="other clients' training samples (SPEC, default) or the target's own test samples of its classes")
    args = ap.parse_args(argv)
    try:
        df = audit_run(args.run_dir, target_clients=args.targets, seed=args.seed, nonmembers=args.nonmembers)
    except RaysimError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(markdown(df))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
