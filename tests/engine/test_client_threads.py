"""A host's clients trained at once on threads (execution.client_threads, raysim/engine/client_round.py
`ClientRound.run_concurrently`) for the methods whose clients' steps are independent (the zoo methods,
Method.independent_clients).

What makes bitwise equality the right test here: each client's step computes exactly the same thing on a
worker thread as client by client (the same inputs, the same per-(round, client) stream, one torch
intra-op thread either way, and torch's global RNG drawn only under its seed and lock), the host settles
the results in client-id order and the server aggregates them in client-id order. So it is the same
computation on two schedules, and every tensor must come out bit for bit the same; any sharing between
clients' steps (a module cached per host, a draw from the global RNG) shows up as a difference."""

from __future__ import annotations

import csv
import threading
import time

import pytest
import torch

CLIENTS, ROUNDS = 4, 3


def zoo_run(tmp_path, tag, method="fedproto", section=None, *, dp=0.0, participation=1.0, **execution):
    """A short zoo run on digits (4 clients, 3 rounds, the tiny family: a CNN and a ResNet-4 with BatchNorm),
    inline unless `execution` says otherwise: results.csv without the wall clock, the last shared tensors,
    and every client's last checkpoint (private state and privacy state)."""
    from raysim.build import build_config
    from raysim.engine.loop import run
    from raysim.storage.store import StateStore

    values = {
        "method": method,
        "data": {"dataset": "digits", "partition": "dirichlet", "beta": 0.5, "shots": 16},
        "model": {"name": "raysim-tiny", "pretrained": ""},
        "train": {"num_clients": CLIENTS, "rounds": ROUNDS, "batch_size": 32, "participation": participation},
        "eval": {"every": 100, "last": 1},
        "execution": {"backend": "inline", **execution},
        "output": {"progress": False, "tensorboard": False, "cache_dir": str(tmp_path / "c"), "out_dir": str(tmp_path / tag)},
        method: {"model_family": "tiny", **(section or {})},
    }
    if dp:
        values["dp"] = {"epsilon": dp}
    out = run(build_config(values)).out_dir
    with open(out / "results.csv") as f:
        rows = [{k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(f)]
    with open(out / "client_results.csv") as f:
        client_rows = [{k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(f)]
    store = StateStore(out)
    return rows, client_rows, store.load_server(ROUNDS - 1), {c: store.load_client(c, ROUNDS - 1) for c in range(CLIENTS)}


def tensors(tree, prefix=""):
    """{dotted path: tensor} of a nested dict of tensors."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in tensors(sub, f"{prefix}.{key}" if prefix else str(key)).items()}
    return {}


def assert_bitwise(a, b, tag):
    rows_a, crows_a, server_a, clients_a = a
    rows_b, crows_b, server_b, clients_b = b
    assert rows_a == rows_b, tag  # every column as written, to the last digit
    assert crows_a == crows_b, tag
    assert server_a.keys() == server_b.keys()
    for k in server_a:
        assert torch.equal(server_a[k], server_b[k]), (tag, k)
    for c in clients_a:
        assert (clients_a[c] is None) == (clients_b[c] is None), (tag, c)
        if clients_a[c] is None:
            continue
        assert clients_a[c]["privacy"] == clients_b[c]["privacy"], (tag, c)  # calibration and ledger
        ta, tb = tensors(clients_a[c]["private"]), tensors(clients_b[c]["private"])
        assert ta and ta.keys() == tb.keys(), (tag, c)
        for k in ta:
            assert torch.equal(ta[k], tb[k]), (tag, c, k)


class Overlap:
    """Wraps a method's local_train: counts how many clients' steps run at once, and on which threads."""

    def __init__(self, monkeypatch, cls, pause: float = 0.05) -> None:
        self.lock, self.now, self.most, self.threads = threading.Lock(), 0, 0, set()
        inner = cls.local_train

        def local_train(method, *args, **kwargs):
            with self.lock:
                self.now += 1
                self.most = max(self.most, self.now)
                self.threads.add(threading.current_thread().name)
            try:
                time.sleep(pause)  # a window in which another client's step may start
                return inner(method, *args, **kwargs)
            finally:
                with self.lock:
                    self.now -= 1

        monkeypatch.setattr(cls, "local_train", local_train)


def test_fedproto_on_two_threads_is_bitwise_the_same_as_client_by_client(tmp_path, monkeypatch):
    from raysim.methods.fedtsp.fedproto import FedProto

    ref = zoo_run(tmp_path, "one", client_threads=1)
    seen = Overlap(monkeypatch, FedProto)
    got = zoo_run(tmp_path, "two", client_threads=2)
    assert seen.most == 2 and all(t.startswith("raysim-client") for t in seen.threads), (seen.most, seen.threads)
    assert_bitwise(ref, got, "fedproto, 2 threads")


def test_fedtgp_with_its_server_generator_and_dp_prototypes_is_bitwise_the_same_on_three_threads(tmp_path):
    """FedTGP: server-side state (the prototype generator, trained at aggregation) and, at dp.epsilon=4, each
    client's prototype release noised from its own stream and charged to its own ledger; participation 3/4."""
    ref = zoo_run(tmp_path, "one", "fedtgp", {"server_epochs": 2}, dp=4.0, participation=0.75, client_threads=1)
    got = zoo_run(tmp_path, "three", "fedtgp", {"server_epochs": 2}, dp=4.0, participation=0.75, client_threads=3)
    assert_bitwise(ref, got, "fedtgp, 3 threads")


def test_a_dropped_client_on_threads_is_dropped_as_client_by_client(tmp_path, monkeypatch):
    """on_client_error=drop: client 1 raises in round 1; the others are settled in id order around it and
    its state and ledger stay as before the round, on 1 thread and on 2 alike."""
    from raysim.methods.fedtsp.fedproto import FedProto

    inner = FedProto.local_train

    def local_train(method, env, shared, private, data, *, rng, privacy):
        if data.client_id == 1 and bool(shared["has"].any()) and not getattr(local_train, "done", False):
            local_train.done = True  # once: round 1 (the first round with global prototypes)
            raise RuntimeError("client 1 fails")
        return inner(method, env, shared, private, data, rng=rng, privacy=privacy)

    monkeypatch.setattr(FedProto, "local_train", local_train)
    ref = zoo_run(tmp_path, "one", client_threads=1, on_client_error="drop", dp=4.0)
    local_train.done = False
    got = zoo_run(tmp_path, "two", client_threads=2, on_client_error="drop", dp=4.0)
    assert local_train.done
    assert [r["dropped"] for r in ref[0]] == ["0", "1", "0"], ref[0]  # the failure happened, in round 1
    assert_bitwise(ref, got, "fedproto, drop, 2 threads")


def test_methods_with_shared_modules_or_dropout_train_client_by_client():
    """Only methods whose clients' steps share nothing run on threads: FedGen (one generator module per host),
    the shared-small-model methods (one shared module per host), the homogeneous ones (one global module per
    host) and any family with dropout (masks from torch's global RNG) stay client by client."""
    from raysim.build import build_config, make_method
    def independent(method, section=None):
        return make_method(build_config({"method": method, "data": {"dataset": "digits"}, method: section or {}})).independent_clients()

    assert independent("fedproto") and independent("fedtgp") and independent("fedtsp") and independent("lgfedavg")
    assert independent("fedproto", {"model_family": "HtFE2"})
    assert not independent("fedproto", {"model_family": "HtFE4"})  # GoogLeNet's dropout
    assert not independent("fedproto", {"model_family": "HtFE-img-5"})  # HtFLlib's MobileNetV2's dropout
    assert independent("fedpcl") and not independent("fedpcl", {"model": "googlenet"})  # one `model` for all (no family)
    for m in ("fedgen", "fml", "fedkd", "fedmrl", "fedavg", "promptfl"):
        assert not independent(m), m


@pytest.mark.parametrize("arch", ["fedavgcnn", "resnet18", "cnn_tiny", "resnet4", "googlenet", "htfllib_mobilenet_v2",
                                  "mobilenet_v2", "tv_resnet18"])
def test_dropout_archs_lists_exactly_the_models_with_dropout(arch):
    from raysim.models.zoo import DROPOUT_ARCHS, make_client_model

    model = make_client_model(arch, 16, 10, seed=1)
    has = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    assert has == (arch in DROPOUT_ARCHS), arch


def test_seeded_builds_on_threads_get_their_own_seeds_init():
    """Models built at once on threads (a host's clients' first round) get the init of their own seed, while
    other threads draw from the global RNG (without raysim.sampling's lock this fails most times)."""
    SEEDS = 64
    from raysim.models.zoo import make_client_model
    from raysim.sampling import seeded_global_rng

    def build(seed):
        return torch.cat([p.detach().flatten() for p in make_client_model("cnn_tiny", 16, 10, seed=seed).parameters()])

    want = {s: build(s) for s in range(SEEDS)}
    got, errors = {}, []

    def worker(seeds):
        try:
            for s in seeds:
                got[s] = build(s)
                with seeded_global_rng(99):
                    torch.randn(1000)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(range(i, SEEDS, 4),)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got.keys() == want.keys()
    for s in want:
        assert torch.equal(got[s], want[s]), s


def test_client_threads_must_be_at_least_zero():
    from raysim.build import build_config
    from raysim.errors import ConfigError

    with pytest.raises(ConfigError, match="client_threads .* must be >= 0"):
        build_config({"method": "fedproto", "data": {"dataset": "digits"}, "execution": {"client_threads": -1}})


def test_the_default_is_as_many_threads_as_the_host_has_cpus():
    from raysim.config.schema import ExecutionConfig
    from raysim.engine.hosts import available_cores, host_client_threads

    assert host_client_threads(ExecutionConfig(backend="inline")) == available_cores()
    assert host_client_threads(ExecutionConfig(backend="ray", client_cpus=2.0)) == 2
    assert host_client_threads(ExecutionConfig(backend="ray", client_cpus=0.25)) == 1
    assert host_client_threads(ExecutionConfig(backend="inline", client_threads=3)) == 3


def test_inline_threads_and_ray_actors_are_bitwise_the_same(tmp_path, ray_session):
    """Inline on 2 threads, on Ray with 2 actors (one client thread each: client_cpus 1), and on Ray with 1
    actor of 2 threads (client_cpus 1 and client_threads 2: the threads compose with the actors)."""
    ref = zoo_run(tmp_path, "inline", "fedtgp", dp=4.0, client_threads=2)
    assert_bitwise(ref, zoo_run(tmp_path, "ray2", "fedtgp", dp=4.0, backend="ray", num_actors=2), "ray, 2 actors")
    assert_bitwise(ref, zoo_run(tmp_path, "ray1", "fedtgp", dp=4.0, backend="ray", num_actors=1, client_threads=2),
                   "ray, 1 actor x 2 threads")


@pytest.mark.parametrize("method", ["fedtsp", "fedgh", "lgfedavg", "feddistill", "fedpcl", "alignfed", "local"])
def test_every_other_independent_zoo_method_is_bitwise_the_same_on_two_threads(tmp_path, method):
    from raysim.build import build_config, make_method
    assert make_method(build_config({"method": method, "data": {"dataset": "digits"}})).independent_clients()
    section = {"anchor_iters": 200} if method == "alignfed" else {}  # the server's anchors: 100,000 steps by default
    assert_bitwise(zoo_run(tmp_path, "one", method, section, client_threads=1),
                   zoo_run(tmp_path, "two", method, section, client_threads=2), f"{method}, 2 threads")
