"""Class-prompt targets for `raysim pretrain --prompt-weight W`: the images are also paired with their class
named in several templates and in the CoOp prompt "X X ... X <class>." whose L context embeddings are
zero, small Gaussian (N(0, 0.02^2), the official CoOp / FedSEPT start) or the embeddings of random token ids.

Real CLIP scores a near-zero CoOp context about as well as a hand-written phrase; a model trained on
captions alone does not (raysim-clip: 27% zero context against 42% "a photo of a" on synthetic-large).
The context prompts go through exactly the code path prompt tuning uses (`raysim.models.clip.HFTextTower`
and `CoOpPrompts.text_features`): the MiniLM tower is frozen, so their pooled features (before the trained
projection) are computed once, for a fixed pool of contexts, and training only projects them.

It also measures what the issue asks of the result: zero-shot accuracy with the phrase, a zero context and
random contexts, through the same prompts (`context_zero_shot`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# class-name templates besides the CoOp context prompts ("a photo of a {}." first: the zero-shot classifier)
PROMPT_TEMPLATES = (
    "a photo of a {}.", "a {}.", "a picture of a {}.", "an image of a {}.", "a rendering of a {}.",
    "a sketch of a {}.", "a cartoon of a {}.", "a drawing of the {}.", "a small {}.", "a large {}.",
)
CTX_LENGTHS = (4, 8, 16)
PHRASE = "a photo of a"
INIT_STD = 0.02  # CoOp's and the FedSEPT repository's initialisation scale
# `context_zero_shot`'s seed for a model pretrained with seed S is S + FRESH_DRAWS: its random contexts are then
# fresh draws. (With the same seed its first N(0, 0.02^2) draws are the training pool's own 4-vector draws:
# `context_pool` and `context_zero_shot` draw from the same generator sequence.)
FRESH_DRAWS = 101


def _tower(model, model_name: str):
    """The prompt learner's text tower for `model` (a CustomTextCLIP with the frozen MiniLM). Building it
    freezes the modules it shares with `model`; their `requires_grad` flags are restored (the projection
    trains)."""
    from raysim.models.clip import build_text_tower

    flags = [(p, p.requires_grad) for p in model.parameters()]
    tower = build_text_tower(model, model_name)
    for p, flag in flags:
        p.requires_grad_(flag)
    return tower


@dataclasses.dataclass
class PromptPool:
    """(S, C, width) pooled text features (before the trained projection) of S prompt sets over C classes,
    and a name per set ("template:...", "zero:L", "gauss:L:k", "tokens:L:k")."""

    pooled: torch.Tensor
    names: list[str]


@torch.no_grad()
def context_pool(model, model_name: str, classes: Sequence[str], *, lengths: Sequence[int] = CTX_LENGTHS,
                 n_gauss: int = 8, n_tokens: int = 4, seed: int = 0) -> PromptPool:
    """Pooled MiniLM features of the CoOp prompts of `classes` for, per context length L: the zero context,
    `n_gauss` N(0, 0.02^2) contexts and `n_tokens` contexts of random word embeddings (token ids drawn
    from the vocabulary past BERT's special and unused ids), through `CoOpPrompts.text_features`."""
    from raysim.models.clip import CoOpPrompts

    tower = _tower(model, model_name)
    tower.proj = nn.Identity()  # the tower's own attribute: the model's projection is untouched
    g = torch.Generator().manual_seed(seed)
    width = tower.width
    vocab = tower.word_embeddings.weight.shape[0]
    feats, names = [], []
    for L in lengths:
        prompts = CoOpPrompts(tower, classes, L)
        ctxs = [torch.zeros(L, width)] + [torch.randn(L, width, generator=g) * INIT_STD for _ in range(n_gauss)]
        ctxs += [tower.word_embeddings(torch.randint(1000, vocab, (L,), generator=g)) for _ in range(n_tokens)]
        names += [f"zero:{L}"] + [f"gauss:{L}:{k}" for k in range(n_gauss)] + [f"tokens:{L}:{k}" for k in range(n_tokens)]
        feats.append(prompts.text_features(torch.stack(ctxs), normalize=False))  # (K, C, width)
    return PromptPool(torch.cat(feats), names)


@torch.no_grad()
def template_pool(model, tokenizer, classes: Sequence[str], templates: Sequence[str] = PROMPT_TEMPLATES,
                  cache_dir: Optional[str] = None) -> PromptPool:
    """Pooled MiniLM features of every class in every template (the tokenised path, `model.encode_text`)."""
    from raysim.tools.pretrain_model import frozen_text_features

    names = [c.replace("_", " ") for c in classes]
    texts = [t.format(c) for t in templates for c in names]
    pooled = frozen_text_features(model, tokenizer, texts, cache_dir)
    return PromptPool(pooled.view(len(templates), len(classes), -1), [f"template:{t}" for t in templates])


def prompt_loss(img_f: torch.Tensor, labels: torch.Tensor, pooled: torch.Tensor, proj: nn.Module, scale: torch.Tensor,
                label_smoothing: float = 0.1, sets: int = 0, gen: Optional[torch.Generator] = None) -> torch.Tensor:
    """Mean over the S prompt sets (or `sets` of them drawn with `gen`, when 0 < sets < S) of the
    cross-entropy of normalised image features against each set's projected, normalised class features."""
    if 0 < sets < pooled.shape[0]:
        pooled = pooled[torch.randperm(pooled.shape[0], generator=gen)[:sets]]
    S, C, w = pooled.shape
    text = F.normalize(proj(pooled.reshape(S * C, w)), dim=-1).view(S, C, -1)
    logits = scale * torch.einsum("bd,scd->sbc", img_f, text)
    return F.cross_entropy(logits.reshape(S * len(labels), C), labels.repeat(S), label_smoothing=label_smoothing)


def align_loss(pooled: torch.Tensor, target: torch.Tensor, proj: nn.Module, img_f: Optional[torch.Tensor] = None,
               scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pull each prompt set's projected class features (S, C, width) onto the projected features of the
    same classes in the target prompt (C, width), e.g. a zero or N(0, 0.02^2) CoOp context onto
    "a photo of a {class}.". Without `img_f`: the mean cosine distance (text only). With image features
    `img_f` (B, D): the KL divergence from the target prompts' class distribution over these images (the
    teacher, no gradient) to each set's (the student), at logit scale `scale`. No class label enters either,
    so the loss shapes how the projection treats the context and leaves the image-text fit to the captions."""
    S, C, w = pooled.shape
    ctx = F.normalize(proj(pooled.reshape(S * C, w)), dim=-1).view(S, C, -1)
    tgt = F.normalize(proj(target), dim=-1)
    if img_f is None:
        return (1 - (ctx * tgt[None]).sum(-1)).mean()
    if scale is None:
        raise ValueError("align_loss on images needs the logit scale")
    teacher = F.log_softmax(scale * img_f @ tgt.detach().T, dim=-1)  # (B, C)
    student = F.log_softmax(scale * torch.einsum("bd,scd->sbc", img_f, ctx), dim=-1)  # (S, B, C)
    return (teacher.exp()[None] * (teacher[None] - student)).sum(-1).mean()


# --------------------------------------------------------------------------------------------------------
# measurement


@torch.no_grad()
def context_zero_shot(model, model_name: str, images: torch.Tensor, labels: np.ndarray, classes: Sequence[str],
                      domains: Optional[np.ndarray] = None, domain_names: Sequence[str] = (), *, n_ctx: int = 4,
                      n_random: int = 5, seed: int = 0, batch_size: int = 512) -> dict:
    """Zero-shot accuracy (%) through the prompt learner's CoOp prompts with L=`n_ctx` context vectors:
    "phrase" ("a photo of a", CoOp's CTX_INIT), "zero" (all zeros: FedSEPT's shared prompt A B0, A and B0 ~ N(0, 0.02^2), starts
    next to it, with entries of std 0.02^2 x sqrt(rank) = 0.0016 at rank 16), "gauss" (N(0, 0.02^2), mean over
    `n_random` draws) and "tokens" (embeddings of
    random token ids, mean over `n_random` draws); each overall and per domain."""
    from raysim.models.clip import CoOpPrompts
    from raysim.tools.pretrain_model import normalise_uint8

    model.eval()
    tower = _tower(model, model_name)
    prompts = CoOpPrompts(tower, classes, n_ctx, ctx_init=PHRASE)
    img = []
    for i in range(0, len(images), batch_size):
        x = images[i: i + batch_size]
        img.append(model.encode_image(normalise_uint8(x) if x.dtype == torch.uint8 else x.float(), normalize=True))
    img_f = torch.cat(img)
    labels = np.asarray(labels)
    g = torch.Generator().manual_seed(seed)
    vocab = tower.word_embeddings.weight.shape[0]
    starts = {"phrase": [prompts.initial_context(g)], "zero": [torch.zeros(n_ctx, tower.width)],
              "gauss": [torch.randn(n_ctx, tower.width, generator=g) * INIT_STD for _ in range(n_random)],
              "tokens": [tower.word_embeddings(torch.randint(1000, vocab, (n_ctx,), generator=g)) for _ in range(n_random)]}
    out: dict = {}
    for name, ctxs in starts.items():
        accs = []
        for ctx in ctxs:
            pred = (img_f @ prompts.text_features(ctx).T).argmax(-1).numpy()
            acc = {"overall": float((pred == labels).mean() * 100)}
            if domains is not None:
                for d in np.unique(domains):
                    sel = np.asarray(domains) == d
                    acc[domain_names[d] if d < len(domain_names) else str(d)] = float((pred[sel] == labels[sel]).mean() * 100)
            accs.append(acc)
        out[name] = {k: float(np.mean([a[k] for a in accs])) for k in accs[0]}
    out["chance"] = 100.0 / len(classes)
    out["n"] = int(len(labels))
    return out
