"""CLIP through open_clip: loading (pretrained tags, local checkpoints, tiny configs), frozen image
features, and a text tower that accepts learned prompt embeddings (CoOp, SPEC 1.1)."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence, TypeAlias

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raysim.errors import ConfigError, DataError, one_line, shown

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
BUNDLED_MODEL = "raysim-clip2"  # the small CLIP this project pretrains on generated data and ships (the default)
BUNDLED_MODELS = ("raysim-clip2", "raysim-clip", "raysim-clip3")  # shipped (raysim.models.bundled.BUNDLED); raysim-clip: the first, a CNN
BUNDLED_TAG = "bundled"  # pretrained=bundled: the project's own weights for a shipped model
ASSETS = Path(__file__).resolve().parents[1] / "assets"
BUNDLED_ASSET = ASSETS / BUNDLED_MODEL
_registered = False
log = logging.getLogger(__name__)

# open_clip ships no type information: its models and towers (CLIP, CustomTextCLIP, VisionTransformer,
# ModifiedResNet, TimmModel, ...) are read here by attribute name, so they are dynamically typed.
OpenClipModule: TypeAlias = Any


def register_builtin_configs() -> None:
    """Make raysim's own model configs (raysim-tiny, ...) known to open_clip."""
    global _registered
    if not _registered:
        import open_clip

        open_clip.add_model_config(CONFIG_DIR)
        from raysim.models.bundled import register_bundled

        for name in BUNDLED_MODELS:
            if (ASSETS / name / "config.json").is_file():
                register_bundled(name)
        _registered = True


AUTOCAST = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class FastPaths:
    """How the frozen text tower runs (execution.autocast, execution.compile); results change only within
    float tolerance (README "GPUs"). Not part of `ModelSpec.key()`: cached image features are computed in
    fp32 without them.

    - autocast: "off" | "bf16" | "fp16": the tower's forward (and so its backward) under torch.autocast;
      the features come out in float32. fp16 needs CUDA (`check`).
    - compile: torch.compile the tower's forward after the sequence cut, with `compile_backend` (inductor;
      the tests pass "eager", which traces the same graph with dynamo but skips inductor's code generation)."""

    autocast: str = "off"
    compile: bool = False
    compile_backend: str = "inductor"

    def check(self, device: str | torch.device) -> None:
        if self.autocast not in AUTOCAST:
            raise ConfigError(f"execution.autocast must be one of {', '.join(AUTOCAST)}, got {shown(self.autocast)}")
        if self.autocast == "fp16" and torch.device(device).type != "cuda":
            raise ConfigError(
                "execution.autocast=fp16 runs the text tower in float16, which needs a GPU (CPUs have no fast float16 "
                "matrix products, so it would only be slower); this tower runs on the CPU: use execution.autocast=bf16 "
                "or off, or execution.device=cuda"
            )


@dataclass(frozen=True)
class ModelSpec:
    """Which CLIP to build. `pretrained`: "" (random init, seeded), an open_clip tag, or a file path.
    `fast`: how the text tower runs (not part of `key()`)."""

    model: str = "raysim-tiny"
    pretrained: str = ""
    init_seed: int = 0
    cache_dir: str = "~/.cache/raysim"  # where the bundled checkpoint is assembled
    fast: FastPaths = FastPaths()

    def key(self) -> str:
        p = self.pretrained
        if p == BUNDLED_TAG:
            import hashlib

            asset = ASSETS / (self.model if self.model in BUNDLED_MODELS else BUNDLED_MODEL) / "trainable.pt"
            p = "bundled:" + hashlib.sha256(asset.read_bytes()).hexdigest()[:16]
        elif p and Path(p).expanduser().exists():  # a file, or a `raysim pretrain` folder (keyed by its checkpoint)
            from raysim.models.bundled import CHECKPOINT

            path = Path(p).expanduser().resolve()
            ckpt = path / CHECKPOINT if path.is_dir() else path
            p = f"{path}:{ckpt.stat().st_size}:{int(ckpt.stat().st_mtime)}" if ckpt.is_file() else str(path)
        return f"{self.model}|{p or f'random{self.init_seed}'}"


def load_clip(spec: ModelSpec, device: str | torch.device = "cpu") -> OpenClipModule:
    """Build an open_clip model in fp32, frozen and in eval mode."""
    import open_clip

    from raysim.models.quiet import quiet_load

    register_builtin_configs()
    pretrained = spec.pretrained or None
    if pretrained and Path(pretrained).expanduser().is_dir():  # registers the folder's model config first
        pretrained = str(pretrain_folder_checkpoint(Path(pretrained).expanduser(), spec.model))
    if spec.model not in open_clip.list_models():
        import difflib

        hint = difflib.get_close_matches(spec.model[:100], open_clip.list_models(), n=3)
        raise ConfigError(
            f"unknown model {shown(spec.model)} (an open_clip model name). "
            + (f"Close matches: {', '.join(hint)}. " if hint else "")
            + "Use raysim-tiny for a small random model, or e.g. ViT-B-16."
        )
    if pretrained == BUNDLED_TAG:
        if spec.model not in BUNDLED_MODELS:
            raise ConfigError(f"model.pretrained={BUNDLED_TAG} is this project's own weights of {' or '.join(BUNDLED_MODELS)}; "
                              f"use model.name={BUNDLED_MODEL}")
        from raysim.models.bundled import bundled_checkpoint

        pretrained = str(bundled_checkpoint(spec.cache_dir, spec.model))
    elif pretrained:
        path = Path(pretrained).expanduser()
        if path.is_file():
            pretrained = str(path)
        elif any(c in pretrained for c in "/\\") or path.suffix in (".pt", ".pth", ".bin", ".safetensors"):
            raise DataError(f"pretrained checkpoint {shown(pretrained)} does not exist")
        else:
            tags = open_clip.list_pretrained_tags_by_model(spec.model)
            if pretrained not in tags:
                raise ConfigError(
                    f"{spec.model} has no pretrained tag {shown(pretrained)}; open_clip knows: {', '.join(tags) or 'none'}. "
                    "Or pass a local checkpoint path."
                )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.init_seed)
        try:
            previous = logging.root.manager.disable
            if not pretrained:  # open_clip warns that a random init is random; that is what was asked for
                logging.disable(logging.WARNING)
            try:
                with contextlib.redirect_stdout(io.StringIO()), quiet_load():
                    model = open_clip.create_model(spec.model, pretrained=pretrained, device="cpu", precision="fp32")
            finally:
                logging.disable(previous)
        except Exception as e:  # offline hub; a local file that is no checkpoint of this model (any error reading it)
            if pretrained and Path(pretrained).is_file():
                raise DataError(
                    f"model.pretrained={shown(spec.pretrained)} cannot be loaded as {spec.model} weights "
                    f"({type(e).__name__}: {one_line(str(e), 120) or 'no details'}); pass a checkpoint of model.name={spec.model} "
                    "(an open_clip state dict, a folder written by raysim pretrain) or leave model.pretrained empty"
                ) from None
            if pretrained and isinstance(e, (RuntimeError, OSError)):
                raise DataError(
                    f"could not load open_clip weights {spec.model}/{pretrained} ({e.__class__.__name__}: {one_line(str(e))}). "
                    "Without internet, download the checkpoint elsewhere and pass model.pretrained=/path/to/file.pt."
                ) from None
            raise
    model.eval().requires_grad_(False)
    return model.to(device)


def pretrain_folder_checkpoint(folder: Path, model: str) -> Path:
    """The checkpoint in a folder written by `raysim pretrain`, its model config registered with open_clip."""
    from raysim.models import bundled

    if not (folder / bundled.META).is_file() or not (folder / bundled.CHECKPOINT).is_file():
        raise DataError(
            f"model.pretrained={folder} is a folder but not one written by `raysim pretrain` "
            f"(no {bundled.META} and {bundled.CHECKPOINT}); pass a checkpoint file or such a folder"
        )
    try:
        name = bundled.register(folder)
    except Exception as e:  # a hand-edited or damaged folder: its JSON unreadable, the model config it names missing
        raise DataError(f"model.pretrained={shown(str(folder))}: its {bundled.META} and model config cannot be read "
                        f"({type(e).__name__}: {one_line(str(e), 120) or 'no details'}); run raysim pretrain again, or pass "
                        "a checkpoint file") from None
    if model != name:
        raise ConfigError(f"model.pretrained={folder} holds a {name} model; pass model.name={name}")
    return folder / bundled.CHECKPOINT


def image_size_of(model: OpenClipModule) -> int:
    size = getattr(model.visual, "image_size", 224)
    return int(size[0] if isinstance(size, (tuple, list)) else size)


@torch.no_grad()
def encode_images(model: OpenClipModule, dataset: torch.utils.data.Dataset, *, batch_size: int = 256, device: str = "cpu",
                  progress: bool = False, desc: str = "image features", tokens: bool = False):
    """L2-normalised image features of every item of `dataset` (frozen tower, eval mode).

    With `tokens=True`, returns (features, tokens): the image tower's token sequence read in the same pass
    (see `image_tokens`), stored in float16 to halve its memory."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=0)
    out, toks = [], []
    it = loader
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(loader, desc=desc, leave=False)
    with image_tokens(model.visual) if tokens else contextlib.nullcontext() as seen:
        for x in it:
            if isinstance(x, (tuple, list)):
                x = x[0]
            out.append(F.normalize(model.encode_image(x.to(device)).float(), dim=-1).cpu())
            if tokens:
                assert seen is not None  # image_tokens' list whenever tokens=True
                toks.append(seen.pop().to(torch.float16).cpu())
    feats = torch.cat(out) if out else torch.zeros(0, 0)
    if not tokens:
        return feats
    return feats, (torch.cat(toks) if toks else torch.zeros(0, 0, 0, dtype=torch.float16))


def token_site(visual: OpenClipModule) -> tuple[nn.Module, str, int]:
    """Where an image tower's token sequence can be read, as (module, "output" | "input", width).

    - open_clip ViT: the output of `visual.transformer`, i.e. the CLS and patch tokens before `ln_post`
      (SPEC 1.3: 197 tokens of width 768 for ViT-B/16 at 224 px);
    - open_clip ModifiedResNet (RN50, ...): the input of `attnpool`, the last (C, H, W) feature map;
    - timm trunks (TimmModel): the input of the trunk's `global_pool`, the last (C, H, W) feature map.
    A feature map becomes H*W tokens of width C."""
    if hasattr(visual, "transformer") and hasattr(visual, "ln_post"):
        return visual.transformer, "output", int(visual.transformer.width)
    if hasattr(visual, "attnpool"):
        return visual.attnpool, "input", int(visual.attnpool.k_proj.in_features)
    trunk = getattr(visual, "trunk", None)
    if trunk is not None and isinstance(getattr(trunk, "global_pool", None), nn.Module):
        return trunk.global_pool, "input", int(trunk.num_features)
    raise ConfigError(
        f"raysim cannot read image tokens from a {type(visual).__name__} image tower "
        "(it knows open_clip ViTs, ModifiedResNets and timm CNNs); use fedsept.router=pooled"
    )


@contextlib.contextmanager
def image_tokens(visual: OpenClipModule) -> Iterator[list[Tensor]]:
    """While active, every forward of `visual` appends its token sequence (B, K, width) to the yielded list."""
    module, where, _ = token_site(visual)
    seen: list[Tensor] = []

    def keep(t: Tensor) -> None:
        seen.append(t.flatten(2).transpose(1, 2) if t.dim() == 4 else t)  # (B, C, H, W) -> (B, H*W, C)

    if where == "output":
        first = getattr(module, "batch_first", True)  # an open_clip Transformer may run sequence-first
        handle = module.register_forward_hook(lambda m, args, out: keep(out if first else out.transpose(0, 1)))
    else:
        handle = module.register_forward_pre_hook(lambda m, args: keep(args[0]))
    try:
        yield seen
    finally:
        handle.remove()


POOLED_HINT = "use a ViT image tower, or the method's pooled mode, e.g. fedotp.tokens=pooled"


class TokenHead(nn.Module):
    """Maps the cached token sequence of an image tower (`image_tokens`: (B, K, width)) into the joint
    embedding space one token at a time, the way the tower maps its pooled token (FedOTP's local image
    features, SPEC 1.11):

    - open_clip ViT: the patch tokens (the CLS token dropped, as the tower's own pooling does), `ln_post`,
      then `proj` (196 tokens of width 512 for ViT-B/16 at 224 px);
    - timm CNN trunk with average pooling: the tower's head (dropout, then its linear or MLP projection)
      on every location of the last feature map. For a linear head the mean of these is the unnormalised
      pooled feature.
    Outputs are not normalised."""

    def __init__(self, visual: OpenClipModule) -> None:
        super().__init__()
        if hasattr(visual, "transformer") and hasattr(visual, "ln_post"):
            if getattr(visual, "attn_pool", None) is not None:
                raise ConfigError("this ViT pools with attention; raysim maps its tokens only for CLS or average pooling "
                                  f"({POOLED_HINT})")
            self.kind = "vit"
            self.drop_first = getattr(visual, "pool_type", "tok") in ("tok", "avg")  # open_clip's _global_pool
            self.head: nn.Module = visual.ln_post  # then proj
            self.proj: Tensor | None = visual.proj
        elif getattr(visual, "trunk", None) is not None and isinstance(getattr(visual, "head", None), nn.Sequential):
            pool = getattr(visual.trunk, "global_pool", None)
            if getattr(pool, "pool_type", "") != "avg" or "pool" in dict(visual.head.named_children()):
                raise ConfigError(f"this timm image tower does not average-pool its last feature map, so raysim cannot map its tokens "
                                  f"({POOLED_HINT})")
            self.kind = "timm"
            self.drop_first = False
            self.head = visual.head if len(visual.head) else visual.trunk.get_classifier()
            self.proj = None
        else:
            raise ConfigError(f"raysim cannot map the tokens of a {type(visual).__name__} image tower to the embedding space "
                              f"(it knows open_clip ViTs and average-pooled timm CNNs; {POOLED_HINT})")

    def forward(self, tokens: Tensor) -> Tensor:
        x = tokens[:, 1:] if self.drop_first else tokens
        x = self.head(x.to(torch.float32))
        return x @ self.proj if self.proj is not None else x


class TextTower(nn.Module):
    """The frozen text side of an open_clip CLIP, fed with token *embeddings* so prompts can be learned.

    `meta(tokens)` is what the tower needs besides the embeddings of a tokenised batch (the EOT position
    for CLIP's causal transformer, the attention mask for a Hugging Face encoder); `forward(embeds, meta)`
    gives unnormalised text features. `build_text_tower` picks the implementation for a model."""

    width: int
    embed_dim: int
    logit_scale: float
    tokenizer: Any  # open_clip's tokenizer (untyped)
    word_embeddings: nn.Embedding
    fast: FastPaths = FastPaths()
    _compiled: Any = None  # torch.compile of `run` when fast.compile

    # implemented by CausalTextTower and HFTextTower
    def run(self, x: Tensor, aux: Tensor | None, index: Tensor) -> Tensor:
        """The tower after the sequence cut (what autocast and torch.compile wrap)."""
        raise NotImplementedError

    def meta(self, tokens: Tensor) -> Tensor:
        raise NotImplementedError

    def end_token_id(self) -> int:
        raise NotImplementedError

    def meta_from_embeddings(self, embeds: Tensor) -> Tensor:
        """What `forward` needs besides a released (noised) embedding tensor, by post-processing only."""
        raise NotImplementedError

    def end_index(self, tokens: Tensor) -> Tensor:
        """(N,) the position of each tokenised sequence's end token (EOT / [SEP]), from the clean tokens."""
        raise NotImplementedError

    def meta_from_ends(self, embeds: Tensor, ends: Tensor) -> Tensor:
        """What `forward` needs besides `embeds` when each sequence's end position is known (`end_index`):
        the same as `meta(tokens)` of the tokens the positions came from."""
        raise NotImplementedError

    def tokenize(self, texts: Sequence[str]) -> Tensor:
        return self.tokenizer(list(texts))

    def set_fast_paths(self, fast: FastPaths, device: str | torch.device) -> None:
        """Run this tower under `fast` from now on (see FastPaths); raises ConfigError for a combination
        the device cannot run."""
        fast.check(device)
        self.fast = fast
        self._compiled = None
        if fast.compile:
            import torch._functorch.config as functorch_config

            # compiled backward graphs donate their buffers unless told not to, which forbids the
            # retain_graph=True backward passes of DP-SGD's public term and of the methods' own grads_of
            functorch_config.donated_buffer = False
            self._compiled = torch.compile(self.run, backend=fast.compile_backend, dynamic=None)

    def _run_fast(self, x: Tensor, aux: Tensor | None, index: Tensor) -> Tensor:
        fn = self._compiled if self._compiled is not None else self.run
        dtype = AUTOCAST[self.fast.autocast]
        if dtype is None:
            return fn(x, aux, index)
        with torch.autocast(device_type=x.device.type, dtype=dtype):
            out = fn(x, aux, index)
        return out.float()

    @torch.no_grad()
    def embed_tokens(self, tokens: Tensor) -> Tensor:
        emb = self.word_embeddings
        return emb(tokens.to(emb.weight.device))

    @torch.no_grad()
    def end_positions(self, embeds: Tensor) -> Tensor:
        """Post-processing of a released (noised) embedding tensor (N, T, w): each sequence's end-of-text
        position is taken as the position (after the first) whose embedding is most similar to the public
        end token's embedding."""
        end = self.end_token_id()
        ref = self.word_embeddings.weight[end].to(embeds.device, embeds.dtype)
        sims = F.cosine_similarity(embeds[:, 1:], ref[None, None], dim=-1)
        return sims.argmax(dim=-1) + 1

    def encode_texts(self, texts: Sequence[str]) -> Tensor:
        tokens = self.tokenize(texts)
        return F.normalize(self(self.embed_tokens(tokens), self.meta(tokens)), dim=-1)

    def _finish(self, clip: OpenClipModule, model_name: str) -> None:
        import open_clip

        self.tokenizer = open_clip.get_tokenizer(model_name)
        self.width = int(self.word_embeddings.weight.shape[1])
        self.logit_scale = float(clip.logit_scale.exp().item())
        self.requires_grad_(False)
        self.eval()


class CausalTextTower(TextTower):
    """open_clip's own text transformer (CLIP, raysim-tiny). Because the attention is causal, the feature
    at the end-of-text token depends only on positions up to it, so sequences are cut after the last EOT
    of the batch (same result, far less compute)."""

    positional_embedding: nn.Parameter
    transformer: nn.Module
    ln_final: nn.Module
    text_projection: nn.Linear | nn.Parameter
    attn_mask: Tensor | None  # buffer

    def __init__(self, clip: OpenClipModule, model_name: str) -> None:
        super().__init__()
        self.word_embeddings = clip.token_embedding
        self.positional_embedding = clip.positional_embedding
        self.transformer = clip.transformer
        self.ln_final = clip.ln_final
        self.text_projection = clip.text_projection
        self.register_buffer("attn_mask", clip.attn_mask, persistent=False)
        if getattr(clip, "text_pool_type", "argmax") != "argmax":
            raise ConfigError(f"{model_name}: text pooling {clip.text_pool_type!r} is not supported by the prompt learner")
        proj = self.text_projection
        self.embed_dim = int(proj.weight.shape[0] if isinstance(proj, nn.Linear) else proj.shape[1])
        self._finish(clip, model_name)

    def meta(self, tokens: Tensor) -> Tensor:
        return tokens.argmax(dim=-1)  # EOT has the largest token id

    def end_token_id(self) -> int:
        return int(self.tokenize([""])[0].max())

    def meta_from_embeddings(self, embeds: Tensor) -> Tensor:
        return self.end_positions(embeds)

    def end_index(self, tokens: Tensor) -> Tensor:
        return tokens.argmax(dim=-1)

    def meta_from_ends(self, embeds: Tensor, ends: Tensor) -> Tensor:
        return ends.long().to(embeds.device)

    def forward(self, embeds: Tensor, eot: Tensor) -> Tensor:
        """embeds: (N, T, width) token embeddings; eot: (N,) EOT positions -> (N, embed_dim) features."""
        t = int(eot.max().item()) + 1
        x = embeds[:, :t] + self.positional_embedding[:t].to(embeds.dtype)
        mask = self.attn_mask[:t, :t] if self.attn_mask is not None else None
        return self._run_fast(x, mask, eot.to(x.device))

    def run(self, x: Tensor, mask: Tensor | None, eot: Tensor) -> Tensor:
        # open_clip's blocks call nn.MultiheadAttention(need_weights=False), i.e. F.scaled_dot_product_attention
        # with this additive causal mask (README "GPUs": SDPA is already the attention here)
        x = self.transformer(x, attn_mask=mask)
        x = self.ln_final(x)
        x = x[torch.arange(x.shape[0], device=x.device), eot]
        if isinstance(self.text_projection, nn.Linear):
            return self.text_projection(x)
        return x @ self.text_projection


class HFTextTower(TextTower):
    """A Hugging Face encoder as open_clip's text tower (BERT/MiniLM, e.g. the bundled raysim-clip).
    The learned context replaces word embeddings; the encoder adds its own position and type embeddings,
    attends bidirectionally under the padding mask, and open_clip's pooler and projection follow."""

    encoder: Any  # the transformers encoder inside open_clip's HFTextEncoder
    pooler: nn.Module
    proj: nn.Module
    pad_id: int

    def __init__(self, clip: OpenClipModule, model_name: str) -> None:
        super().__init__()
        enc = clip.text
        self.encoder = enc.transformer
        self.pooler = enc.pooler
        self.proj = enc.proj
        self.pad_id = int(enc.config.pad_token_id)
        self.word_embeddings = self.encoder.get_input_embeddings()
        self.embed_dim = int(clip.text_projection.shape[1]) if hasattr(clip, "text_projection") else int(
            self.proj(torch.zeros(1, enc.config.hidden_size)).shape[-1]
        )
        self._finish(clip, model_name)

    def meta(self, tokens: Tensor) -> Tensor:
        return (tokens != self.pad_id).long()

    def end_token_id(self) -> int:
        t = self.tokenize([""])[0]
        return int(t[int((t != self.pad_id).sum()) - 1])  # [SEP] after an empty text

    def meta_from_embeddings(self, embeds: Tensor) -> Tensor:
        return self.meta_from_ends(embeds, self.end_positions(embeds))

    def end_index(self, tokens: Tensor) -> Tensor:
        return (tokens != self.pad_id).long().sum(-1) - 1  # the last unpadded token ([SEP])

    def meta_from_ends(self, embeds: Tensor, ends: Tensor) -> Tensor:
        end = ends.long().to(embeds.device)
        return (torch.arange(embeds.shape[1], device=end.device)[None] <= end[:, None]).long()

    def forward(self, embeds: Tensor, mask: Tensor) -> Tensor:
        t = int(mask.sum(-1).max().item())  # padding is masked out: cutting it changes nothing
        mask = mask[:, :t].to(embeds.device)
        return self._run_fast(embeds[:, :t], mask, mask)

    def run(self, x: Tensor, mask: Tensor | None, index: Tensor) -> Tensor:
        # transformers builds the encoder with attn_implementation="sdpa" where torch has it (README "GPUs")
        out = self.encoder(inputs_embeds=x, attention_mask=mask)
        return self.proj(self.pooler(out, mask))


def build_text_tower(clip: OpenClipModule, model_name: str) -> TextTower:
    if hasattr(clip, "token_embedding"):
        return CausalTextTower(clip, model_name)
    if hasattr(clip, "text") and hasattr(clip.text, "transformer"):
        return HFTextTower(clip, model_name)
    raise ConfigError(f"{model_name}: its text tower is neither open_clip's transformer nor a Hugging Face encoder")


class CoOpPrompts(nn.Module):
    """CoOp prompts "X X ... X <classname>." with the L placeholder embeddings replaced by learned
    context vectors (SPEC 1.1: end position, underscores to spaces). Holds the frozen prefix (SOT)
    and suffix (class tokens, ".", EOT, padding) per class."""

    # buffers
    prefix: Tensor
    suffix: Tensor
    meta: Tensor
    placeholder: Tensor
    init_ctx: Tensor  # only with ctx_init

    def __init__(self, tower: TextTower, classnames: Sequence[str], n_ctx: int, ctx_init: str = "") -> None:
        super().__init__()
        self.tower = tower
        self.n_ctx = n_ctx
        self.ctx_init = ctx_init
        names = [c.replace("_", " ") for c in classnames]
        tokens = tower.tokenize([" ".join(["X"] * n_ctx) + " " + n + "." for n in names])
        placeholder = tower.tokenize(["X"])[0, 1]
        if not bool((tokens[:, 1 : 1 + n_ctx] == placeholder).all()):
            raise ConfigError("the tokenizer does not put the n_ctx placeholders at positions 1..n_ctx; lower n_ctx")
        emb = tower.embed_tokens(tokens)
        self.register_buffer("prefix", emb[:, :1].clone(), persistent=False)
        self.register_buffer("suffix", emb[:, 1 + n_ctx :].clone(), persistent=False)
        self.register_buffer("meta", tower.meta(tokens), persistent=False)
        self.register_buffer("placeholder", emb[:, 1 : 1 + n_ctx].clone(), persistent=False)
        self.num_classes = len(names)
        if ctx_init:  # CoOp's CTX_INIT: start the context from the embeddings of a phrase
            init = tower.tokenize([ctx_init])
            if not bool((tower.meta(tower.tokenize([" ".join(["X"] * n_ctx)])) == tower.meta(init)).all()):
                phrase = f"{ctx_init[:60]!r}{'...' if len(ctx_init) > 60 else ''}"
                raise ConfigError(f"ctx_init {phrase} must have exactly n_ctx={n_ctx} tokens; change n_ctx or the phrase")
            self.register_buffer("init_ctx", tower.embed_tokens(init)[0, 1 : 1 + n_ctx].clone(), persistent=False)

    def initial_context(self, rng: torch.Generator) -> Tensor:
        """(L, w) starting context: the ctx_init phrase's embeddings, or N(0, 0.02^2) (SPEC 1.1)."""
        if self.ctx_init:
            return self.init_ctx.detach().cpu().clone()
        return torch.randn(self.n_ctx, self.tower.width, generator=rng) * 0.02

    def embeddings(self, ctx: Tensor, per_class: bool = False) -> Tensor:
        """Full prompt embeddings (..., C, T, w) from context vectors: shared across classes, ctx of shape
        (..., L, w) (one context, or M stacked ones); or class-specific with per_class=True, (..., C, L, w)."""
        C = self.num_classes
        if not per_class:
            ctx = ctx.unsqueeze(-3).expand(*ctx.shape[:-2], C, *ctx.shape[-2:])
        elif ctx.shape[-3] != C:
            raise ValueError(f"class-specific context needs {C} rows at dim -3, got shape {tuple(ctx.shape)}")
        lead = ctx.shape[:-3]
        prefix = self.prefix.expand(*lead, *self.prefix.shape)
        suffix = self.suffix.expand(*lead, *self.suffix.shape)
        return torch.cat([prefix, ctx.to(self.prefix.dtype), suffix], dim=-2)

    def text_features(self, ctx: Tensor, normalize: bool = True, per_class: bool = False) -> Tensor:
        """(..., C, embed_dim) text features of every class for the given context vectors."""
        emb = self.embeddings(ctx, per_class=per_class)
        lead = emb.shape[:-3]
        flat = emb.reshape(-1, *emb.shape[-2:])
        reps = flat.shape[0] // self.num_classes
        meta = self.meta.repeat(reps, *([1] * (self.meta.dim() - 1)))
        out = self.tower(flat, meta).reshape(*lead, self.num_classes, -1)
        return F.normalize(out, dim=-1) if normalize else out

    def plain_text_features(self) -> Tensor:
        """Text features of the untouched "X X ... X class." prompts (no learned context)."""
        with torch.no_grad():
            return self.text_features(self.placeholder, per_class=True)


@dataclass
class ClipEnv:
    """What a CLIP prompt-tuning method needs on a host: the frozen text tower and the prompts."""

    tower: TextTower
    prompts: CoOpPrompts
    classnames: list[str]
    logit_scale: float
    device: torch.device
    feature_dim: int
    token_dim: int = 0  # width of the image tower's tokens (`token_site`); 0 where raysim cannot read them
    token_head: TokenHead | None = None  # per-token map into the embedding space, built on request (build_clip_env)

    @functools.cached_property
    def plain_text(self) -> Tensor:
        """The features of the untouched "X X ... X class." prompts (FedPGP's t0): constant, computed once per env."""
        return self.prompts.plain_text_features()

    @property
    def ctx_width(self) -> int:
        return self.tower.width


def build_clip_env(spec: ModelSpec, classnames: Sequence[str], n_ctx: int, device: str | torch.device = "cpu",
                   ctx_init: str = "", token_head: bool = False) -> ClipEnv:
    """The frozen text side and CoOp prompts; `token_head=True` also keeps the image tower's per-token
    map (`TokenHead`; raises ConfigError for a tower it does not know)."""
    clip = load_clip(spec, device="cpu")
    tower = build_text_tower(clip, spec.model).to(device)
    tower.set_fast_paths(spec.fast, device)
    prompts = CoOpPrompts(tower, classnames, n_ctx, ctx_init).to(device)
    try:
        token_dim = token_site(clip.visual)[2]
    except ConfigError:
        token_dim = 0
    return ClipEnv(
        tower=tower,
        prompts=prompts,
        classnames=list(classnames),
        logit_scale=tower.logit_scale,
        device=torch.device(device),
        feature_dim=tower.embed_dim,
        token_dim=token_dim,
        token_head=TokenHead(clip.visual).to(device) if token_head else None,
    )


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("execution.device=cuda but no GPU is visible here; use execution.device=auto or execution.device=cpu")
    return torch.device(device)
