"""The heterogeneous client model zoo of FedTSP / HtFLlib (SPEC 2.5), trained from scratch.

Every client model is `feature extractor -> AdaptiveAvgPool1d(d) -> Linear(d, C)`: the extractor's pooled
feature vector (any width) is averaged/repeated to the common width d (512 for CLIP runs, the PLM's width
for BERT runs), and the head is the client's personalised classifier. Client i of a family of X models
gets model i mod X.

ResNet-n is a torchvision-style ResNet (7x7 stride-2 stem and max-pool even at 32x32, BN, Kaiming init)
with a variable number of stages: ResNet-4/6/8/10 use one BasicBlock in each of 1/2/3/4 stages.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from raysim.errors import ConfigError

RESNET_LAYERS: dict[int, tuple[str, tuple[int, ...]]] = {
    4: ("basic", (1,)),
    6: ("basic", (1, 1)),
    8: ("basic", (1, 1, 1)),
    10: ("basic", (1, 1, 1, 1)),
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
}

TV_RESNETS = tuple(f"tv_resnet{n}" for n in (18, 34, 50, 101, 152))  # torchvision's own ResNet classes

FAMILIES: dict[str, tuple[str, ...]] = {
    "HtFE2": ("fedavgcnn", "resnet18"),
    "HtFE3": ("resnet10", "resnet18", "resnet34"),
    "HtFE4": ("fedavgcnn", "googlenet", "mobilenet_v2", "resnet18"),
    "HtFE9": tuple(f"resnet{n}" for n in (4, 6, 8, 10, 18, 34, 50, 101, 152)),
    # not in the paper: two small, different architectures for tests and quick benchmarks
    "tiny": ("cnn_tiny", "resnet4"),
    # HtFLlib's families by its own names (system/main.py args.models): the torchvision ResNets, GoogLeNet and
    # HtFLlib's MobileNetV2 (Dropout(0.2) kept before the replaced fc) as HtFLlib builds them, FedAvgCNN at its
    # 32x32 flatten width 1600; resnet4..10 are HtFLlib's own small ResNets (the ResNetN above)
    "HtFE-img-2": ("fedavgcnn", "tv_resnet18"),
    "HtFE-img-3": ("resnet10", "tv_resnet18", "tv_resnet34"),
    "HtFE-img-4": ("fedavgcnn", "googlenet", "htfllib_mobilenet_v2", "tv_resnet18"),
    "HtFE-img-5": ("googlenet", "htfllib_mobilenet_v2", "tv_resnet18", "tv_resnet34", "tv_resnet50"),
    "HtFE-img-8": ("fedavgcnn", "googlenet", "htfllib_mobilenet_v2", *(f"tv_resnet{n}" for n in (18, 34, 50, 101, 152))),
    "HtFE-img-9": (*(f"resnet{n}" for n in (4, 6, 8, 10)), *(f"tv_resnet{n}" for n in (18, 34, 50, 101, 152))),
    # PFLlib's / HtFLlib's model for one-channel 28x28 images (MNIST, FMNIST): FedAvgCNN(in_features=1, dim=1024)
    "FedAvgCNN-1x28": ("fedavgcnn_1x28",),
}


class FedAvgCNN(nn.Module):
    """conv5x5(in->c1), ReLU, maxpool2; conv5x5(c1->c2), ReLU, maxpool2; flatten; Linear(->hidden), ReLU.
    With the defaults (32, 64, 512) the flatten width is 1600 at 32x32, 10816 at 64x64 and 1024 at 28x28
    (one channel: PFLlib's MNIST model)."""

    def __init__(self, image_size: int = 32, widths: tuple[int, int] = (32, 64), hidden: int = 512, in_channels: int = 3) -> None:
        super().__init__()
        s = ((image_size - 4) // 2 - 4) // 2
        if s < 1:
            raise ConfigError(f"FedAvgCNN needs images of at least 16x16, got {image_size}")
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 5), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(widths[0], widths[1], 5), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.fc = nn.Sequential(nn.Linear(widths[1] * s * s, hidden), nn.ReLU(inplace=True))
        self.out_dim = hidden

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.conv(x))


class ResNetN(nn.Module):
    """torchvision's ResNet layout with 1-4 stages (widths 64/128/256/512), ending at global average pooling."""

    def __init__(self, block: str, layers: Sequence[int]) -> None:
        super().__init__()
        from torchvision.models.resnet import BasicBlock, Bottleneck

        blk = BasicBlock if block == "basic" else Bottleneck
        self.inplanes = 64
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages = []
        for i, n in enumerate(layers):
            stages.append(self._stage(blk, 64 * 2**i, n, stride=1 if i == 0 else 2))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.out_dim = 64 * 2 ** (len(layers) - 1) * blk.expansion
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _stage(self, blk, planes: int, n: int, stride: int) -> nn.Sequential:
        down = None
        if stride != 1 or self.inplanes != planes * blk.expansion:
            down = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * blk.expansion, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * blk.expansion),
            )
        layers = [blk(self.inplanes, planes, stride, down)]
        self.inplanes = planes * blk.expansion
        layers += [blk(self.inplanes, planes) for _ in range(1, n)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return torch.flatten(self.pool(self.stages(self.stem(x))), 1)


class _Torchvision(nn.Module):
    """A torchvision classifier with its last layer removed (random init)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        import torchvision.models as tvm

        if name == "googlenet":
            net = tvm.googlenet(weights=None, aux_logits=False, init_weights=True)
            self.out_dim = net.fc.in_features
            net.fc = nn.Identity()
        elif name == "mobilenet_v2":
            net = tvm.mobilenet_v2(weights=None)
            self.out_dim = net.classifier[-1].in_features
            net.classifier = nn.Identity()
        elif name == "htfllib_mobilenet_v2":
            # HtFLlib's MobileNetV2 (flcore/trainmodel/mobilenet_v2.py) is torchvision's layout with the classifier
            # split into .dropout and .fc; BaseHeadSplit replaces .fc only, so its base ends in Dropout(0.2)
            net = tvm.mobilenet_v2(weights=None)
            self.out_dim = net.classifier[-1].in_features
            net.classifier = net.classifier[0]
        elif name.startswith("tv_resnet") and name[9:] in ("18", "34", "50", "101", "152"):
            net = getattr(tvm, name[3:])(weights=None)  # torchvision.models.resnetN(pretrained=False), as HtFLlib
            self.out_dim = net.fc.in_features
            net.fc = nn.Identity()
        else:  # pragma: no cover - guarded by build_extractor
            raise ConfigError(name)
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def build_extractor(name: str, image_size: int = 32) -> nn.Module:
    """A feature extractor by name; `.out_dim` is the width of its pooled feature."""
    name = name.lower()
    if name == "fedavgcnn":
        return FedAvgCNN(image_size)
    if name == "fedavgcnn_1x28":
        return FedAvgCNN(28, in_channels=1)  # its input size is fixed: one channel at 28x28
    if name == "cnn_tiny":
        return FedAvgCNN(image_size, widths=(8, 16), hidden=64)
    if name.startswith("resnet") and name[6:].isdigit() and int(name[6:]) in RESNET_LAYERS:
        block, layers = RESNET_LAYERS[int(name[6:])]
        return ResNetN(block, layers)
    if name in ("googlenet", "mobilenet_v2", "htfllib_mobilenet_v2") or name in TV_RESNETS:
        return _Torchvision(name)
    raise ConfigError(
        f"unknown client model {name!r}; known: fedavgcnn, fedavgcnn_1x28, cnn_tiny, googlenet, mobilenet_v2, "
        "htfllib_mobilenet_v2, " + ", ".join([*(f"resnet{n}" for n in RESNET_LAYERS), *TV_RESNETS])
    )


class HtModel(nn.Module):
    """extractor -> AdaptiveAvgPool1d(d) (the common feature f(x)) -> personalised Linear(d, C) head."""

    def __init__(self, arch: str, feature_dim: int, num_classes: int, image_size: int = 32) -> None:
        super().__init__()
        self.arch = arch
        self.base = build_extractor(arch, image_size)
        self.pool = nn.AdaptiveAvgPool1d(feature_dim)
        self.head = nn.Linear(feature_dim, num_classes)
        self.feature_dim = feature_dim

    def features(self, x: Tensor) -> Tensor:
        return self.pool(self.base(x).unsqueeze(1)).squeeze(1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(features (N, d), logits (N, C))."""
        f = self.features(x)
        return f, self.head(f)


def family(name: str) -> tuple[str, ...]:
    for k, v in FAMILIES.items():
        if k.lower() == name.lower():
            return v
    raise ConfigError(f"unknown model family {name!r}; choose one of {', '.join(FAMILIES)}")


def arch_of(family_name: str, client_id: int) -> str:
    """Client i gets model i mod X of its family."""
    archs = family(family_name)
    return archs[client_id % len(archs)]


# the architectures with a dropout layer in train mode (its masks are drawn from torch's global RNG):
# tests/models/test_zoo.py checks the list against the built models
DROPOUT_ARCHS: frozenset[str] = frozenset({"googlenet", "htfllib_mobilenet_v2"})


def uses_global_rng(family_name: str = "", arch: str = "") -> bool:
    """Whether a model of the family (or, with no family, the architecture `arch`) draws from torch's global
    RNG when it trains (a dropout layer)."""
    archs = family(family_name) if family_name else (arch.lower(),)
    return any(a in DROPOUT_ARCHS for a in archs)


def make_client_model(arch: str, feature_dim: int, num_classes: int, *, image_size: int = 32, seed: int = 0) -> HtModel:
    """A freshly initialised client model; the init is a function of `seed` only (global RNG untouched, and
    held under raysim.sampling's lock: models built at once on a host's client threads get their own inits)."""
    from raysim.sampling import seeded_global_rng

    with seeded_global_rng(seed):
        return HtModel(arch, feature_dim, num_classes, image_size)


__all__: list[str] = [
    "DROPOUT_ARCHS", "FAMILIES", "FedAvgCNN", "HtModel", "ResNetN", "arch_of", "build_extractor", "family", "make_client_model",
    "uses_global_rng",
]
