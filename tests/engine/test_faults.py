"""Actor faults on the Ray backend (DESIGN "Faults"): a client or server actor that dies is replaced by one
that resumes from the last completed round and replays the current one, so every number is unchanged."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_config


def _rounds(cfg, kill=None):
    """The engine's round loop on the config's backend (the fault-free reference runs inline: the engine's
    results are bitwise the same on every backend, tests/engine/test_engine.py, and an inline reference costs
    no actors), on a RayBackend with `kill(backend, round, stage)` between the calls
    (stages "setup" after a Step 0, "trained" and "committed"), and inside train_round after each of its phases has answered on
    every host ("release" and "train" for a release_first method; "train" otherwise).
    Returns what the driver saw and every client's final private state."""
    from raysim.build import make_method
    from raysim.engine.backends import InlineBackend, RayBackend
    from raysim.engine.loop import prepare_data
    from raysim.sampling import participants
    from raysim.storage.store import StateStore

    data = prepare_data(cfg, make_method(cfg).needs(), progress=False)
    b = (RayBackend if cfg.execution.backend == "ray" else InlineBackend)(cfg, data, cfg.output.out_dir, -1)
    if kill:
        phase = b._phase

        def hooked(name, r, *args):
            out = phase(name, r, *args)
            kill(b, r, name)
            return out

        b._phase = hooked
    seen = []
    setup = make_method(cfg).setup_clients()  # a Step 0 before round 0, as the loop runs it
    try:
        for r in range(cfg.train.rounds):
            if r == 0 and setup:
                b.setup(r, sorted(setup))
                if kill:
                    kill(b, r, "setup")
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
    return seen, private, getattr(b, "restarts", 0)


def test_dead_actors_are_replaced_with_identical_results(tmp_path, cache_dir, ray_session):
    opts = dict(execution={"backend": "ray", "num_actors": 2}, train={"rounds": 3, "n_ctx": 4}, method="fedsept", fedsept={"rank": 8},
                **{"dp": {"epsilon": 2.0}})
    inline = {**opts, "execution": {**opts["execution"], "backend": "inline"}}
    ref, ref_private, _ = _rounds(tiny_config(tmp_path / "ref", cache_dir, **inline))

    def kill(b, r, stage):
        if (r, stage) == (0, "committed"):  # between rounds: the next train call finds it dead
            ray_session.kill(b.hosts[0], no_restart=True)
        if (r, stage) == (1, "trained"):  # after training, before evaluation: its round is replayed
            ray_session.kill(b.hosts[1], no_restart=True)
        if (r, stage) == (1, "trained"):  # the server, after aggregating (and writing) round 1: the evaluation and
            ray_session.kill(b.server, no_restart=True)  # round 2's hosts read the broadcast state it left in the
            # object store; round 2's aggregate finds it dead, and a new server, from round 1's state, aggregates

    got, private, restarts = _rounds(tiny_config(tmp_path / "faulty", cache_dir, **opts), kill)
    assert restarts == 3
    assert got == ref
    for c, state in ref_private.items():
        for k, v in state.items():
            want, have = (v, private[c][k]) if isinstance(v, torch.Tensor) else (v["probe"], private[c][k]["probe"])
            assert torch.equal(want, have), (c, k)


def test_restarts_are_bounded(tmp_path, cache_dir, ray_session):
    cfg = tiny_config(tmp_path, cache_dir, execution={"backend": "ray", "num_actors": 2, "max_actor_restarts": 0}, train={"rounds": 2})

    def kill(b, r, stage):
        if stage == "committed":
            ray_session.kill(b.hosts[0], no_restart=True)

    with pytest.raises(RuntimeError, match="max_actor_restarts.*resume="):
        _rounds(cfg, kill)


def _same(a, b) -> bool:
    """Exact equality of nested values (tensors, dicts, lists, tuples, plain values; nan equals nan)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def tiny_vit(tmp_path_factory) -> str:
    """A tiny random HF ViT folder (2 blocks, width 32): fast."""
    from raysim.models.vit_adapter import random_hf_vit

    path = tmp_path_factory.mktemp("vit") / "tiny"
    random_hf_vit(width=32, layers=2, patch_size=8, heads=2, seed=0).vit.save_pretrained(str(path))
    return str(path)


def test_dead_actors_mid_round_of_a_release_first_method_leave_results_unchanged(tmp_path, cache_dir, tiny_vit, ray_session):
    """vpdr_fedproto under VPDR (release, aggregate, then train: SPEC 3.4): a client actor killed between its
    release and its training is replaced, replays the release and trains; one killed after training
    replays both phases before evaluation; a server killed after aggregating is replaced at its next call.
    Every report, server stat, evaluation row and final private state equals the uninterrupted run's."""
    opts = dict(method="vpdr_fedproto", data={"dataset": "digits4", "partition": "domain", "shots": 0},
                train={"num_clients": 4, "rounds": 2, "batch_size": 64, "local_epochs": 1},
                execution={"backend": "ray", "num_actors": 2, "max_actor_restarts": 4}, eval={"protocol": "vpdr"},
                dp={"epsilon": 1.0, "prototypes": "vpp"}, vpdr_fedproto={"dcr": True, "backbone": tiny_vit})
    inline = {**opts, "execution": {**opts["execution"], "backend": "inline"}}
    ref, ref_private, _ = _rounds(tiny_config(tmp_path / "ref", cache_dir, **inline))

    def kill(b, r, stage):
        if (r, stage) == (0, "release"):  # released, not yet trained: the train call finds it dead
            ray_session.kill(b.hosts[0], no_restart=True)
        if (r, stage) == (0, "train"):  # both phases done, before evaluation: the new actor replays both
            ray_session.kill(b.hosts[1], no_restart=True)
        if (r, stage) == (0, "committed"):  # between rounds
            ray_session.kill(b.hosts[0], no_restart=True)
        if (r, stage) == (0, "train"):  # the server, after aggregating round 0's releases: round 1's release is
            ray_session.kill(b.server, no_restart=True)  # sent the broadcast state it left in the object store, and
            # the aggregate of round 1's releases finds it dead: a new server, from round 0's state, aggregates them

    got, private, restarts = _rounds(tiny_config(tmp_path / "faulty", cache_dir, **opts), kill)
    assert restarts == 4  # each kill found and handled
    assert _same(got, ref)  # the VPDR protocol's rows hold nan (no cross-client split), hence not ==
    for c, state in ref_private.items():
        assert _same(state, private[c]), c
