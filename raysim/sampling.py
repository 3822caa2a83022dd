"""Who takes part in each round, and the random streams each (round, client) gets.

Everything here is a pure function of the run seed, so the same seed gives the same clients, the
same batches and the same noise whatever the backend, the number of actors, or a resume.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from typing import Iterator

import numpy as np
import torch


def participants(seed: int, round_idx: int, num_clients: int, participation: float) -> list[int]:
    """Clients of a round: all of them at participation 1, else floor(frac*K) drawn without
    replacement by numpy.default_rng(seed + round), sorted (the official FedSEPT code's rule)."""
    if participation >= 1.0:
        return list(range(num_clients))
    m = max(1, int(np.floor(participation * num_clients)))
    rng = np.random.default_rng(seed + round_idx)
    return sorted(int(c) for c in rng.choice(num_clients, size=m, replace=False))


def eval_clients(seed: int, num_clients: int, n: int) -> list[int]:
    """The clients evaluated in every evaluated round: all of them for n = 0 or n >= num_clients, else n
    drawn once without replacement from the run seed's own "eval-clients" stream, sorted. The same sample
    every round, whatever the backend, the number of hosts or a resume."""
    if n <= 0 or n >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng(stream_seed(seed, "eval-clients"))
    return sorted(int(c) for c in rng.choice(num_clients, size=n, replace=False))


def schedule(seed: int, rounds: int, num_clients: int, participation: float) -> list[list[int]]:
    return [participants(seed, r, num_clients, participation) for r in range(rounds)]


def _stream_key(*parts: object) -> list[int]:
    h = hashlib.sha256(repr(parts).encode()).digest()
    return [int.from_bytes(h[i : i + 4], "little") for i in range(0, 16, 4)]


def stream_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed for the named stream, e.g. stream_seed(seed, "train", round, client)."""
    ss = np.random.SeedSequence([seed, *_stream_key(*parts)])
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def generator(seed: int, *parts: object) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(stream_seed(seed, *parts))
    return g


# torch's global CPU generator is one per process: a host that trains its clients on several threads
# (execution.client_threads, raysim/engine/client_round.py) would interleave their draws from it. Every
# seeded draw of it in raysim (a module's init as a function of a seed) holds this lock, so two clients'
# models built at once each get exactly the init of their own seed.
GLOBAL_RNG_LOCK = threading.RLock()


@contextlib.contextmanager
def seeded_global_rng(seed: int) -> Iterator[None]:
    """torch's global CPU RNG seeded with `seed` for the block (e.g. an nn.Module's default init as a function
    of `seed`), and put back as it was after; held under GLOBAL_RNG_LOCK, so a concurrent client's block
    on another thread neither sees nor moves this one's stream."""
    with GLOBAL_RNG_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def batches_per_epoch(n: int, batch_size: int) -> int:
    """Batches in one local epoch: drop_last when n >= B (the official loaders), else one batch."""
    return n // batch_size if n >= batch_size else 1


def epoch_batches(n: int, batch_size: int, rng: torch.Generator, *, shuffle: bool = True) -> list[torch.Tensor]:
    """One epoch's mini-batches: shuffled by `rng`, or in the data's own order (the official FedTSP
    loaders); drop_last when n >= B either way."""
    if shuffle:
        return list(batch_indices(n, batch_size, rng))
    return [torch.arange(i * batch_size, min(n, (i + 1) * batch_size)) for i in range(batches_per_epoch(n, batch_size))]


def batch_indices(n: int, batch_size: int, rng: torch.Generator) -> Iterator[torch.Tensor]:
    """Shuffled mini-batches of one epoch, drop_last when n >= B."""
    perm = torch.randperm(n, generator=rng)
    if n < batch_size:
        yield perm
        return
    for i in range(batches_per_epoch(n, batch_size)):
        yield perm[i * batch_size : (i + 1) * batch_size]


def poisson_batches(n: int, batch_size: int, rng: torch.Generator, steps: int) -> Iterator[torch.Tensor]:
    """`steps` Poisson-sampled batches: every example joins each batch independently with probability
    q = min(1, B/n), so batch sizes vary (Binomial(n, q)) and may be empty; this is the sampling the
    subsampled-Gaussian accountants assume."""
    q = min(1.0, batch_size / max(1, n))
    for _ in range(steps):
        if q >= 1.0:
            yield torch.arange(n)
            continue
        yield (torch.rand(n, generator=rng) < q).nonzero().squeeze(1)
