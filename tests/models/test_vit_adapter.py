"""The VPDR client model (SPEC 3.6): adapters start as the identity, only adapters and head train, the
backbones load, and the heterogeneous settings give client i config i mod 4."""

from __future__ import annotations

import pytest
import torch

from raysim.errors import ConfigError
from raysim.models.vit_adapter import (
    BUNDLED_VIT,
    HETERO,
    VIT_ASSET_DIR,
    Adapter,
    ViTAdapterNet,
    adapter_dim_for,
    backbone_image_size,
    client_model_config,
    load_backbone,
    random_hf_vit,
)


@pytest.fixture(scope="module")
def tiny_vit():
    return random_hf_vit(width=32, layers=2, patch_size=8, heads=2, seed=3)


def test_adapter_is_the_identity_at_init_and_has_no_biases():
    a = Adapter(16, 4)
    assert a.down.bias is None and a.up.bias is None
    assert torch.count_nonzero(a.up.weight) == 0
    h = torch.randn(2, 5, 16)
    assert torch.equal(a.eval()(h), h)  # W_up = 0: exactly h + 0


def test_untrained_adapters_leave_the_backbone_feature_unchanged(tiny_vit):
    net = ViTAdapterNet(tiny_vit, 10, proj_seed=1, init_seed=2).eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        plain = net.proj(net.backbone_features(x))  # no adapters in the hooks
        adapted = net.features(x)
    assert torch.allclose(plain, adapted, atol=1e-6)  # same arithmetic up to float reassociation (exactly + 0)
    assert adapted.shape == (3, 512)


def test_only_adapters_and_head_receive_gradients(tiny_vit):
    net = ViTAdapterNet(tiny_vit, 10, init_seed=0).train()
    z, logits = net(torch.randn(4, 3, 32, 32))
    torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 2, 3])).backward()
    assert all(p.grad is None and not p.requires_grad for p in tiny_vit.parameters())  # frozen backbone
    assert all(p.grad is None and not p.requires_grad for p in net.proj.parameters())  # frozen random projection
    trainable = {id(p) for p in net.trainable_parameters()}
    assert trainable == {id(p) for p in net.parameters() if p.requires_grad}
    assert all(p.grad is not None for p in net.trainable_parameters())
    # W_down's gradient passes through W_up = 0, W_up's does not: after one step the adapters move
    assert all(float(a.up.weight.grad.abs().sum()) > 0 for a in net.adapters)
    before = [a.up.weight.detach().clone() for a in net.adapters]
    torch.optim.AdamW(net.trainable_parameters(), lr=1e-3, weight_decay=5e-4).step()
    assert all(not torch.equal(b, a.up.weight) for b, a in zip(before, net.adapters))
    tiny_vit.zero_grad(set_to_none=True)


def test_trainable_state_is_adapters_and_head_only_and_round_trips(tiny_vit):
    a = ViTAdapterNet(tiny_vit, 7, init_seed=0)
    b = ViTAdapterNet(tiny_vit, 7, init_seed=1)
    state = a.trainable_state()
    assert state and all(k.startswith(("adapters.", "head.")) for k in state)
    b.load_trainable(state)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(a.eval()(x)[1], b.eval()(x)[1])


def test_projection_is_seeded_and_the_head_is_512_512_C(tiny_vit):
    a, b = ViTAdapterNet(tiny_vit, 5, proj_seed=4, init_seed=0), ViTAdapterNet(tiny_vit, 5, proj_seed=4, init_seed=9)
    assert torch.equal(a.proj.weight, b.proj.weight)
    dims = [m.out_features for m in a.head if isinstance(m, torch.nn.Linear)]
    assert dims == [512, 5]
    assert any(isinstance(m, torch.nn.Dropout) and m.p == 0.1 for m in a.head)


def test_adapter_width_by_vit_size():
    assert (adapter_dim_for(192), adapter_dim_for(384), adapter_dim_for(768)) == (8, 16, 32)


def test_hf_folder_loads_and_a_wrong_folder_says_what_to_give(tmp_path, tiny_vit):
    tiny_vit.vit.save_pretrained(str(tmp_path / "vit"))
    bb = load_backbone(str(tmp_path / "vit"))
    assert bb.embed_dim == 32 and len(bb.block_dims) == 2 and backbone_image_size(str(tmp_path / "vit")) == 32
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(bb(x), tiny_vit(x), atol=1e-6)  # the same weights
    with pytest.raises(ConfigError, match="transformers ViTModel"):
        load_backbone(str(tmp_path / "nothing"))


def test_shipped_backbone_is_small_and_loads():
    size = sum(p.stat().st_size for p in VIT_ASSET_DIR.iterdir())
    assert size < 2 * 1024 * 1024
    bb = load_backbone(BUNDLED_VIT)
    assert bb.image_size == 32 and all(not p.requires_grad for p in bb.parameters())
    assert (VIT_ASSET_DIR / "MODEL_CARD.md").is_file()


def test_open_clip_visual_tower():
    bb = load_backbone("open_clip:raysim-tiny")  # the project's tiny open_clip config, random weights
    net = ViTAdapterNet(bb, 4).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(net.features(x), net.proj(net.backbone_features(x)), atol=1e-6)
    assert bb.embed_dim == 128 and len(net.adapters) == len(bb.visual.transformer.resblocks)


def test_resnet_backbone_has_conv_adapters_after_every_block():
    bb = load_backbone("resnet18")
    net = ViTAdapterNet(bb, 3, adapter_dim=0).eval()
    assert len(net.adapters) == 8 and net.adapter_dim == 64
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(net.features(x), net.proj(net.backbone_features(x)), atol=1e-5)


def test_heterogeneous_settings_cycle_over_four_configs():
    for name, configs in HETERO.items():
        got = [client_model_config(backbone=BUNDLED_VIT, hetero=name, client_id=i) for i in range(8)]
        assert [g.head for g in got[:4]] == [c[1] for c in configs] and got[4:] == got[:4]
        assert all(g.adapter_dim == 64 for g in got)
    assert [c.head for c in (client_model_config(backbone="", hetero="HtC4", client_id=i) for i in range(4))] == [
        (512,), (512, 256), (512, 256, 128), (1024, 512)]
    htfe = [client_model_config(backbone="", hetero="HtFE4", client_id=i, vit_tiny="T", vit_small="S").backbone for i in range(4)]
    assert htfe == ["resnet18", "resnet34", "T", "S"]
    with pytest.raises(ConfigError, match="hetero"):
        client_model_config(backbone="", hetero="HtFE9", client_id=0)
