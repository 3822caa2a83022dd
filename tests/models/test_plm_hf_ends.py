"""FedTSP's release layout through a Hugging Face text tower (dp_positions=tokens, #46): with the end
positions read from the clean tokens, the fixed-length release of a BERT-style open_clip tower (the bundled
MiniLM) is encoded exactly as the texts themselves; without them, the positions guessed from a noised release
are another layout."""

from __future__ import annotations

import json
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = ["A photo of a seven.", "A photo of a circle: a round shape with no corners.", "o"]


def _minilm_plm(tmp_path):
    import open_clip

    from raysim.models.clip import HFTextTower, ModelSpec
    from raysim.models.plm import ClipPLM
    from raysim.tools.pretrain import model_config

    (tmp_path / "raysim-test-minilm-ends.json").write_text(json.dumps(model_config("minilm")))
    open_clip.add_model_config(tmp_path / "raysim-test-minilm-ends.json")
    plm = ClipPLM(ModelSpec("raysim-test-minilm-ends"))
    assert isinstance(plm.tower, HFTextTower)
    return plm


def test_hf_tower_end_positions_from_the_clean_tokens_encode_the_release_as_the_texts(tmp_path):
    plm = _minilm_plm(tmp_path)
    tokens = plm.tower.tokenize(TEXTS)
    ends = plm.end_index_fixed(TEXTS)
    # each end is the last unpadded token, the tower's end token ([SEP]); padding only after it
    sep = plm.tower.end_token_id()
    assert [int(tokens[i, e]) for i, e in enumerate(ends)] == [sep] * len(TEXTS)
    assert all(bool((tokens[i, int(e) + 1:] == plm.tower.pad_id).all()) for i, e in enumerate(ends))
    assert len(set(ends.tolist())) == len(TEXTS)  # three lengths: a wrong position would show
    release = plm.embed_fixed(TEXTS)
    emb, mask = plm.layout_release(release, ends)
    want_emb, want_mask = plm.embed(TEXTS)
    assert torch.equal(mask, want_mask) and torch.equal(emb, want_emb)
    with torch.no_grad():
        got, want = plm.encode(emb, mask), plm.encode(want_emb, want_mask)
    # the same float32 encoder on the same inputs: rounding only
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


def test_hf_tower_noised_release_keeps_the_sent_positions_and_a_guess_is_another_layout(tmp_path):
    plm = _minilm_plm(tmp_path)
    ends = plm.end_index_fixed(TEXTS)
    release = plm.embed_fixed(TEXTS)
    noisy = release + 3.03 * torch.randn(release.shape, generator=torch.Generator().manual_seed(1))  # Eq. 11 at eps 8
    _, sent = plm.layout_release(noisy, ends)
    _, guessed = plm.layout_release(noisy)
    assert torch.equal(sent.sum(-1) - 1, ends)  # the mask ends where the clean tokens end, whatever the noise
    assert not torch.equal(guessed, sent)
