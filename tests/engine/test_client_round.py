"""raysim/engine/client_round.py on its own (no Ray, no model): the policy table. Under fail a failed client
stops the host and the driver's check raises naming it; under drop it is left out with what the round changed
of it put back, and the run stops when fewer than min_clients remain; a raise, a non-finite upload and a step
past client_timeout are each a failure; an ok client's upload is closed, its state kept; privacy errors are
never a client's failure."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from raysim.engine.client_round import ClientPolicy, ClientReport, ClientRound, attempt, judge, merge_phases, non_finite
from raysim.errors import ClientFailure, UploadViolation

FAIL, DROP = ClientPolicy(on_error="fail"), ClientPolicy(on_error="drop")


def result(value: float = 1.0, **private):
    return SimpleNamespace(upload={"ctx": torch.full((2, 3), value)}, private=dict(private), num_samples=10,
                           metrics={"loss": 0.5})


class Handle:
    """A privacy handle: `close` passes the upload through and charges the client's ledger."""

    def __init__(self, host, cid):
        self.host, self.cid = host, cid

    def close(self, upload):
        self.host.ledger[self.cid] += 1
        return dict(upload)


class FakeHost:
    """The RoundHost interface over dicts: private state {"n": rounds trained, counted in place}, ledger = releases."""

    method = SimpleNamespace(name="fake", release_first=False)

    def __init__(self, clients=(0, 1, 2, 3)):
        self.private = {c: {"n": 0} for c in clients}
        self.ledger = {c: 0 for c in clients}
        self.dirty: set[int] = set()

    def client_data(self, cid):
        return SimpleNamespace(client_id=cid)

    def private_state(self, cid):
        return self.private[cid]

    def update_private(self, cid, state):
        self.private[cid] = state
        self.dirty.add(cid)

    def restore_private(self, cid, state):
        self.private[cid] = state

    def open_privacy(self, cid, round_idx, shared):
        return Handle(self, cid)

    def privacy_snapshot(self, cid):
        return self.ledger[cid]

    def restore_privacy(self, cid, snapshot):
        self.ledger[cid] = snapshot

    def epsilon(self, cid):
        return float(self.ledger[cid])


def step_failing(bad: int, how: str = "raise"):
    """A local step that trains in place (n += 1) and fails for client `bad`: raises, or uploads a nan."""

    def step(cid, privacy):
        state = privacy.host.private[cid]
        state["n"] += 1  # in place, before the failure: drop must undo it
        if cid == bad and how == "raise":
            raise RuntimeError(f"client {cid} broke")
        return result(math.nan if cid == bad else 1.0, n=state["n"])

    return step


def run(policy, step, host=None):
    host = host or FakeHost()
    uploads, reports = ClientRound(host, 0, {}, phase="train", policy=policy).run([3, 1, 0, 2], step)
    return host, uploads, reports


@pytest.mark.parametrize("how, message", [("raise", r"RuntimeError: client 2 broke \(at .*test_client_round\.py:\d+ in step\)"),
                                          ("nan", r"upload 'ctx' is not finite \(6 of 6 values are nan or inf\)")])
def test_fail_stops_at_the_failed_client_and_the_check_names_it(how, message):
    host, uploads, reports = run(FAIL, step_failing(2, how))
    assert [u.client_id for u in uploads] == [0, 1]  # in id order, and client 3 never ran
    assert [(r.client_id, r.dropped) for r in reports] == [(0, False), (1, False), (2, True)]
    assert host.private[3] == {"n": 0} and host.dirty == {0, 1}
    with pytest.raises(ClientFailure, match=rf"client 2 failed in round 4: {message}\. on_client_error=fail") as info:
        FAIL.check(4, reports, out_dir="runs/x")
    assert info.value.client_id == 2 and info.value.round_idx == 4 and "output.resume=runs/x" in str(info.value)


@pytest.mark.parametrize("how", ["raise", "nan"])
def test_drop_leaves_the_client_out_with_its_state_and_ledger_put_back(how):
    host, uploads, reports = run(DROP, step_failing(2, how))
    assert [u.client_id for u in uploads] == [0, 1, 3]
    assert [r.client_id for r in reports if r.dropped] == [2] and reports[2].bytes_up == 0 and math.isnan(reports[2].loss)
    assert host.private[2] == {"n": 0} and host.ledger[2] == 0  # trained in place, put back; nothing charged
    assert all(host.private[c] == {"n": 1} and host.ledger[c] == 1 for c in (0, 1, 3))
    assert host.dirty == {0, 1, 3}
    DROP.check(0, reports)  # 3 left >= min_clients=1: the round goes on


def test_drop_stops_the_run_below_min_clients():
    reports = [ClientReport(c, 0.0, 1, 0.0) for c in (0, 1)]
    reports += [ClientReport(c, math.nan, 0, 0.0, dropped=True, error=f"e{c}") for c in (2, 3)]
    ClientPolicy(on_error="drop", min_clients=2).check(1, reports)  # exactly min_clients left
    with pytest.raises(ClientFailure, match=r"round 1: 2 of 4 clients failed and were dropped, leaving 2, fewer than "
                                            r"min_clients=3 \(client 2: e2; client 3: e3\); continue with output.resume=OUT_DIR"):
        ClientPolicy(on_error="drop", min_clients=3).check(1, reports)
    ClientPolicy(on_error="fail").check(1, reports[:2])  # nobody failed: nothing to say


def test_timeout_and_non_finite_are_failures_and_the_outcome_says_which():
    slow = ClientPolicy(on_error="drop", timeout=0.5)
    assert judge(0, result(), slow, seconds=0.2).status == "ok"
    late = judge(0, result(), slow, seconds=0.75, phase="release")
    assert late.status == "timed_out" and late.error == "local release took 0.75 s, more than client_timeout=0.5 s"
    assert judge(0, result(), ClientPolicy(timeout=0.0), seconds=1e6).ok  # 0: no limit
    assert judge(0, result(), slow).ok  # not timed (a stack)
    assert judge(0, result(math.inf), slow, seconds=9.0).status == "non_finite"  # checked first
    assert non_finite({"a": torch.ones(2), "n": torch.tensor([1, 2])}) == ""  # integer tensors cannot be non-finite
    clock = iter([0.0, 3.0])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("raysim.engine.client_round.time.perf_counter", lambda: next(clock))
        timed = attempt(0, result, ClientPolicy(timeout=2.5))
    assert timed.status == "timed_out" and "took 3.00 s, more than client_timeout=2.5 s" in timed.error
    failed = attempt(1, lambda: 1 / 0, FAIL)
    assert failed.status == "failed" and failed.error.startswith("ZeroDivisionError: division by zero (at ")


def test_privacy_errors_are_not_client_failures():
    def step(cid, privacy):
        raise UploadViolation("the privacy check doing its job")

    with pytest.raises(UploadViolation):
        run(DROP, step)
    host = FakeHost()
    host.method = SimpleNamespace(name="fake", release_first=True)  # its train phase must upload nothing
    with pytest.raises(UploadViolation, match="releases first"):
        run(DROP, lambda cid, privacy: result(), host)


def test_policy_of_the_execution_section_and_merged_phases():
    x = SimpleNamespace(on_client_error="drop", client_timeout=2, min_clients=3)
    assert ClientPolicy.of(x) == ClientPolicy(on_error="drop", timeout=2.0, min_clients=3) and ClientPolicy.of(x).drop
    released = [ClientReport(1, math.nan, 7, 0.0, {"r": 1.0}), ClientReport(0, math.nan, 0, 0.0, dropped=True, error="x")]
    trained = [ClientReport(1, 0.25, 0, 2.0, {"loss": 0.25})]
    merged = merge_phases(released, trained)
    assert [(r.client_id, r.dropped, r.bytes_up) for r in merged] == [(0, True, 0), (1, False, 7)]
    assert merged[1].metrics == {"r": 1.0, "loss": 0.25} and merged[1].epsilon == pytest.approx(2.0)
