"""A method's Step 0 (Method.setup_clients / local_setup / aggregate_setup; FedTSP's description release,
#46): made before round 0 trains, accounted once per releasing client in round 0's ledger (the printed epsilon
is what the accountant computes for that one release), and resumable: a run stopped in round 0 makes it again
from the same streams (the same release, still accounted once), one stopped later does not make it again."""

from __future__ import annotations

import csv
import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

EPS, DELTA = 1.0, 1e-5


def _config(out):
    from raysim.build import build_config
    return build_config({
        "method": "fedtsp", "data": {"dataset": "digits", "partition": "dirichlet", "beta": 0.5, "shots": 4},
        "model": {"name": "raysim-tiny", "pretrained": ""}, "train": {"num_clients": 2, "rounds": 2},
        "eval": {"every": 1, "last": 1}, "execution": {"backend": "inline"}, "dp": {"epsilon": EPS, "delta": DELTA},
        "output": {"out_dir": str(out), "progress": False, "tensorboard": False, "cache_dir": str(out.parent / "c")},
        "fedtsp": {"plm": "clip", "model_family": "tiny", "dp_budget": "paper"},
    })


def _ledger(out, cid: int, upto: int):
    from raysim.privacy.ledger import PrivacyLedger
    from raysim.storage.store import StateStore

    return PrivacyLedger.from_dict(StateStore(out).load_client(cid, upto)["privacy"]["ledger"])


def test_step0_is_released_once_before_round_0_and_a_resume_makes_the_same_release(tmp_path, monkeypatch):
    from raysim.engine.loop import resume_config, run
    from raysim.errors import ClientFailure
    from raysim.methods.fedtsp.fedtsp import FedTSP
    from raysim.privacy.accountant import analytic_gaussian_epsilon, classic_gaussian_multiplier
    from raysim.storage.store import StateStore

    releases: list[torch.Tensor] = []
    seen_text: list[bool] = []
    setup, train = FedTSP.local_setup, FedTSP.local_train

    def local_setup(self, env, shared, private, data, *, rng, privacy):
        res = setup(self, env, shared, private, data, rng=rng, privacy=privacy)
        releases.append(res.upload["text_emb"].clone())  # what the client hands the host (noised in close)
        return res

    def failing(at: int):
        def local_train(self, env, shared, private, data, *, rng, privacy):
            seen_text.append("text_protos" in shared)
            if data.client_id == 1 and int(private.get("rounds", 0)) == at:
                raise RuntimeError(f"killed in round {at}")
            return train(self, env, shared, private, data, rng=rng, privacy=privacy)
        return local_train

    monkeypatch.setattr(FedTSP, "local_setup", local_setup)
    ref = run(_config(tmp_path / "ref"))
    assert len(releases) == 1 and all(seen_text)  # once, and every client's round 0 already had P^T
    out = tmp_path / "run"
    monkeypatch.setattr(FedTSP, "local_train", failing(0))
    with pytest.raises(ClientFailure, match="round 0"):
        run(_config(out))  # Step 0 made, round 0 not completed
    monkeypatch.setattr(FedTSP, "local_train", failing(1))
    with pytest.raises(ClientFailure, match="round 1"):
        run(resume_config(out))  # round 0 again, Step 0 with it (nothing of it was committed)
    monkeypatch.setattr(FedTSP, "local_train", train)
    run(resume_config(out))  # from round 1: no Step 0
    assert len(releases) == 3 and all(torch.equal(r, releases[0]) for r in releases)  # the same clean input each time
    a, b = StateStore(ref.out_dir), StateStore(out)
    for r in range(2):  # the same release reached the server, and the same run followed
        assert torch.equal(a.load_server(r)["text_release"], b.load_server(r)["text_release"])
        assert torch.allclose(a.load_server(r)["text_protos"], b.load_server(r)["text_protos"], atol=1e-6)
    z = classic_gaussian_multiplier(epsilon=EPS, delta=DELTA)
    want = analytic_gaussian_epsilon(z, delta=DELTA)  # Eq. 11's noise, once, as the accountant computes it directly
    for folder in (ref.out_dir, out):
        ledger = _ledger(folder, 0, 1)
        assert [x.mechanism for x in ledger.releases] == ["embedding"] and ledger.releases[0].round == 0
        # the other client releases nothing private (paper: its class means are public): no ledger at all
        assert StateStore(folder).load_client(1, 1)["privacy"]["ledger"] is None
        eps = [float(row["epsilon_max"]) for row in csv.DictReader(open(folder / "results.csv"))]
        assert eps == pytest.approx([want, want], rel=1e-9) and want < EPS
    # round 0's bytes count Step 0's upload: the release (9 x 77 x w float32) and its end positions
    up0 = [int(row["bytes_up"]) for row in csv.DictReader(open(ref.out_dir / "results.csv"))]
    emb = releases[0]
    assert up0[0] - up0[1] == emb.numel() * 4 + emb.shape[0] * 8
    assert math.isfinite(want)
