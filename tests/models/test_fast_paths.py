"""The text tower's fast paths (execution.autocast, execution.compile) change results only within the
stated tolerances, are refused where they cannot run, and reach the tower from the config; the attention
is already PyTorch's SDPA in both kinds of text tower."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raysim.errors import ConfigError
from raysim.models.clip import FastPaths, ModelSpec, build_clip_env

NAMES = ["circle", "zero", "square", "seven", "letter O"]


def _env(model="raysim-tiny", pretrained="", **fast):
    return build_clip_env(ModelSpec(model, pretrained, fast=FastPaths(**fast)), NAMES, 4)


def _features_and_grad(env):
    """Normalised text features of every class and the gradient of a CE loss w.r.t. the context."""
    g = torch.Generator().manual_seed(0)
    ctx = (torch.randn(4, env.ctx_width, generator=g) * 0.02).requires_grad_(True)
    text = env.prompts.text_features(ctx)
    x = F.normalize(torch.randn(6, env.feature_dim, generator=g), dim=-1)
    loss = F.cross_entropy(env.logit_scale * x @ text.t(), torch.arange(6) % len(NAMES))
    (grad,) = torch.autograd.grad(loss, ctx)
    return text.detach(), grad


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("model,pretrained", [("raysim-tiny", ""), ("raysim-clip", "bundled")])
def test_bf16_autocast_within_tolerance(model, pretrained):
    ref_text, ref_grad = _features_and_grad(_env(model, pretrained))
    text, grad = _features_and_grad(_env(model, pretrained, autocast="bf16"))
    assert text.dtype == torch.float32  # the tower's output is cast back
    # bfloat16 keeps 8 significant bits (unit roundoff 2^-8 = 0.4%); through 2 (raysim-tiny) or 6 (MiniLM)
    # layers the features move by about 1% and the gradient by 1% (seen: 0.8% and 0.6-0.8% on 2 cores)
    assert 1e-5 < _rel(text, ref_text) < 0.03  # > 1e-5: the bf16 path really ran
    assert _rel(grad, ref_grad) < 0.05
    assert torch.nn.functional.cosine_similarity(text, ref_text, dim=-1).min() > 0.999


def test_fp16_refused_off_cuda_and_unknown_values():
    with pytest.raises(ConfigError, match="needs a GPU"):
        _env(autocast="fp16")
    with pytest.raises(ConfigError, match="execution.autocast must be one of"):
        _env(autocast="fp8")
    FastPaths(autocast="fp16").check("cuda")  # fine where there is a GPU


def test_compile_matches_eager():
    """torch.compile of the tower's forward (dynamo), with the "eager" backend: inductor's first compile
    takes 35-60 s on this 2-core machine, too slow for a test, so this checks the wiring (the tower's forward
    traced and run as a compiled graph, forward and backward) and benchmarks/gpu_paths.py times inductor."""
    import torch._dynamo

    torch._dynamo.reset()
    ref_text, ref_grad = _features_and_grad(_env())
    env = _env(compile=True, compile_backend="eager")
    assert env.tower._compiled is not None
    calls = []
    real_run = env.tower.run
    env.tower.run = lambda *a: calls.append(1) or real_run(*a)  # noqa: E731  (dynamo traces through it)
    env.tower.set_fast_paths(FastPaths(compile=True, compile_backend="eager"), "cpu")
    text, grad = _features_and_grad(env)
    assert calls  # the compiled path ran the tower's own forward
    # the eager backend runs the same aten ops in the same order: equal up to float32 reassociation
    assert _rel(text, ref_text) < 1e-5 and _rel(grad, ref_grad) < 1e-5
    torch._dynamo.reset()


def _attention_ops(env) -> set[str]:
    from torch.profiler import profile

    ctx = torch.zeros(4, env.ctx_width, requires_grad=True)
    with profile() as prof:
        env.prompts.text_features(ctx).sum().backward()
    return {e.name for e in prof.events() if "attention" in e.name}


@pytest.mark.parametrize("model,pretrained", [("raysim-tiny", ""), ("raysim-clip", "bundled")])
def test_text_towers_already_use_sdpa(model, pretrained):
    """open_clip's blocks call nn.MultiheadAttention(need_weights=False), which calls
    F.scaled_dot_product_attention; transformers builds its encoders with attn_implementation="sdpa".
    So there is no attention switch to add: this guards that it stays so after an upgrade."""
    env = _env(model, pretrained)
    ops = _attention_ops(env)
    assert "aten::scaled_dot_product_attention" in ops
    assert any(op.startswith("aten::_scaled_dot_product_") and op.endswith("_backward") for op in ops)  # a fused kernel's backward
    if model == "raysim-clip":
        assert env.tower.encoder.config._attn_implementation == "sdpa"


def test_config_keys_reach_the_tower_and_are_validated(tmp_path):
    from raysim.build import build_config, env_spec, validate
    cfg = build_config({"model": {"name": "raysim-tiny", "pretrained": ""}, "execution": {"autocast": "bf16", "backend": "inline"}})
    validate(cfg)
    spec = env_spec(cfg, NAMES)
    assert spec.model.fast == FastPaths(autocast="bf16", compile=False)
    assert spec.model.key() == ModelSpec("raysim-tiny", "").key()  # image-feature caches are shared
    with pytest.raises(ConfigError, match="needs a GPU"):
        validate(build_config({"execution": {"autocast": "fp16", "device": "cpu"}}))
    with pytest.raises(ConfigError, match="cannot run with DP-SGD"):
        validate(build_config({"execution": {"compile": True}, "dp": {"epsilon": 1.0}}))
    validate(build_config({"execution": {"compile": True}}))  # without DP it may
