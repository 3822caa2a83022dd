"""raysim.tools.pretrain: a few steps write a checkpoint that open_clip loads back like real CLIP weights, and the
shipped `raysim-clip` asset assembles into a checkpoint with real zero-shot ability."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import open_clip  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from raysim.data import synthetic as syn  # noqa: E402
from raysim.models import bundled  # noqa: E402
from raysim.tools import pretrain as pt  # noqa: E402

BENCH = syn.SyntheticParams(classes=("circle", "seven", "letter A"), train_per_cell=2, test_per_cell=3, seed=5)
TINY_VIT = dict(embed_dim=32, vision_width=32, vision_layers=1, patch_size=8, text_width=32, text_layers=1)


def _run(tmp_path, text, vision, **kw):
    out = tmp_path / f"{text}-{vision}"
    pt.pretrain(out=str(out), steps=3, text=text, vision=vision, batch_size=16, per_cell=2,
                classes=syn.CLASS_POOL[:4], warmup=1, cache_dir=str(tmp_path / "cache"), bench=BENCH,
                progress=False, **kw)
    return out


def test_pretrain_clip_vit_writes_loadable_checkpoint(tmp_path):
    out = _run(tmp_path, "clip", "vit", **TINY_VIT)
    meta = json.loads((out / pt.META).read_text())
    name = meta["model_name"]
    for f in (pt.CHECKPOINT, pt.CARD, pt.METRICS, f"{name}.json"):
        assert (out / f).is_file(), f
    # the path real weights take: register the config, create_model(name, pretrained=PATH)
    open_clip.add_model_config(out / f"{name}.json")
    model = open_clip.create_model(name, pretrained=str(out / pt.CHECKPOINT))
    saved = torch.load(out / pt.CHECKPOINT, weights_only=True)
    assert torch.allclose(model.visual.conv1.weight, saved["visual.conv1.weight"].float())
    assert hasattr(model, "token_embedding")  # standard tower: the engine's CoOp path applies
    tok = open_clip.get_tokenizer(name)
    _, test = syn.generate(BENCH, str(tmp_path / "cache"))
    acc = pt.zero_shot_accuracy(model, tok, test.images, test.labels, list(BENCH.classes), test.domains,
                                list(BENCH.domains))
    assert set(syn.DOMAINS) <= set(acc) and 0 <= acc["overall"] <= 100 and acc["chance"] == pytest.approx(100 / 3)
    metrics = json.loads((out / pt.METRICS).read_text())
    assert metrics["zero_shot_benchmark"]["n"] == len(test) and "zero-shot" in (out / pt.CARD).read_text().lower()
    # prompt learning entry point reproduces encode_text
    ids = tok(["a photo of a circle.", "a sketch of a seven."])
    with torch.no_grad():
        ref = model.encode_text(ids)
        got = pt.encode_text_with_embeddings(model, pt.token_embedding(model)(ids), tokens=ids)
    assert torch.allclose(ref, got, atol=1e-5)


def test_pretrain_minilm_cnn_and_export(tmp_path):
    out = _run(tmp_path, "minilm", "cnn", embed_dim=32)
    model, tok, name = pt.load(out)
    assert isinstance(model.text, open_clip.hf_model.HFTextEncoder)
    assert isinstance(model.visual, open_clip.timm_model.TimmModel)
    trained = torch.load(out / pt.CHECKPOINT, weights_only=True)
    assert torch.allclose(model.text.proj.weight, trained["text.proj.weight"].float())
    ids = tok(["a photo of a circle.", "a cartoon of a letter a."])
    mask = (ids != model.text.config.pad_token_id).long()
    with torch.no_grad():
        ref = model.encode_text(ids)
        got = pt.encode_text_with_embeddings(model, pt.token_embedding(model)(ids), mask)
    assert torch.allclose(ref, got, atol=1e-4)
    # the asset holds the trained weights only, and a placeholder for the MiniLM folder
    asset = pt.export_asset(out, tmp_path / "asset")
    cfg = json.loads((asset / pt.ASSET_CONFIG).read_text())
    assert cfg["text_cfg"]["hf_model_name"] == pt.MINILM_PLACEHOLDER
    shipped = torch.load(asset / pt.ASSET_WEIGHTS, weights_only=True)
    assert "text.proj.weight" in shipped and not any(k.startswith(pt.FROZEN_PREFIX) for k in shipped)
    assert (asset / pt.CARD).is_file()


def test_bundled_checkpoint_has_real_zero_shot_ability(tmp_path):
    cache = str(tmp_path / "cache")
    path = bundled.bundled_checkpoint(cache)
    made = path.stat().st_mtime_ns
    assert bundled.bundled_checkpoint(cache) == path and path.stat().st_mtime_ns == made  # reused, not rebuilt
    assert (bundled.ASSET_DIR / bundled.ASSET_WEIGHTS).stat().st_size < 10e6
    name = bundled.register_bundled()
    model = open_clip.create_model(name, pretrained=str(path))  # strict loading, as for real CLIP weights
    tok = open_clip.get_tokenizer(name)
    # the first 4 images of every (class, domain) cell of the `synthetic` test split (never seen in training)
    params = syn.SyntheticParams(train_per_cell=1, test_per_cell=4)
    _, test = syn.generate(params, cache)
    acc = pt.zero_shot_accuracy(model, tok, test.images, test.labels, list(params.classes), test.domains,
                                list(params.domains))
    assert acc["overall"] > acc["chance"] + 30, acc
    assert all(acc[d] > acc["chance"] + 10 for d in syn.DOMAINS), acc


def test_align_loss_is_zero_when_the_contexts_match_the_phrase():
    from raysim.tools.pretrain_prompts import align_loss

    torch.manual_seed(0)
    proj = torch.nn.Linear(8, 4)
    target = torch.randn(5, 8)
    img = torch.nn.functional.normalize(torch.randn(6, 4), dim=-1)
    same = target[None].repeat(3, 1, 1)
    other = same + torch.randn(3, 5, 8)
    for kw in ({}, {"img_f": img, "scale": torch.tensor(50.0)}):
        assert align_loss(same, target, proj, **kw).item() == pytest.approx(0.0, abs=1e-5)
        loss = align_loss(other, target, proj, **kw)
        assert loss.item() > 1e-3
        loss.backward()
        assert proj.weight.grad is not None and proj.weight.grad.abs().sum() > 0
        proj.zero_grad()


def test_pretrain_prompt_holdout_and_align(tmp_path):
    out = _run(tmp_path, "minilm", "cnn", embed_dim=32, prompt_weight=1.0, prompt_holdout=2, prompt_align=1.0,
               align_images=True)
    m = json.loads((out / pt.METRICS).read_text())
    assert (m["prompt_holdout"], m["prompt_align"], m["align_images"]) == (2, 1.0, True)
    card = (out / pt.CARD).read_text()
    assert "except the first 2" in card and "KL divergence" in card
    cfg = json.loads((out / f"{m['model_name']}.json").read_text())
    assert "--prompt-holdout 2 --prompt-align 1.0 --align-images" in pt._remake_command(m, cfg)
    with pytest.raises(ValueError, match="leaves no class"):
        pt.pretrain(out=str(tmp_path / "none"), steps=1, batch_size=16, per_cell=2, classes=syn.CLASS_POOL[:4],
                    warmup=1, cache_dir=str(tmp_path / "cache"), bench=BENCH, progress=False, prompt_weight=1.0,
                    prompt_holdout=4)
