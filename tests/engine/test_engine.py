"""The engine's promises: same seed -> same results whatever the backend, pool size or resume; what
leaves a client is declared; outputs are written; a failed start overwrites nothing."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from conftest import tiny_config

from raysim.config import merge_config
from raysim.engine.loop import eval_rounds, run
from raysim.errors import ConfigError, UploadViolation
from raysim.metrics import TIMING_COLUMNS


def read_rows(path):
    with open(path, newline="") as f:
        return [{k: v for k, v in row.items() if k not in TIMING_COLUMNS} for row in csv.DictReader(f)]


def test_inline_run_writes_every_output(tmp_path, cache_dir):
    cfg = tiny_config(tmp_path, cache_dir, output={"tensorboard": True})
    result = run(cfg)
    out = result.out_dir
    for name in ("config.yaml", "results.csv", "client_results.csv", "summary.md"):
        assert (out / name).is_file(), name
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "state" / "progress.json").is_file()
    assert list((out / "state" / "clients").iterdir())
    rounds = read_rows(out / "results.csv")
    assert [int(r["round"]) for r in rounds] == [0, 1, 2]
    clients = read_rows(out / "client_results.csv")
    assert len(clients) == 3 * 4  # every client, every evaluated round
    # PromptFL uploads one 16 x width context per client per round and gets it back
    width = 128  # raysim-tiny text width
    assert int(rounds[0]["bytes_up"]) == 4 * 16 * width * 4
    assert int(rounds[0]["bytes_down"]) == 4 * 16 * width * 4
    assert "| promptfl |" in (out / "summary.md").read_text()
    assert 0.0 <= result.summary["hm"] <= 1.0


def test_same_seed_same_results_inline_ray_and_pool_sizes(tmp_path, cache_dir, ray_session):
    # bitwise, client by client (execution.batch_clients=false); the default, client-batched, is held bitwise
    # across inline and 1 and 3 Ray actors by tests/engine/test_batched_across_hosts.py
    base = dict(train={"participation": 0.5, "rounds": 3}, execution={"batch_clients": False})
    ref = read_rows(run(tiny_config(tmp_path / "inline", cache_dir, **base)).out_dir / "results.csv")
    ref_clients = read_rows(tmp_path / "inline" / "run" / "client_results.csv")
    for name, extra in {
        "ray1": dict(backend="ray", num_actors=1),
        "ray2": dict(backend="ray", num_actors=2, client_cpus=0.5),
        "per_client": dict(backend="ray", placement="actor_per_client", client_cpus=0.25),
        "inline3": dict(backend="inline", num_actors=3),
    }.items():  # execution keys
        out = run(tiny_config(tmp_path / name, cache_dir, **merge_config(base, {"execution": extra}))).out_dir
        assert read_rows(out / "results.csv") == ref, name
        assert read_rows(out / "client_results.csv") == ref_clients, name


def test_resume_after_interruption_matches_uninterrupted(tmp_path, cache_dir):
    full = read_rows(run(tiny_config(tmp_path / "full", cache_dir, train={"rounds": 4})).out_dir / "results.csv")

    class Stop(Exception):
        pass

    def stop_after_round_1(row):
        if row["round"] == 1:
            raise Stop

    cfg = tiny_config(tmp_path / "cut", cache_dir, train={"rounds": 4})
    with pytest.raises(Stop):
        run(cfg, on_round=stop_after_round_1)
    out = tmp_path / "cut" / "run"
    assert len(read_rows(out / "results.csv")) == 2
    from raysim.engine.loop import resume_config

    resumed = run(resume_config(out))
    assert read_rows(resumed.out_dir / "results.csv") == full


def test_resume_can_extend_rounds_but_not_change_results(tmp_path, cache_dir):
    from raysim.engine.loop import resume_config

    out = run(tiny_config(tmp_path, cache_dir, train={"rounds": 2})).out_dir
    with pytest.raises(ConfigError, match="lr"):
        resume_config(out, {"train": {"lr": 0.5}})
    extended = run(resume_config(out, {"train": {"rounds": 3}}))
    assert [int(r["round"]) for r in read_rows(extended.out_dir / "results.csv")] == [0, 1, 2]


def test_existing_out_dir_is_never_overwritten(tmp_path, cache_dir):
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.csv").write_text("precious\n")
    with pytest.raises(ConfigError, match="resume="):
        run(tiny_config(tmp_path, cache_dir))
    assert (out / "results.csv").read_text() == "precious\n"


def test_uploads_are_checked_against_the_declared_tensors():
    from raysim.engine.hosts import check_upload
    from raysim.methods import get_method

    method = get_method("promptfl")
    ok = check_upload(method, 0, {"ctx": torch.zeros(2, 3, requires_grad=True)})
    assert set(ok) == {"ctx"} and not ok["ctx"].requires_grad
    with pytest.raises(UploadViolation, match="private_head"):
        check_upload(method, 3, {"ctx": torch.zeros(1), "private_head": torch.zeros(1)})
    with pytest.raises(UploadViolation, match="tensor"):
        check_upload(method, 3, {"ctx": [1.0]})


def test_dp_promptfl_spends_close_to_its_budget(tmp_path, cache_dir):
    """Each client is calibrated for the rounds it takes part in: by the end it has spent its target
    (within Opacus' calibration tolerance 0.01), never more; results.csv carries the maximum."""
    from raysim.sampling import schedule

    cfg = tiny_config(tmp_path, cache_dir, train={"rounds": 2, "participation": 0.5}, **{"dp": {"epsilon": 2.0}})
    out = run(cfg).out_dir
    took_part = {c for p in schedule(cfg.train.seed, 2, cfg.train.num_clients, 0.5) for c in p}
    rows = read_rows(out / "client_results.csv")
    final = {int(r["client"]): float(r["epsilon"]) for r in rows if r["round"] == "1"}
    for c, e in final.items():
        if c in took_part:
            assert 2.0 - 0.011 <= e <= 2.0 * (1 + 1e-6), (c, e)
        else:
            assert e == 0.0
    last = read_rows(out / "results.csv")[-1]
    assert float(last["epsilon_max"]) == pytest.approx(max(final.values()), rel=1e-9)


def test_eval_schedule_matches_spec():
    # every 5 rounds plus each of the last 5 (SPEC 1.10), 0-based rounds
    assert eval_rounds(50, 5, 5) == {4, 9, 14, 19, 24, 29, 34, 39, 44, 45, 46, 47, 48, 49}
    assert eval_rounds(3, 5, 1) == {2}


def test_prompt_learner_matches_plain_text_encoding():
    """Learned-context insertion with the placeholder embeddings reproduces open_clip's own encoding,
    so the prefix/suffix split, the EOT pooling and the causal cut are right."""
    from raysim.models.clip import ModelSpec, build_clip_env, load_clip

    names = ["zero", "one", "aquarium_fish"]
    env = build_clip_env(ModelSpec("raysim-tiny"), names, n_ctx=4)
    ours = env.prompts.plain_text_features()
    clip = load_clip(ModelSpec("raysim-tiny"))
    import open_clip

    tok = open_clip.get_tokenizer("raysim-tiny")(["X X X X zero.", "X X X X one.", "X X X X aquarium fish."])
    ref = torch.nn.functional.normalize(clip.encode_text(tok), dim=-1)
    assert torch.allclose(ours, ref, atol=1e-5)
    # stacked contexts (M experts) give one feature set per context
    ctx = torch.randn(3, 4, env.ctx_width)
    feats = env.prompts.text_features(ctx)
    assert feats.shape == (3, 3, env.feature_dim)
    assert torch.allclose(feats[1], env.prompts.text_features(ctx[1]), atol=1e-5)
    assert math.isclose(float(feats.norm(dim=-1).mean()), 1.0, rel_tol=1e-5)


def test_run_stops_before_a_release_past_the_budget(tmp_path, cache_dir):
    """sigma is calibrated for the rounds a client takes part in; extending the run would overspend."""
    from raysim.engine.loop import resume_config
    from raysim.errors import PrivacyBudgetExceeded

    out = run(tiny_config(tmp_path, cache_dir, train={"rounds": 2}, **{"dp": {"epsilon": 1.0}})).out_dir
    before = read_rows(out / "results.csv")
    with pytest.raises(PrivacyBudgetExceeded, match="epsilon"):
        run(resume_config(out, {"train": {"rounds": 4}}))
    assert read_rows(out / "results.csv") == before  # nothing trained past the budget was recorded


def test_client_level_dp_noises_the_update_and_records_it(tmp_path, cache_dir):
    """dp.level=client: what the server saw is the broadcast plus an update far larger than the clip
    (the clipped update has norm <= 0.1; the noise, std 2 sigma C per coordinate, dominates it), and the
    ledger spends the target over the run."""
    from raysim.storage.store import StateStore

    cfg = tiny_config(tmp_path, cache_dir, train={"rounds": 2}, output={"record_uploads": True},
                      **{"dp": {"epsilon": 4.0, "level": "client", "clip": 0.1}})
    out = run(cfg).out_dir
    rec = StateStore(out).load_uploads(1)
    for cid, up in rec["uploads"].items():
        delta = (up["ctx"] - rec["pre"]["ctx"]).norm()
        assert float(delta) > 10 * 0.1, cid
    rows = read_rows(out / "client_results.csv")
    eps = [float(r["epsilon"]) for r in rows if r["round"] == "1"]
    assert all(4.0 - 0.011 <= e <= 4.0 * (1 + 1e-6) for e in eps)


def test_prompt_learner_through_a_hugging_face_text_tower(tmp_path):
    """CoOp through a BERT-style tower (the bundled MiniLM as open_clip's HF text tower): placeholder
    embeddings reproduce open_clip's own encode_text, and learned context changes the features."""
    import json

    import open_clip

    from raysim.models.clip import HFTextTower, ModelSpec, build_clip_env, load_clip
    from raysim.tools.pretrain import model_config

    cfg = model_config("minilm")
    (tmp_path / "raysim-test-minilm.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(tmp_path / "raysim-test-minilm.json")
    names = ["seven", "circle", "letter_o"]
    env = build_clip_env(ModelSpec("raysim-test-minilm"), names, n_ctx=4)
    assert isinstance(env.tower, HFTextTower)
    clip = load_clip(ModelSpec("raysim-test-minilm"))
    tok = open_clip.get_tokenizer("raysim-test-minilm")(["X X X X seven.", "X X X X circle.", "X X X X letter o."])
    ref = torch.nn.functional.normalize(clip.encode_text(tok), dim=-1)
    assert torch.allclose(env.prompts.plain_text_features(), ref, atol=1e-5)
    ctx = torch.randn(2, 4, env.ctx_width, requires_grad=True)
    feats = env.prompts.text_features(ctx)
    assert feats.shape == (2, 3, env.feature_dim)
    feats.sum().backward()
    assert ctx.grad is not None and float(ctx.grad.abs().sum()) > 0
