"""Text features of a stack of CoOp contexts with the shared prefix computed once (client-batched training).

In CLIP's causal text transformer the hidden state at a position depends only on the positions up to it.
A CoOp prompt is [SOT, ctx_1..ctx_L, class tokens, ".", EOT]: its first P = 1 + L positions are the same
for every class of one context, so their hidden states (and attention keys and values) are too. For a
stack of A contexts and C classes, `stacked_text_features` computes the P prefix positions once per
context and only the class-specific rest once per class, and in the last layer only the EOT rows (the
rest are not read): the same function as `CoOpPrompts.text_features`, with about (P + C (T - P)) / (C T)
of its token rows. Equal to it up to float reassociation (other matmul shapes); towers it does not know
(a Hugging Face encoder attends both ways; non-standard blocks) take `CoOpPrompts.text_features`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raysim.models.clip import AUTOCAST, CausalTextTower, CoOpPrompts


def _standard_blocks(tower: Any) -> bool:
    """open_clip's plain ResidualAttentionBlocks with a packed, biased, dropout-free nn.MultiheadAttention."""
    try:
        from open_clip.transformer import ResidualAttentionBlock
    except ImportError:  # pragma: no cover - open_clip is a dependency
        return False
    blocks = getattr(tower.transformer, "resblocks", None)
    if blocks is None or getattr(tower.transformer, "grad_checkpointing", False):
        return False
    for b in blocks:
        a = getattr(b, "attn", None)
        if type(b) is not ResidualAttentionBlock or hasattr(b, "ln_1_kv") or not isinstance(a, nn.MultiheadAttention):
            return False
        if not a._qkv_same_embed_dim or a.in_proj_bias is None or a.bias_k is not None or a.add_zero_attn or (a.dropout and a.training):
            return False
    return True


def shares_prefix(prompts: CoOpPrompts) -> bool:
    tower = prompts.tower
    return (isinstance(tower, CausalTextTower) and tower.attn_mask is not None and _standard_blocks(tower)
            and bool(torch.equal(prompts.prefix, prompts.prefix[:1].expand_as(prompts.prefix))))


def _heads(x: Tensor, h: int) -> Tensor:
    return x.unflatten(-1, (h, -1)).transpose(-3, -2)  # (..., L, w) -> (..., h, L, w / h)


def _merge(x: Tensor) -> Tensor:
    return x.transpose(-3, -2).flatten(-2)  # (..., h, L, d) -> (..., L, h d)


def stacked_text_features(prompts: CoOpPrompts, ctx: Tensor) -> Tensor:
    """Normalised text features (A, C, D) of every class for each of the A contexts ctx (A, L, w). Under the
    tower's execution.autocast it runs autocast too; with execution.compile it takes the compiled full forward."""
    fast = getattr(prompts.tower, "fast", None)
    if not shares_prefix(prompts) or getattr(fast, "compile", False):
        return prompts.text_features(ctx)
    dtype = AUTOCAST.get(getattr(fast, "autocast", "off"))
    if dtype is None:
        return _shared_prefix(prompts, ctx)
    with torch.autocast(device_type=ctx.device.type, dtype=dtype):
        out = _shared_prefix(prompts, ctx, normalize=False)
    return F.normalize(out.float(), dim=-1)  # as text_features: the tower's output in float32, then normalised


def _shared_prefix(prompts: CoOpPrompts, ctx: Tensor, normalize: bool = True) -> Tensor:
    tower = prompts.tower
    assert isinstance(tower, CausalTextTower)  # shares_prefix checked it
    A, C = ctx.shape[0], prompts.num_classes
    eot = prompts.meta.to(ctx.device)
    t = int(eot.max().item()) + 1
    P = 1 + ctx.shape[-2]
    pos = tower.positional_embedding[:t].to(ctx.dtype)
    assert tower.attn_mask is not None  # causal: shares_prefix checked it
    mask = tower.attn_mask[:t, :t].to(ctx.dtype)
    hp = torch.cat([prompts.prefix[:1].expand(A, 1, -1).to(ctx.dtype), ctx], dim=1) + pos[:P]  # (A, P, w)
    hs = (prompts.suffix[:, : t - P].to(ctx.dtype) + pos[P:]).expand(A, C, t - P, -1)  # (A, C, S, w)
    blocks: list[Any] = list(tower.transformer.resblocks)  # type: ignore[arg-type]  # an nn.ModuleList
    classes = torch.arange(C, device=ctx.device)
    for i, block in enumerate(blocks):
        attn: nn.MultiheadAttention = block.attn
        W, b, h, w = attn.in_proj_weight, attn.in_proj_bias, attn.num_heads, hp.shape[-1]
        last = i == len(blocks) - 1
        xp, xs = block.ln_1(hp), block.ln_1(hs)
        kp, vp = F.linear(xp, W[w:], b[w:]).chunk(2, dim=-1)  # (A, P, w)
        ks, vs = F.linear(xs, W[w:], b[w:]).chunk(2, dim=-1)  # (A, C, S, w)
        if last:  # only the EOT rows are read after the last block: only they query
            hs = hs[:, classes, eot - P].unsqueeze(2)  # (A, C, 1, w)
            xs = xs[:, classes, eot - P].unsqueeze(2)
            rows = mask[eot][:, None, None]  # (C, 1, 1, t): each class's EOT row of the causal mask
        else:
            rows = mask[P:]  # (S, t)
        kp_h, vp_h = _heads(kp, h), _heads(vp, h)  # (A, h, P, d)
        keys = torch.cat([kp_h[:, None].expand(A, C, *kp_h.shape[1:]), _heads(ks, h)], dim=-2)  # (A, C, h, t, d)
        vals = torch.cat([vp_h[:, None].expand(A, C, *vp_h.shape[1:]), _heads(vs, h)], dim=-2)
        qs = F.linear(xs, W[:w], b[:w])
        if not last:  # the prefix rows: causal attention among themselves (what every class of a context shares)
            qp = F.linear(xp, W[:w], b[:w])
            out_p = attn.out_proj(_merge(F.scaled_dot_product_attention(_heads(qp, h), kp_h, vp_h, attn_mask=mask[:P, :P])))
            hp = hp + block.ls_1(out_p)
            hp = hp + block.ls_2(block.mlp(block.ln_2(hp)))
        out_s = attn.out_proj(_merge(F.scaled_dot_product_attention(_heads(qs, h), keys, vals, attn_mask=rows)))
        hs = hs + block.ls_1(out_s)
        hs = hs + block.ls_2(block.mlp(block.ln_2(hs)))
    x = tower.ln_final(hs.squeeze(2))  # (A, C, w)
    proj = tower.text_projection
    out = proj(x) if isinstance(proj, nn.Linear) else x @ proj
    return F.normalize(out, dim=-1) if normalize else out
