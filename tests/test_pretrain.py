"""raysim.pretrain: a few steps write a checkpoint that open_clip loads back like real CLIP weights."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import open_clip  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from raysim import pretrain as pt  # noqa: E402
from raysim.data import synthetic as syn  # noqa: E402

BENCH = syn.SyntheticParams(classes=("circle", "seven", "letter A"), train_per_cell=2, test_per_cell=3, seed=5)
TINY_MODEL = dict(embed_dim=32, vision_width=32, vision_layers=1, patch_size=8, text_width=32, text_layers=1)


def _run(tmp_path, text):
    out = tmp_path / text
    pt.pretrain(out=str(out), steps=3, text=text, batch_size=16, per_cell=2, classes=syn.CLASS_POOL[:4],
                warmup=1, cache_dir=str(tmp_path / "cache"), bench=BENCH, progress=False, **TINY_MODEL)
    return out


def test_pretrain_clip_writes_loadable_checkpoint(tmp_path):
    out = _run(tmp_path, "clip")
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


def test_pretrain_minilm_text_tower(tmp_path):
    out = _run(tmp_path, "minilm")
    model, tok, name = pt.load(out)
    assert isinstance(model.text, open_clip.hf_model.HFTextEncoder)
    trained = torch.load(out / pt.CHECKPOINT, weights_only=True)
    assert torch.allclose(model.text.proj.weight, trained["text.proj.weight"].float())
    ids = tok(["a photo of a circle.", "a cartoon of a letter a."])
    mask = (ids != model.text.config.pad_token_id).long()
    with torch.no_grad():
        ref = model.encode_text(ids)
        got = pt.encode_text_with_embeddings(model, pt.token_embedding(model)(ids), mask)
    assert torch.allclose(ref, got, atol=1e-4)
