"""Actor faults on the Ray backend (DESIGN "Faults"): a client or server actor that dies is replaced by one
that resumes from the last completed round and replays the current one, so every number is unchanged."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config


def _rounds(cfg, kill=None):
    """The engine's round loop on a RayBackend, with `kill(backend, round, stage)` between the calls.
    Returns what the driver saw and every client's final private state."""
    from raysim.actors import make_method
    from raysim.backends import RayBackend
    from raysim.engine import prepare_data
    from raysim.sampling import participants
    from raysim.store import StateStore

    data = prepare_data(cfg, make_method(cfg).needs(), progress=False)
    b = RayBackend(cfg, data, cfg.output.out_dir, -1)
    seen = []
    try:
        for r in range(cfg.train.rounds):
            reports, stats = b.train_round(r, participants(cfg.train.seed, r, cfg.train.num_clients, cfg.train.participation))
            if kill:
                kill(b, r, "trained")
            rows = b.evaluate()
            b.commit(r)
            if kill:
                kill(b, r, "committed")
            seen.append(([(x.client_id, x.loss, x.bytes_up) for x in reports], stats, rows))
    finally:
        b.shutdown()
    store = StateStore(cfg.output.out_dir)
    private = {c: store.load_client(c, cfg.train.rounds)["private"] for c in range(cfg.train.num_clients)}
    return seen, private, b.restarts


def test_dead_actors_are_replaced_with_identical_results(tmp_path, cache_dir, ray_session):
    opts = dict(backend="ray", num_actors=2, rounds=3, method="fedsept", n_ctx=4, fedsept={"rank": 8}, **{"dp": {"epsilon": 2.0}})
    ref, ref_private, none = _rounds(tiny_config(tmp_path / "ref", cache_dir, **opts))
    assert none == 0

    def kill(b, r, stage):
        if (r, stage) == (0, "committed"):  # between rounds: the next train call finds it dead
            ray_session.kill(b.hosts[0], no_restart=True)
        if (r, stage) == (1, "trained"):  # after training, before evaluation: its round is replayed
            ray_session.kill(b.hosts[1], no_restart=True)
        if (r, stage) == (2, "trained"):  # the server, after aggregating: a new one re-aggregates
            ray_session.kill(b.server, no_restart=True)

    got, private, restarts = _rounds(tiny_config(tmp_path / "faulty", cache_dir, **opts), kill)
    assert restarts == 3
    assert got == ref
    for c, state in ref_private.items():
        for k, v in state.items():
            want, have = (v, private[c][k]) if isinstance(v, torch.Tensor) else (v["probe"], private[c][k]["probe"])
            assert torch.equal(want, have), (c, k)


def test_restarts_are_bounded(tmp_path, cache_dir, ray_session):
    cfg = tiny_config(tmp_path, cache_dir, backend="ray", num_actors=2, rounds=2, max_actor_restarts=0)

    def kill(b, r, stage):
        if stage == "committed":
            ray_session.kill(b.hosts[0], no_restart=True)

    with pytest.raises(RuntimeError, match="max_actor_restarts.*resume="):
        _rounds(cfg, kill)
