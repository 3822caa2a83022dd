"""RunFolder: one reader of run folders (config, last round, uploads, client states, resume) for the
engine, compare and the attacks; and the audit finds every attack module through the ATTACKS registry."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch
from conftest import tiny_config

from raysim.engine.loop import resume_config, run
from raysim.errors import ConfigError, RaysimError
from raysim.storage.runfolder import RunFolder
from raysim.storage.store import StateStore


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache_dir):
    cfg = tiny_config(tmp_path_factory.mktemp("rf"), cache_dir, output={"record_uploads": True}, train={"rounds": 2, "n_ctx": 4})
    return run(cfg).out_dir


def test_a_finished_run_reads_back_its_config_last_round_uploads_and_client_states(finished):
    folder = RunFolder.open(finished)
    assert folder.is_run() and folder.path == finished
    assert folder.cfg.method == "promptfl" and folder.cfg.train.rounds == 2 and folder.cfg.output.record_uploads
    assert folder.completed_round() == 1 == StateStore(finished).completed_round()
    assert folder.upload_rounds() == [0, 1]
    record = folder.uploads(1)
    assert set(record) == {"pre", "uploads", "num_samples"} and sorted(record["uploads"]) == [0, 1, 2, 3]
    assert [(r, c) for r, c, _ in folder.records([(0, 0), (0, 1), (1, 2)])] == [(0, 0), (0, 1), (1, 2)]
    assert folder.participations(2) == [0, 1]
    state = folder.client_state(2, 1)
    assert state is not None and "private" in state
    latest = folder.latest_client_state(2)
    assert latest is not None
    assert all(torch.equal(a, b) for a, b in zip(state["private"].values(), latest["private"].values())
               if isinstance(a, torch.Tensor))
    assert folder.client_state(2, 7) is None  # no such round on disk
    assert "hm" in folder.utility()
    server = folder.server_state()
    assert server is not None and set(folder.broadcast(server)) <= set(server)


def test_a_folder_that_is_not_a_run_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="holds no config.yaml; pass the out_dir of a run"):
        RunFolder.open(tmp_path)
    assert issubclass(ConfigError, RaysimError)  # the commands print it and exit with status 2
    with pytest.raises(ConfigError, match="no config.yaml there; pass the out_dir of an earlier run"):
        RunFolder(tmp_path).resume_config()
    with pytest.raises(ConfigError, match=r"output.resume=.*no config.yaml there"):
        resume_config(tmp_path / "missing")


def test_resume_config_goes_through_the_run_folder_unchanged(finished):
    via_loop, via_folder = resume_config(finished, {"train": {"rounds": 3}}), RunFolder(finished).resume_config({"train": {"rounds": 3}})
    assert via_loop.to_dict() == via_folder.to_dict()
    assert via_loop.train.rounds == 3 and via_loop.output.resume == via_loop.output.out_dir == str(finished)
    with pytest.raises(ConfigError, match="resume: train.lr would change the results of the run being resumed"):
        resume_config(finished, {"train": {"lr": 0.5}})
    # a new run may not take the folder: it holds files
    with pytest.raises(ConfigError, match="already holds files; pass output.resume="):
        RunFolder(finished).refuse_if_taken()


def test_the_audit_finds_every_attack_module_through_the_registry():
    import raysim.attacks as attacks_pkg
    from raysim.attacks import ATTACKS, attacks

    found = attacks()  # what the audit walks
    modules = {info.name for info in pkgutil.iter_modules(attacks_pkg.__path__)} - {"base"}
    shipped = {"fsh", "gradient_inversion", "prototype_mia", "update_mia"}
    assert modules >= shipped  # a new attack module joins without this test changing
    registered = {type(a).__module__.rsplit(".", 1)[-1] for a in found}
    assert registered == modules  # every attack module registers its attack; nothing is listed by hand
    assert sorted(a.name for a in found) == ATTACKS.names() and shipped <= set(ATTACKS.names())
    for name in modules:
        mod = importlib.import_module(f"raysim.attacks.{name}")
        assert "raysim.engine" not in {getattr(v, "__module__", "") for v in vars(mod).values()}
    families = {a.name: a.family for a in found if a.name in shipped}
    assert families == {"fsh": "prototype", "prototype_mia": "prototype", "update_mia": "update", "gradient_inversion": "update"}


def test_attacks_apply_by_the_methods_declared_hooks(finished):
    from raysim.attacks import attacks
    from raysim.build import build_config
    prompt = RunFolder(finished)  # PromptFL: a prompt upload that declares loss_parts
    assert {a.name for a in attacks() if a.applies(prompt, prompt.method)} == {"update_mia", "gradient_inversion"}
    proto_cfg = build_config({"method": "fedproto", "data": {"dataset": "digits"}, "fedproto": {"model_family": "tiny"}})
    proto = RunFolder(finished, cfg=proto_cfg)
    assert {a.name for a in attacks() if a.applies(proto, proto.method)} == {"fsh", "prototype_mia"}
    fedpgp = RunFolder(finished, cfg=build_config({"method": "fedpgp"}))  # a prompt method without loss_parts
    assert {a.name for a in attacks() if a.applies(fedpgp, fedpgp.method)} == {"update_mia"}
