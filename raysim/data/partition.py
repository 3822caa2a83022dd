"""Split a dataset over clients: pathological, Dirichlet label skew, domain + Dirichlet, IID, PFLlib's
protocol; few-shot caps.

Each partitioner returns one `ClientSplit` per client: indices into the train set and into the test
set. Train indices are disjoint across clients and so are test indices. A partitioner registered with
`register_pooled` (pfllib) splits the merged pool instead, train rows then test rows
(`pooled_labels(spec)`): its train and test indices both point into that pool, and the engine hands
the methods the pool as both the train and the test array (`is_pooled`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from raysim.errors import ConfigError
from raysim.registry import Registry

log = logging.getLogger(__name__)


@dataclass
class ClientSplit:
    train: np.ndarray
    test: np.ndarray


@dataclass
class PartitionSpec:
    train_labels: np.ndarray
    test_labels: np.ndarray
    num_clients: int
    seed: int
    beta: float = 0.5
    shots: int = 0  # per (client, class) cap on training images; 0 = no cap
    min_samples: int = 0  # 0 = the partition's own default (dirichlet 10, pfllib 40)
    train_domains: Optional[np.ndarray] = None
    test_domains: Optional[np.ndarray] = None
    domain_reseed: bool = False  # partition=domain: the FedSEPT code's numpy re-seeding before every class (`domain`)

    @property
    def num_classes(self) -> int:
        return int(max(self.train_labels.max(), self.test_labels.max())) + 1


Partitioner = Callable[[PartitionSpec], list[ClientSplit]]
PARTITIONERS: Registry[Partitioner] = Registry("partition")

DIRICHLET_MIN_SAMPLES = 10  # dirichlet's default data.min_samples (train and test samples per client)
POOLED: set[str] = set()  # partitions whose indices point into the merged train + test pool


def register_pooled(name: str) -> Callable[[Partitioner], Partitioner]:
    """Register a partitioner of the merged pool (train rows, then test rows)."""
    def deco(fn: Partitioner) -> Partitioner:
        POOLED.add(name.lower())
        return PARTITIONERS.register(name)(fn)

    return deco


def is_pooled(kind: str) -> bool:
    """Whether partition `kind` splits the merged train + test pool (its indices point into the pool)."""
    return str(kind).lower() in POOLED


def pooled_labels(spec: PartitionSpec) -> np.ndarray:
    """The labels of the merged pool: the official train set's rows, then the test set's."""
    return np.concatenate([spec.train_labels, spec.test_labels])


DIRICHLET_MAX_DRAWS = 1000  # the Dirichlet partitions redraw at most this often...
DIRICHLET_MAX_SECONDS = 30.0  # ...and for at most this long, then explain why no draw fits


def min_per_client(kind: str, spec: PartitionSpec) -> int:
    """The fewest train (and test) samples partition `kind` gives each client (the pooled pfllib: of its pool)."""
    kind = str(kind).lower()
    if kind == "dirichlet":
        return spec.min_samples or DIRICHLET_MIN_SAMPLES
    if is_pooled(kind):
        return 2  # one train and one test sample after the 75 / 25 split
    return 1


def check_feasible(kind: str, spec: PartitionSpec) -> None:
    """Refuse, before any partition is drawn, more clients than the splits can give `min_per_client` samples each."""
    K, m = int(spec.num_clients), min_per_client(kind, spec)
    if is_pooled(kind):
        sizes = {"pooled train + test": len(spec.train_labels) + len(spec.test_labels)}
    else:
        sizes = {"training": len(spec.train_labels), "test": len(spec.test_labels)}
    largest = min(sizes.values()) // m
    if K > largest:
        what = ", ".join(f"{n:,} {name}" for name, n in sizes.items())
        need = f"{m} samples" if m > 1 else "one sample"
        raise ConfigError(
            f"train.num_clients={K:,} is more than data.partition={kind} can give {need} of each split (the dataset has "
            f"{what} samples); the largest valid value is train.num_clients={largest:,}"
            + (" (or lower data.min_samples)" if kind == "dirichlet" else "")
        )


# Partitions whose per-client index order is part of the protocol, kept as drawn (every other partition's
# indices are sorted). pfllib: PFLlib writes each client's train / test rows in the order its procedure
# leaves them (class by class, each class shuffled, then train_test_split's shuffle) and its loaders read
# them unshuffled (DataLoader(shuffle=False)), so sorting would give class-clustered batches on a
# class-sorted dataset (Tiny-ImageNet) where PFLlib's are mixed.
KEEPS_ORDER = frozenset({"pfllib"})


def partition(kind: str, spec: PartitionSpec) -> list[ClientSplit]:
    check_feasible(kind, spec)
    splits = PARTITIONERS.get(kind)(spec)
    if spec.shots > 0:
        splits = few_shot(splits, pooled_labels(spec) if is_pooled(kind) else spec.train_labels, spec.shots, spec.seed)
    if str(kind).lower() in KEEPS_ORDER:  # the partition's own per-client order is the data order its loaders see
        out = [ClientSplit(np.asarray(s.train, np.int64), np.asarray(s.test, np.int64)) for s in splits]
    else:  # the others give sets: each client's rows in the dataset's order
        out = [ClientSplit(np.sort(s.train).astype(np.int64), np.sort(s.test).astype(np.int64)) for s in splits]
    no_train = sum(1 for s in out if len(s.train) == 0)
    no_test = sum(1 for s in out if len(s.test) == 0)
    if no_train or no_test:
        raise ConfigError(
            f"data.partition={kind} with train.num_clients={spec.num_clients:,} leaves {no_train} client(s) with no training "
            f"sample and {no_test} with no test sample; lower train.num_clients"
            + (", raise data.beta" if kind in ("dirichlet", "domain", "pfllib") else "") + " or pick another data.partition"
        )
    return out


def few_shot(splits: list[ClientSplit], labels: np.ndarray, shots: int, seed: int) -> list[ClientSplit]:
    """Keep at most `shots` random training images of each class on each client."""
    rng = np.random.default_rng([seed, 7])
    out = []
    for s in splits:
        keep = []
        for c in np.unique(labels[s.train]):
            idx = s.train[labels[s.train] == c]
            keep.append(idx if len(idx) <= shots else rng.choice(idx, size=shots, replace=False))
        out.append(ClientSplit(np.concatenate(keep) if keep else s.train[:0], s.test))
    return out


def pathological_class_counts(num_classes: int, num_clients: int) -> tuple[list[int], bool]:
    """How many classes each client owns under partition=pathological, and whether that is SPEC 1.9's rule.

    SPEC 1.9 (the official code): clients 0..K-2 take round(C/K) classes each and the last client the
    remainder (Pets, C=37, K=10: nine clients with 4 and one with 1). That rule is kept wherever it
    leaves the last client at least one class. Where it does not (C=10, K=6: 5 x round(10/6) = 10 leaves
    nothing), the classes are spread as evenly as possible instead: C // K each, and the first C % K
    clients one more (C=10, K=6: 2, 2, 2, 2, 1, 1). Any 1 <= K <= C works."""
    C, K = int(num_classes), int(num_clients)
    if not 1 <= K <= C:
        raise ConfigError(
            f"partition=pathological gives every client its own classes, so it needs at least one class per "
            f"client; {C} classes cannot be split over {K} clients (lower num_clients to at most {C}, "
            f"or use data.partition=dirichlet)."
        )
    per = max(1, int(round(C / K)))
    if per * (K - 1) < C:
        return [per] * (K - 1) + [C - per * (K - 1)], True
    return [C // K + (1 if k < C % K else 0) for k in range(K)], False


@PARTITIONERS.register("pathological")
def pathological(spec: PartitionSpec) -> list[ClientSplit]:
    """Disjoint class sets: shuffle the classes, client k takes the next contiguous slice of
    `pathological_class_counts(C, K)` classes (SPEC 1.9's round(C/K) with the remainder on the last
    client where that works, an even spread otherwise); each client tests on all test images of its classes."""
    C, K = spec.num_classes, spec.num_clients
    counts, spec_rule = pathological_class_counts(C, K)
    if not spec_rule:
        log.warning(
            "partition=pathological: SPEC 1.9's rule (round(%d/%d) = %d classes per client, the remainder on the last) "
            "would leave the last client no class; spreading the %d classes evenly instead: %s",
            C, K, max(1, int(round(C / K))), C, counts,
        )
    order = np.random.default_rng([spec.seed, 1]).permutation(C)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    out = []
    for k in range(K):
        owned = order[bounds[k] : bounds[k + 1]]
        out.append(
            ClientSplit(
                np.flatnonzero(np.isin(spec.train_labels, owned)),
                np.flatnonzero(np.isin(spec.test_labels, owned)),
            )
        )
    return out


def _cut_classes(train_idx_by_class: list[np.ndarray], test_idx_by_class: list[np.ndarray], num_clients: int,
                 draw: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]) -> list[ClientSplit]:
    """One pass over the classes (SPEC 1.9, noniid-labeldir): `draw` gives the class's shuffled train and test
    indices and its proportions p; clients holding N / K training samples already are zeroed out of p, and both
    splits of the class are cut by p's cumulative sums."""
    n_train = sum(len(i) for i in train_idx_by_class)
    tr: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    te: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    counts = np.zeros(num_clients)
    for tr_c, te_c in zip(train_idx_by_class, test_idx_by_class):
        tr_c, te_c, p = draw(tr_c, te_c)
        p = p * (counts < n_train / num_clients)
        p = p / p.sum() if p.sum() > 0 else np.full(num_clients, 1.0 / num_clients)
        for src, dst in ((tr_c, tr), (te_c, te)):
            cuts = (np.cumsum(p) * len(src)).astype(int)[:-1]
            for k, part in enumerate(np.split(src, cuts)):
                dst[k].append(part)
        counts += np.array([len(x[-1]) for x in tr])
    return [ClientSplit(np.concatenate(a) if a else np.zeros(0, np.int64), np.concatenate(b) if b else np.zeros(0, np.int64))
            for a, b in zip(tr, te)]


def _dirichlet_split(
    train_idx_by_class: list[np.ndarray],
    test_idx_by_class: list[np.ndarray],
    num_clients: int,
    beta: float,
    min_samples: int,
    rng: np.random.Generator,
    what: str,
) -> list[ClientSplit]:
    """Per class, p ~ Dir(beta); clients already over N/K get no more (SPEC 1.9, noniid-labeldir);
    train and test indices of the class are split with the same p. Redraw until every client has
    `min_samples` train and test samples."""
    start, draws, best = time.monotonic(), 0, -1
    while draws < DIRICHLET_MAX_DRAWS and (draws == 0 or time.monotonic() - start < DIRICHLET_MAX_SECONDS):
        draws += 1
        splits = _cut_classes(train_idx_by_class, test_idx_by_class, num_clients,
                              lambda tr_c, te_c: (rng.permutation(tr_c), rng.permutation(te_c),
                                                  rng.dirichlet(np.full(num_clients, beta))))
        fewest = min(min(len(s.train), len(s.test)) for s in splits)
        if fewest >= min_samples:
            return splits
        best = max(best, fewest)
    raise ConfigError(
        f"data.partition={what} could not give each of {num_clients:,} clients {min_samples} train and test samples in "
        f"{draws} Dirichlet draws ({time.monotonic() - start:.1f} s; at most {DIRICHLET_MAX_DRAWS} draws or "
        f"{DIRICHLET_MAX_SECONDS:.0f} s): the best draw left a client {best} sample(s), since a small data.beta gives some "
        "clients almost none of every class. Raise data.beta, lower train.num_clients, or lower data.min_samples."
    )


@PARTITIONERS.register("dirichlet")
def dirichlet(spec: PartitionSpec) -> list[ClientSplit]:
    C = spec.num_classes
    rng = np.random.default_rng([spec.seed, 2])
    return _dirichlet_split(
        [np.flatnonzero(spec.train_labels == c) for c in range(C)],
        [np.flatnonzero(spec.test_labels == c) for c in range(C)],
        spec.num_clients,
        spec.beta,
        spec.min_samples or DIRICHLET_MIN_SAMPLES,
        rng,
        "dirichlet",
    )


@PARTITIONERS.register("domain")
def domain(spec: PartitionSpec) -> list[ClientSplit]:
    """Domain + label skew: clients are split evenly over the domains (client k in domain k // (K / D)), and each
    domain's data is split over its clients with a Dirichlet(`data.beta`) label skew (SPEC 1.9): per class,
    p ~ Dir(beta), clients already holding N_d / K_d training samples get no more, and the class's train and test
    indices are cut with the same p; redrawn until every client has 2 train and 2 test samples.

    `data.domain_reseed=true` is the FedSEPT code's split (`utils/domain_skew.py`, SPEC 1.9 item 9): numpy is
    re-seeded to 0 before each class's shuffle and again before its Dirichlet draw, so every class of a domain
    draws the *same* p = Dir(beta) under seed 0 (and `train.seed` does not change the split). Until a client is full
    each class is cut in the same proportions; after, the full clients get nothing, so a small beta gives one client
    a contiguous range of classes and the other the rest. A redraw would repeat the same split, so a domain that
    leaves a client under 2 samples is refused (the code loops forever there). Default false: a fresh draw per
    class from the run's seed."""
    if spec.train_domains is None or spec.test_domains is None:
        raise ConfigError(
            "partition=domain needs a dataset with domains (synthetic, pacs, office31, officehome, domainnet, office_caltech10)"
        )
    domains = np.unique(spec.train_domains)
    D, K = len(domains), spec.num_clients
    if K % D != 0:
        raise ConfigError(f"partition=domain needs num_clients to be a multiple of the {D} domains; got {K}")
    per = K // D
    rng = np.random.default_rng([spec.seed, 3])
    out: list[ClientSplit] = []
    C = spec.num_classes
    least = min(spec.min_samples or DIRICHLET_MIN_SAMPLES, 2)
    for d in domains:
        tr_d = spec.train_domains == d
        te_d = spec.test_domains == d
        by_class = ([np.flatnonzero(tr_d & (spec.train_labels == c)) for c in range(C)],
                    [np.flatnonzero(te_d & (spec.test_labels == c)) for c in range(C)])
        if spec.domain_reseed:
            out += _reseeded_split(*by_class, per, spec.beta, least, f"domain {d}")
        else:
            out += _dirichlet_split(*by_class, per, spec.beta, least, rng, "domain")
    return out


def _reseeded_split(train_idx_by_class: list[np.ndarray], test_idx_by_class: list[np.ndarray], num_clients: int,
                    beta: float, min_samples: int, what: str) -> list[ClientSplit]:
    """The FedSEPT code's per-domain Dirichlet split (`Dataset_partition_domain`): for every class, numpy's legacy
    generator re-seeded to 0 shuffles its train then its test indices, and re-seeded to 0 again draws
    p ~ Dir(beta 1_K), so every class draws the same p; clients holding N / K training samples already are zeroed
    out of p, and both splits of the class are cut by p's cumulative sums."""
    def draw(tr_c: np.ndarray, te_c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tr_c, te_c = tr_c.copy(), te_c.copy()
        shuffle = np.random.RandomState(0)  # np.random.seed(0); np.random.shuffle(train); np.random.shuffle(test)
        shuffle.shuffle(tr_c)
        shuffle.shuffle(te_c)
        return tr_c, te_c, np.random.RandomState(0).dirichlet(np.repeat(beta, num_clients))  # seed(0) again: the same p

    splits = _cut_classes(train_idx_by_class, test_idx_by_class, num_clients, draw)
    fewest = min(min(len(s.train), len(s.test)) for s in splits)
    if fewest < min_samples:
        raise ConfigError(
            f"data.domain_reseed=true: {what}'s split leaves a client {fewest} train or test sample(s), under {min_samples}; "
            "the re-seeded draw is the same every time, so it cannot be redrawn: raise data.beta, or set data.domain_reseed=false"
        )
    return splits


@PARTITIONERS.register("iid")
def iid(spec: PartitionSpec) -> list[ClientSplit]:
    rng = np.random.default_rng([spec.seed, 4])
    tr = np.array_split(rng.permutation(len(spec.train_labels)), spec.num_clients)
    te = np.array_split(rng.permutation(len(spec.test_labels)), spec.num_clients)
    return [ClientSplit(a, b) for a, b in zip(tr, te)]


# ------------------------------------------------------------------------------------ PFLlib's protocol
PFLLIB_TRAIN_SHARE = 0.75  # PFLlib's train_ratio: each client's pool is split 75 / 25 into train / test
PFLLIB_MIN_SAMPLES = 40  # PFLlib's least_samples: batch_size 10 / (1 - train_ratio), so every client tests on a batch


def pfllib_min_samples(spec: PartitionSpec) -> int:
    """PFLlib's least_samples = int(min(40, N / K / 2)); data.min_samples > 0 replaces the 40."""
    n = len(spec.train_labels) + len(spec.test_labels)
    return int(min(spec.min_samples or PFLLIB_MIN_SAMPLES, n / spec.num_clients / 2))


def pfllib_dirichlet(labels: np.ndarray, num_clients: int, beta: float, least: int, rng: np.random.Generator,
                     max_draws: int = 1000) -> list[np.ndarray]:
    """PFLlib's "dir" partition (dataset_utils.separate_data) of pool indices: per class, shuffle its
    indices and draw p ~ Dir(beta 1_K); clients already holding N/K samples or more get none of it
    (p_k zeroed, p renormalised); the class is cut at cumsum(p) * n_c. Redrawn until every client holds at
    least `least` samples."""
    N, K = len(labels), int(num_clients)
    classes = np.unique(labels)
    start = time.monotonic()
    for draw in range(max_draws):
        if draw and time.monotonic() - start > DIRICHLET_MAX_SECONDS:
            break
        parts: list[list[np.ndarray]] = [[] for _ in range(K)]
        sizes = np.zeros(K, dtype=np.int64)
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            p = rng.dirichlet(np.full(K, beta))
            p = p * (sizes < N / K)
            p = p / p.sum() if p.sum() > 0 else np.full(K, 1.0 / K)
            cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
            for k, part in enumerate(np.split(idx, cuts)):
                parts[k].append(part)
                sizes[k] += len(part)
        if sizes.min() >= least:
            return [np.concatenate(p) for p in parts]
    raise ConfigError(
        f"partition=pfllib could not give every client {least} samples in {max_draws} Dirichlet draws (or "
        f"{DIRICHLET_MAX_SECONDS:.0f} s); "
        "raise data.beta, lower train.num_clients, or lower data.min_samples."
    )


@register_pooled("pfllib")
def pfllib(spec: PartitionSpec) -> list[ClientSplit]:
    """PFLlib's data protocol (SPEC 2.6, used by fedtsp.txt): merge the official train and test sets, split
    the pool over the clients with `pfllib_dirichlet` (alpha = data.beta, at least `pfllib_min_samples`
    per client), then split each client's samples as sklearn's train_test_split(train_size=0.75,
    shuffle=True) does for PFLlib's split_data: a permutation p of the client's n rows, test = p[:n - t],
    train = p[n - t:], t = floor(0.75 n), both in that order. The per-client order is kept (KEEPS_ORDER):
    it is the order PFLlib's files hold and its unshuffled loaders read. The same procedure as PFLlib, not
    PFLlib's random draws (it seeds numpy's global generator; here the stream is the run's seed)."""
    labels = pooled_labels(spec)
    rng = np.random.default_rng([spec.seed, 5])
    out = []
    for idx in pfllib_dirichlet(labels, spec.num_clients, spec.beta, pfllib_min_samples(spec), rng):
        n_train = int(np.floor(PFLLIB_TRAIN_SHARE * len(idx)))
        perm = rng.permutation(len(idx))
        n_test = len(idx) - n_train
        out.append(ClientSplit(idx[perm[n_test:]], idx[perm[:n_test]]))
    return out
