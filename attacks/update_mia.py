"""Membership inference by an honest-but-curious server (fedsept.txt section 5.5, SPEC 1.12).

The server's view is a run recorded with `record_uploads=true` (out_dir/uploads/ROUND.pt: every
client's upload and the broadcast state it started from). Two logistic-regression attackers:

- update-only: per (round, client) features of the uploaded shared tensor: ||upload - pre||_2, the
  uploaded tensor's quantiles at {0, .1, .25, .5, .75, .9, 1}, its sparsity (fraction |x| < 1e-6),
  the drift ||theta_t - theta_t'|| from the client's previous upload (0 at its first) and the mean
  cosine of the client's successive updates over a sliding window of w=3 participations.
- update-and-query: the same, concatenated with per-sample outputs of the target client's final
  personalised model (max softmax probability, top-1 minus top-2 margin, entropy, true-class
  probability, cross-entropy loss), rebuilt from the run's checkpoints.

Members are the training samples of a target client, non-members as many training samples drawn from
the other clients. Every client takes its turn as the target and the pairs of all targets are pooled
into one attacker data set: split 50/50 (seeded, stratified), z-scored on the attacker-train half,
`LogisticRegression`, ROC-AUC on the other half; per round, then the mean over rounds and the final
round.

Update features are client-level: a sample inherits the features of the client that owns it, so in
the pooled set every client's features appear as members (when it is the target) and as non-members
(when another client is). Updates alone therefore cannot tell a client's samples from anyone else's,
and the update-only AUC sits at chance, as in the paper (0.45-0.50). The query features are per
sample and come from the target's own model, which is confident on the data it was trained on (and,
under label skew, on its own classes), so without DP the update-and-query attack succeeds (paper: AUC
0.947, 0.55-0.58 under local DP).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.attacks.prototype_mia import roc_metrics
from raysim.errors import ConfigError, RaysimError

if TYPE_CHECKING:
    import pandas as pd

QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
UPDATE_FEATURES = ("delta_norm", *(f"q{int(100 * q)}" for q in QUANTILES), "sparsity", "drift", "window_cos")
QUERY_FEATURES = ("max_prob", "margin", "entropy", "true_prob", "ce_loss")
ATTACKS = ("update-only", "update-and-query")


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


def recorded_update_features(run_dir: str | Path) -> dict[int, dict[int, np.ndarray]]:
    """round -> client -> update features, for every recorded round of a run."""
    from raysim.store import StateStore

    store = StateStore(run_dir)
    rounds = store.upload_rounds()
    if not rounds:
        raise ConfigError(f"run {run_dir} was not recorded: rerun with record_uploads=true")
    seen: dict[int, list[tuple[int, np.ndarray, np.ndarray]]] = {}
    for r in rounds:
        record = store.load_uploads(r)
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
    """The attacker's candidates: a sample (row of the training set), its owner, the target, member?"""

    sample: np.ndarray
    owner: np.ndarray
    target: np.ndarray
    member: np.ndarray
    train: np.ndarray  # bool: in the attacker's training half

    def __len__(self) -> int:
        return len(self.sample)


def membership_pairs(train_idx: Sequence[np.ndarray], targets: Sequence[int], *, seed: int = 0) -> Pairs:
    """Balanced members (a target's training samples) and non-members (other clients' training samples),
    pooled over the targets, with a seeded, stratified 50/50 attacker train/test split."""
    from sklearn.model_selection import train_test_split

    rng = np.random.default_rng(seed)
    owner_of = np.full(1 + max(int(i.max()) for i in train_idx if len(i)), -1)
    for cid, idx in enumerate(train_idx):
        owner_of[idx] = cid
    cols: list[list[np.ndarray]] = [[], [], []]
    for t in targets:
        others = np.concatenate([idx for cid, idx in enumerate(train_idx) if cid != t])
        n = min(len(train_idx[t]), len(others))
        members = rng.choice(train_idx[t], size=n, replace=False)
        nonmembers = rng.choice(others, size=n, replace=False)
        for col, part in zip(cols, (np.r_[members, nonmembers], np.full(2 * n, t), np.r_[np.ones(n), np.zeros(n)])):
            col.append(part)
    sample, target, member = (np.concatenate(c) for c in cols)
    if len(sample) < 4:
        raise ConfigError(f"too few candidate samples ({len(sample)}) for a membership attack; use clients with more data")
    train_rows, _ = train_test_split(np.arange(len(sample)), test_size=0.5, random_state=seed, stratify=member)
    train = np.zeros(len(sample), dtype=bool)
    train[train_rows] = True
    return Pairs(sample, owner_of[sample], target, member.astype(bool), train)


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
    features, for the update-and-query attacker). Pairs whose owner did not upload that round are left out."""
    result = AttackResult(ATTACKS[query is not None], pairs=len(pairs))
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

def final_model_logits(run_dir: str | Path, cfg, data, rows: Mapping[int, np.ndarray]) -> dict[int, Tensor]:
    """Logits of each client's final personalised model on its training-set rows `rows[client]` (from the
    checkpoints of the last completed round; a client that never took part has its initial private state)."""
    from raysim.actors import broadcast_state, env_spec, initial_private, make_method
    from raysim.store import StateStore

    method = make_method(cfg)
    env = method.build_env(env_spec(cfg, data.classnames), role="client")
    store = StateStore(run_dir)
    last = store.completed_round()
    server = store.load_server(last)
    if server is None:
        raise ConfigError(f"run {run_dir} has no server checkpoint; was it interrupted before its first round?")
    shared = broadcast_state(method, server)
    out = {}
    for cid, idx in rows.items():
        inputs = [torch.as_tensor(a[idx]) for a in (data.x_train, data.tok_train) if a is not None]
        cdata = data.client(cid)
        saved = store.load_client(cid, last)
        private = saved["private"] if saved is not None else initial_private(method, env, cdata, cfg.seed)
        with torch.no_grad():
            out[cid] = method.predictor(env, shared, private, cdata)(*inputs).float().cpu()
    return out


def audit_run(run_dir: str | Path, *, target_clients: Optional[Sequence[int]] = None, seed: int = 0) -> pd.DataFrame:
    """Both attackers on a recorded run: one row per attack with mean_auc, final_auc, the number of
    recorded rounds, targets and candidate pairs, and the run's HM accuracy (a fraction; SPEC 1.12).
    `target_clients`: whose membership is attacked (default: every client; see the module docstring
    for why the pooled design wants several)."""
    import pandas as pd

    from raysim.config import build_config, load_yaml
    from raysim.actors import make_method
    from raysim.engine import prepare_data
    from raysim.metrics import summarize

    run_dir = Path(run_dir).expanduser()
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} holds no config.yaml; pass the out_dir of a run")
    cfg = build_config(load_yaml(run_dir / "config.yaml"))
    updates = recorded_update_features(run_dir)
    data = prepare_data(cfg, make_method(cfg).input, progress=False)
    targets = list(range(data.num_clients)) if target_clients is None else sorted(set(int(t) for t in target_clients))
    bad = [t for t in targets if not 0 <= t < data.num_clients]
    if bad:
        raise ConfigError(f"target clients {bad} do not exist (the run has clients 0..{data.num_clients - 1})")
    pairs = membership_pairs(data.train_idx, targets, seed=seed)
    mine = {t: pairs.target == t for t in targets}
    logits = final_model_logits(run_dir, cfg, data, {t: pairs.sample[m] for t, m in mine.items()})
    query = np.zeros((len(pairs), len(QUERY_FEATURES)))
    for t, m in mine.items():
        query[m] = query_features(logits[t], torch.as_tensor(data.y_train[pairs.sample[m]]))
    hm = summarize(run_dir / "results.csv", last=max(1, cfg.eval_last)).get("hm", math.nan)
    results = [update_mia(updates, pairs, seed=seed), update_mia(updates, pairs, query=query, seed=seed)]
    return pd.DataFrame([
        {"attack": r.attack, "mean_auc": r.mean_auc, "final_auc": r.final_auc, "rounds": len(r.round_aucs),
         "targets": len(targets), "pairs": r.pairs, "hm": hm}
        for r in results
    ])


def markdown(df: pd.DataFrame) -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    for _, row in df.iterrows():
        lines.append("| " + " | ".join(f"{v:.4f}" if isinstance(v, float) else str(v) for v in row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m raysim.attacks.update_mia", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", help="out_dir of a run made with record_uploads=true")
    ap.add_argument("--targets", type=int, nargs="*", default=None, help="target clients (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        df = audit_run(args.run_dir, target_clients=args.targets, seed=args.seed)
    except RaysimError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(markdown(df))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
