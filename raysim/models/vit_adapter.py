"""VPDR's client model (SPEC 3.6): a frozen backbone with a residual bottleneck adapter after every
block, a frozen random projection to 512 and a trainable MLP head.

    h_l <- h_l + W_up drop_0.1(ReLU(W_down h_l))      after every block l (no biases, W_up = 0 at init)
    z    = P(mean of the patch tokens after the final LayerNorm)     P: Linear(embed -> 512), frozen, seeded
    logits = head(z)                                   head: 512 -> 512 -> ReLU -> Dropout 0.1 -> C

Only the adapters and the head train. The frozen backbone is shared by every client a host holds (one
module per host: `Backbone`), so a client's model is its adapters and head (`ViTAdapterNet`), whose
`trainable_state()` is all the client keeps.

Backbones (`load_backbone(spec)`):

- ``raysim-vit`` (default, offline): a small ViT this project pretrains and ships
  (`raysim/assets/raysim-vit/`, written by `raysim.tools.pretrain_vit`): an open_clip ViT image tower;
- a local folder holding a `transformers` ViTModel (``config.json`` + weights), e.g.
  ``vit-base-patch16-224-in21k``: any ViT the user has;
- ``open_clip:NAME[:TAG]``: the visual tower of an open_clip model (TAG a pretrained tag or a checkpoint path);
- ``resnet18`` / ``resnet34`` (optionally ``resnet18:PATH`` to a torchvision state dict): a torchvision ResNet,
  random and frozen without weights (SPEC 3.6 "ResNet-18 option ... pretrained=False"), with conv adapters
  (1x1, dim 64) after every BasicBlock and the pooled 512 channels as the token mean.

Heterogeneous settings (client i gets config i mod 4, SPEC 3.6): `HETERO` below.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from raysim.errors import ConfigError, one_line, shown

BUNDLED_VIT = "raysim-vit"
VIT_ASSET_DIR = Path(__file__).resolve().parents[1] / "assets" / BUNDLED_VIT
MAX_HF_CONFIG_BYTES = 1 << 20  # a transformers config.json is a few KB
MAX_IMAGE_SIZE = 4096
FEATURE_DIM = 512
# adapter bottleneck width by ViT width (SPEC 3.6: 8 tiny, 16 small, 32 base); others: embed // 24, at least 8
ADAPTER_DIM_BY_WIDTH = {192: 8, 384: 16, 768: 32}
CONV_ADAPTER_DIM = 64  # heterogeneous models (SPEC 3.6: "adapter dim 64")

# SPEC 3.6 heterogeneous settings: (backbone, head hidden sizes) for client i mod 4
HETERO: dict[str, tuple[tuple[str, tuple[int, ...]], ...]] = {
    "HtFE4": (("resnet18", (512,)), ("resnet34", (512,)), ("vit-tiny", (512,)), ("vit-small", (512,))),
    "HtC4": (("resnet18", (512,)), ("resnet18", (512, 256)), ("resnet18", (512, 256, 128)), ("resnet18", (1024, 512))),
    "HtFE4-HtC2": (("resnet18", (512,)), ("resnet34", (512, 256)), ("vit-tiny", (512,)), ("vit-small", (512, 256))),
}


def adapter_dim_for(width: int) -> int:
    return ADAPTER_DIM_BY_WIDTH.get(int(width), max(8, int(width) // 24))


# ----------------------------------------------------------------------------------------------- adapters
class Adapter(nn.Module):
    """h + W_up drop(ReLU(W_down h)) over the last dimension; no biases; W_up = 0 at init (identity)."""

    def __init__(self, dim: int, bottleneck: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.down = nn.Linear(dim, bottleneck, bias=False)
        self.up = nn.Linear(bottleneck, dim, bias=False)
        self.drop = nn.Dropout(dropout)
        nn.init.zeros_(self.up.weight)

    def forward(self, h: Tensor) -> Tensor:
        return h + self.up(self.drop(torch.relu(self.down(h))))


class ConvAdapter(nn.Module):
    """The same bottleneck over the channels of a (B, C, H, W) map (1x1 convs, no biases, up = 0 at init)."""

    def __init__(self, channels: int, bottleneck: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.down = nn.Conv2d(channels, bottleneck, 1, bias=False)
        self.up = nn.Conv2d(bottleneck, channels, 1, bias=False)
        self.drop = nn.Dropout(dropout)
        nn.init.zeros_(self.up.weight)

    def forward(self, h: Tensor) -> Tensor:
        return h + self.up(self.drop(torch.relu(self.down(h))))


# ----------------------------------------------------------------------------------------------- backbones
class Backbone(nn.Module):
    """A frozen feature extractor with a hook after every block that applies `self.adapters[i]` (the
    adapters of the client model running now; none = the plain backbone). `forward(x)` is the mean of the
    patch tokens after the final LayerNorm, (B, embed_dim)."""

    kind: str = "vit"  # "vit" (token adapters) or "conv" (channel adapters)

    def __init__(self, *, embed_dim: int, block_dims: Sequence[int], image_size: int, name: str) -> None:
        super().__init__()
        self.embed_dim = int(embed_dim)
        self.block_dims = [int(d) for d in block_dims]
        self.image_size = int(image_size)
        self.name = name
        self.adapters: Optional[nn.ModuleList] = None

    def hook_blocks(self, blocks: Sequence[nn.Module]) -> None:
        for i, blk in enumerate(blocks):
            blk.register_forward_hook(self._make_hook(i))

    def _make_hook(self, i: int) -> Callable[..., Any]:
        def hook(module: nn.Module, inputs: Any, out: Any) -> Any:
            if self.adapters is None:
                return None
            if isinstance(out, tuple):  # transformers < 5: (hidden_states, ...)
                return (self.adapters[i](out[0]),) + tuple(out[1:])
            return self.adapters[i](out)
        return hook

    def freeze(self) -> "Backbone":
        for p in self.parameters():
            p.requires_grad_(False)
        self.eval()
        return self

    def train(self, mode: bool = True) -> "Backbone":  # frozen: always in eval mode (no dropout, fixed BN)
        return super().train(False)

    def make_adapters(self, bottleneck: int, dropout: float = 0.1) -> nn.ModuleList:
        cls = ConvAdapter if self.kind == "conv" else Adapter
        return nn.ModuleList([cls(d, bottleneck, dropout) for d in self.block_dims])

    def default_adapter_dim(self) -> int:
        return CONV_ADAPTER_DIM if self.kind == "conv" else adapter_dim_for(self.embed_dim)


class HFViT(Backbone):
    """A `transformers` ViTModel (from a local folder, or a config for a random one)."""

    def __init__(self, model: Any, name: str) -> None:
        cfg = model.config
        super().__init__(embed_dim=cfg.hidden_size, block_dims=[cfg.hidden_size] * cfg.num_hidden_layers,
                         image_size=cfg.image_size, name=name)
        self.vit = model
        layers = getattr(model, "layers", None)
        if layers is None:  # transformers < 5
            layers = model.encoder.layer
        self.hook_blocks(list(layers))
        self.freeze()

    def forward(self, x: Tensor) -> Tensor:
        out = self.vit(pixel_values=x)
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # after the final LayerNorm
        return h[:, 1:].mean(dim=1)  # mean of the patch tokens (CLS excluded)


class OpenClipViT(Backbone):
    """The visual tower of an open_clip model (its resblocks hooked; tokens after ln_post)."""

    def __init__(self, visual: Any, name: str) -> None:
        blocks = list(visual.transformer.resblocks)
        width = int(visual.transformer.width)
        size = visual.image_size
        size = int(size[0] if isinstance(size, (list, tuple)) else size)
        super().__init__(embed_dim=width, block_dims=[width] * len(blocks), image_size=size, name=name)
        self.visual = visual
        self.visual.output_tokens = True
        self.hook_blocks(blocks)
        self.freeze()

    def forward(self, x: Tensor) -> Tensor:
        out = self.visual(x)
        tokens = out[1] if isinstance(out, tuple) else out
        return tokens.mean(dim=1)


class TorchvisionResNet(Backbone):
    """A torchvision ResNet (random and frozen unless a state dict is given) with a channel adapter after
    every BasicBlock; the token mean is the global average pool of the last stage (512 channels)."""

    kind = "conv"

    def __init__(self, arch: str, weights: str = "", image_size: int = 32, seed: int = 0) -> None:
        import torchvision

        if arch not in ("resnet18", "resnet34"):
            raise ConfigError(f"ResNet backbone must be resnet18 or resnet34, got {arch!r}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # a fixed random frozen backbone, the same on every host
            net = getattr(torchvision.models, arch)(weights=None)
        if weights:
            path = Path(os.path.expanduser(weights))
            if not path.is_file():
                raise ConfigError(f"{arch} weights {str(path)!r} not found; give a torchvision state dict (.pth)")
            try:
                net.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            except Exception as e:  # not a state dict of this architecture (any error reading it)
                raise ConfigError(f"{arch} weights {shown(str(path))} cannot be loaded ({type(e).__name__}: "
                                  f"{one_line(str(e), 120) or 'no details'}); give a torchvision state dict (.pth)") from None
        blocks = [b for stage in (net.layer1, net.layer2, net.layer3, net.layer4) for b in stage]
        dims = [b.conv2.out_channels for b in blocks]
        super().__init__(embed_dim=512, block_dims=dims, image_size=image_size, name=arch + (f":{weights}" if weights else ""))
        net.fc = nn.Identity()
        self.net = net
        self.hook_blocks(blocks)
        self.freeze()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def hf_config_of(folder: str | os.PathLike) -> dict[str, Any]:
    path = Path(os.path.expanduser(str(folder))) / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"backbone {str(folder)!r}: no config.json there. Give a local folder holding a transformers ViTModel "
            f"(e.g. a download of google/vit-base-patch16-224-in21k), open_clip:NAME[:TAG], resnet18 or {BUNDLED_VIT}"
        )
    from raysim.safeio import read_regular

    raw = read_regular(path, max_bytes=MAX_HF_CONFIG_BYTES, error=ConfigError, what=f"backbone config {str(path)!r}")
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # not JSON, an integer of thousands of digits, too deep
        raise ConfigError(f"backbone config {shown(str(path))} cannot be read as JSON ({type(e).__name__}: "
                          f"{one_line(str(e), 120)}); give the folder of a transformers ViTModel") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"backbone config {shown(str(path))} must hold a JSON object, got {shown(cfg)}")
    return cfg


def _image_size(cfg: dict[str, Any], where: str) -> int:
    size = cfg.get("image_size", 224)
    size = size[0] if isinstance(size, (list, tuple)) and size else size
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_IMAGE_SIZE:
        raise ConfigError(f"{where}: image_size must be an integer in [1, {MAX_IMAGE_SIZE}], got {shown(size)}")
    return size


def backbone_image_size(spec: str) -> int:
    """The input size of backbone `spec` without loading its weights."""
    spec = spec.strip()
    if spec == BUNDLED_VIT:
        return int(_bundled_config()["vision_cfg"]["image_size"])
    if spec.startswith("open_clip:"):
        import open_clip

        name = spec.split(":")[1]
        cfg = open_clip.get_model_config(name)
        if cfg is None:
            raise ConfigError(f"backbone {spec!r}: open_clip has no model {name!r}")
        size = cfg["vision_cfg"].get("image_size", 224)
        return int(size[0] if isinstance(size, (list, tuple)) else size)
    if spec.split(":")[0] in ("resnet18", "resnet34"):
        return 32
    return _image_size(hf_config_of(spec), f"backbone {shown(spec)} config.json")


def load_backbone(spec: str, *, image_size: int = 32, seed: int = 0) -> Backbone:
    """The frozen backbone named by `spec` (see the module docstring)."""
    spec = spec.strip()
    if spec == BUNDLED_VIT:
        return bundled_vit()
    if spec.startswith("open_clip:"):
        import open_clip

        from raysim.models.clip import register_builtin_configs

        register_builtin_configs()
        _, name, *tag = spec.split(":", 2)
        model = open_clip.create_model(name, pretrained=(tag[0] or None) if tag else None)
        return OpenClipViT(model.visual, spec)
    arch, _, weights = spec.partition(":")
    if arch in ("resnet18", "resnet34"):
        return TorchvisionResNet(arch, weights, image_size=image_size, seed=seed)
    return _hf(Path(os.path.expanduser(spec)), spec)


def _bundled_config() -> dict[str, Any]:
    path = VIT_ASSET_DIR / "config.json"
    if not path.is_file():
        raise ConfigError(f"the shipped {BUNDLED_VIT} backbone is missing ({path}); remake it with python -m raysim.tools.pretrain_vit")
    return json.loads(path.read_text())


def bundled_vit() -> OpenClipViT:
    """The shipped raysim-vit: an open_clip ViT image tower (config.json + visual.pt, raysim/tools/pretrain_vit.py)."""
    from open_clip.model import _build_vision_tower

    cfg = _bundled_config()
    with torch.random.fork_rng(devices=[]):
        visual = _build_vision_tower(cfg["embed_dim"], cfg["vision_cfg"])
    visual.load_state_dict(torch.load(VIT_ASSET_DIR / "visual.pt", map_location="cpu", weights_only=True))
    return OpenClipViT(visual.float(), BUNDLED_VIT)


def _hf(folder: Path, name: str) -> HFViT:
    hf_config_of(folder)  # the helpful error when it is not a model folder
    from transformers import ViTModel
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "some weights not used" (pooler) is expected
    try:
        model = ViTModel.from_pretrained(str(folder), add_pooling_layer=False)
    finally:
        hf_logging.set_verbosity(level)
    return HFViT(model, name)


def random_hf_vit(*, image_size: int = 32, patch_size: int = 4, width: int = 64, layers: int = 2, heads: int = 4,
                  seed: int = 0) -> HFViT:
    """A random HF ViT (tests, and the starting point of `vit_pretrain`)."""
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(image_size=image_size, patch_size=patch_size, hidden_size=width, num_hidden_layers=layers,
                    num_attention_heads=heads, intermediate_size=2 * width, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ViTModel(cfg, add_pooling_layer=False)
    return HFViT(model, f"random-vit-{width}x{layers}")


# ----------------------------------------------------------------------------------------------- the client model
@dataclass(frozen=True)
class ModelConfig:
    """What a client's model is: its backbone (by spec), head hidden sizes and adapter width."""

    backbone: str = BUNDLED_VIT
    head: tuple[int, ...] = (512,)
    adapter_dim: int = 0  # 0 = by backbone (8 / 16 / 32 for ViT tiny / small / base; 64 for ResNets)


class ViTAdapterNet(nn.Module):
    """A client's trainable parts (adapters + head) and the frozen projection, on a shared frozen `Backbone`.

    `features(x)` is z = P(token mean) (512-d); `forward(x)` gives (z, head(z)); `head_logits(z)` runs
    the head alone (DCR feeds it soft-clipped features). `trainable_state()` / `load_trainable()` move the
    client's own weights (the backbone and the seeded projection are rebuilt, never stored)."""

    backbone: Backbone  # shared and frozen, set with object.__setattr__ (not a submodule)

    def __init__(self, backbone: Backbone, num_classes: int, *, head: Sequence[int] = (512,), adapter_dim: int = 0,
                 feature_dim: int = FEATURE_DIM, proj_seed: int = 0, init_seed: int = 0, dropout: float = 0.1) -> None:
        super().__init__()
        object.__setattr__(self, "backbone", backbone)  # shared and frozen: not a submodule (not in state_dict)
        dim = int(adapter_dim) or backbone.default_adapter_dim()
        gen = torch.Generator().manual_seed(int(proj_seed))
        proj = nn.Linear(backbone.embed_dim, feature_dim)
        bound = 1.0 / backbone.embed_dim ** 0.5  # nn.Linear's default init, drawn from the seeded stream
        with torch.no_grad():
            proj.weight.uniform_(-bound, bound, generator=gen)
            proj.bias.uniform_(-bound, bound, generator=gen)
        proj.requires_grad_(False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(init_seed))
            self.adapters = backbone.make_adapters(dim, dropout)
            layers: list[nn.Module] = []
            prev = feature_dim
            for h in head:
                layers += [nn.Linear(prev, int(h)), nn.ReLU(), nn.Dropout(dropout)]
                prev = int(h)
            layers.append(nn.Linear(prev, num_classes))
            self.head = nn.Sequential(*layers)
        self.proj = proj
        self.adapter_dim = dim
        self.feature_dim = feature_dim

    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self.adapters.parameters()) + list(self.head.parameters())

    def trainable_state(self) -> dict[str, Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.state_dict().items() if not k.startswith("proj.")}

    def load_trainable(self, state: dict[str, Tensor]) -> None:
        missing = self.load_state_dict(state, strict=False)
        bad = [k for k in missing.missing_keys if not k.startswith("proj.")] + list(missing.unexpected_keys)
        if bad:
            raise RuntimeError(f"client model state does not fit: {bad[:5]}")

    def backbone_features(self, x: Tensor) -> Tensor:
        """The frozen backbone's token mean without this client's adapters (MPFT's backbone path), (B, embed)."""
        self.backbone.adapters = None
        return self.backbone(x)

    def features(self, x: Tensor) -> Tensor:
        self.backbone.adapters = self.adapters
        try:
            t = self.backbone(x)
        finally:
            self.backbone.adapters = None
        return self.proj(t)

    def head_logits(self, z: Tensor) -> Tensor:
        return self.head(z)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        z = self.features(x)
        return z, self.head(z)


def client_model_config(*, backbone: str, hetero: str, client_id: int, head: Sequence[int] = (512,), adapter_dim: int = 0,
                        vit_tiny: str = BUNDLED_VIT, vit_small: str = BUNDLED_VIT, resnet_weights: str = "") -> ModelConfig:
    """Client `client_id`'s model: the homogeneous `backbone` (hetero = "") or config i mod 4 of a SPEC 3.6
    heterogeneous setting, where vit-tiny / vit-small name `vit_tiny` / `vit_small` (the shipped ViT offline)
    and the ResNets load `resnet_weights` (a folder of resnet18.pth / resnet34.pth) when given."""
    if not hetero:
        return ModelConfig(backbone, tuple(int(h) for h in head), int(adapter_dim))
    if hetero not in HETERO:
        raise ConfigError(f"hetero must be one of {', '.join(HETERO)} or empty, got {hetero!r}")
    kind, heads = HETERO[hetero][client_id % 4]
    if kind == "vit-tiny":
        spec = vit_tiny
    elif kind == "vit-small":
        spec = vit_small
    else:
        spec = kind + (f":{os.path.join(resnet_weights, kind + '.pth')}" if resnet_weights else "")
    return ModelConfig(spec, heads, CONV_ADAPTER_DIM if hetero else int(adapter_dim))
