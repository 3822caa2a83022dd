"""HtFLlib's model families by name (HtFE-img-2 .. HtFE-img-9): each builds for 3-channel 32x32 input, its base
(extractor + AdaptiveAvgPool1d) gives feature_dim wide features, client i gets model i mod X; HtFLlib's
own layer choices (its MobileNetV2 keeps Dropout before the replaced fc; torchvision's ResNet classes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raysim.models.zoo import FAMILIES, arch_of, build_extractor, make_client_model

HTFLLIB = {  # system/main.py args.models, by architecture
    "HtFE-img-2": ("fedavgcnn", "tv_resnet18"),
    "HtFE-img-3": ("resnet10", "tv_resnet18", "tv_resnet34"),
    "HtFE-img-4": ("fedavgcnn", "googlenet", "htfllib_mobilenet_v2", "tv_resnet18"),
    "HtFE-img-5": ("googlenet", "htfllib_mobilenet_v2", "tv_resnet18", "tv_resnet34", "tv_resnet50"),
    "HtFE-img-8": ("fedavgcnn", "googlenet", "htfllib_mobilenet_v2", "tv_resnet18", "tv_resnet34", "tv_resnet50",
                   "tv_resnet101", "tv_resnet152"),
    "HtFE-img-9": ("resnet4", "resnet6", "resnet8", "resnet10", "tv_resnet18", "tv_resnet34", "tv_resnet50",
                   "tv_resnet101", "tv_resnet152"),
}


def test_families_list_htfllibs_models_in_its_order():
    for name, archs in HTFLLIB.items():
        assert FAMILIES[name] == archs
        assert [arch_of(name, i) for i in range(2 * len(archs) + 1)] == [archs[i % len(archs)] for i in range(2 * len(archs) + 1)]


@pytest.mark.parametrize("arch", sorted({a for f in HTFLLIB.values() for a in f}))
def test_each_model_builds_and_its_base_is_feature_dim_wide(arch):
    model = make_client_model(arch, 64, 7, image_size=32, seed=0).eval()
    with torch.no_grad():
        feats, logits = model(torch.randn(2, 3, 32, 32))
    assert feats.shape == (2, 64) and logits.shape == (2, 7)
    assert isinstance(model.head, nn.Linear) and model.head.in_features == 64


def test_htfllib_layer_choices():
    import torchvision.models as tvm

    mb = build_extractor("htfllib_mobilenet_v2")
    assert isinstance(mb.net.classifier, nn.Dropout) and mb.net.classifier.p == pytest.approx(0.2)  # a constant, not a computed float
    assert isinstance(build_extractor("mobilenet_v2").net.classifier, nn.Identity)  # raysim's HtFE4 keeps its own choice
    r18 = build_extractor("tv_resnet18")
    assert isinstance(r18.net, tvm.ResNet) and isinstance(r18.net.fc, nn.Identity) and r18.out_dim == 512
    assert build_extractor("tv_resnet50").out_dim == 2048
    cnn = build_extractor("fedavgcnn")
    assert cnn.fc[0].in_features == 1600  # FedAvgCNN(dim=1600) at 32x32


def test_one_channel_fedavgcnn_at_28x28():
    m = make_client_model("fedavgcnn_1x28", 512, 10, seed=0).eval()
    assert m.base.conv[0].in_channels == 1 and m.base.fc[0].in_features == 1024  # PFLlib's MNIST FedAvgCNN(dim=1024)
    with torch.no_grad():
        feats, logits = m(torch.randn(2, 1, 28, 28))
    assert feats.shape == (2, 512) and logits.shape == (2, 10)
    assert FAMILIES["FedAvgCNN-1x28"] == ("fedavgcnn_1x28",)
