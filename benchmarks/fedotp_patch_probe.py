"""Do the image tower's patch tokens carry class information in the text space? (FedOTP's local features.)

    HF_HUB_OFFLINE=1 python benchmarks/fedotp_patch_probe.py [key=value ...]   # default: synthetic-large, raysim-clip3

Parts 0-2 take about 20 s on 1 CPU thread once the features and tokens are cached (the first run encodes them); the
linear probe (3.) takes minutes more on the shared 2-core build machine (`--no-probe` skips it). Everything is
frozen: no training of prompts. On the test split it prints, for the text features of the prompt "a photo of a
{class}." (the phrase context, `CoOpPrompts(ctx_init="a photo of a")`):

0. sanity: the cached CLS token through ln_post and proj (TokenHead's map) against the cached pooled feature (cosine).
1. zero-shot accuracy, over all classes and over the 3 (or so) classes of the test image's own client under the run's
   partition (In-Client chance), scoring each image by
   a. its pooled (CLS) feature: the ordinary zero-shot;
   b. the mean of its patch tokens mapped through ln_post and proj (each normalised, as FedOTP maps them);
   c. one patch at a time (accuracy averaged over the patch positions), the best patch per class (max over patches
      of the cosine), and FedOTP's transport score (`methods/fedsept/fedotp.ot_logits`, the plan between the image's
      M patches and the class's N = 2 prompts) with both prompts the phrase, and with FedOTP's own start (two
      N(0, 0.02^2) contexts); the same transport with the CLS token added to the patches (M + 1 points), and with
      the pooled feature alone (M = 1, fedotp.tokens=pooled) for reference.
2. the geometry behind it: mean cosine of a mapped patch with the image's pooled feature, with the other patches of
   the image, and with the class texts; how far the texts' cosines spread across classes for a pooled feature and for
   a patch (the spread is what separates classes).
3. a linear probe (multinomial logistic regression, train split -> test split) on the pooled feature and on the mean
   mapped patch: whether the patches carry class information at all, in any direction, or only not along the texts.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    import argparse

    import numpy as np
    import torch
    import torch.nn.functional as F

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-probe", action="store_true", help="skip the linear probe (3.)")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.time()

    from raysim.build import build_config, make_method
    from raysim.config import merge_config, parse_overrides
    from raysim.engine.loop import prepare_data
    from raysim.methods.fedsept.fedotp import ot_logits
    from raysim.models.clip import ModelSpec, build_clip_env

    values = merge_config({"method": "fedotp", "data": {"dataset": "synthetic-large", "partition": "pathological"},
                           "model": {"name": "raysim-clip3", "pretrained": "bundled"},
                           "train": {"num_clients": 10, "ctx_init": ""}}, parse_overrides(a.overrides))
    cfg = build_config(values)
    method = make_method(cfg)
    data = prepare_data(cfg, method.needs(), progress=False)
    if data.tok_test is None:
        raise SystemExit("this run's fedotp does not read tokens (fedotp.tokens=pooled?); the probe needs fedotp.tokens=patch")
    spec = ModelSpec(cfg.model.name, cfg.model.pretrained, cache_dir=cfg.output.cache_dir)
    env = build_clip_env(spec, data.classnames, cfg.train.n_ctx, ctx_init="a photo of a", token_head=True)
    head = env.token_head
    assert head is not None
    C = len(data.classnames)
    print(f"(data and model loaded: {time.time() - t0:.0f} s)")

    def mapped(tok: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalised pooled feature recomputed from the CLS token (N, D), normalised mapped patches (N, M, D))."""
        t = torch.as_tensor(tok)
        with torch.no_grad():
            cls = F.normalize(head.head(t[:, 0].float()) @ head.proj, dim=-1) if head.proj is not None else None
            return cls, F.normalize(head(t), dim=-1)

    x_te = F.normalize(torch.as_tensor(data.x_test).float(), dim=-1)
    y_te = torch.as_tensor(data.y_test)
    cls_te, patch_te = mapped(data.tok_test)
    N, M, D = patch_te.shape
    g = torch.Generator().manual_seed(cfg.train.seed)
    with torch.no_grad():
        phrase = env.prompts.text_features(env.prompts.initial_context(g))  # (C, D), normalised
        gauss = env.prompts.text_features(torch.randn(2, cfg.train.n_ctx, env.ctx_width, generator=g) * 0.02)  # (2, C, D)
    s = env.logit_scale

    # each test image's own client's classes (pathological: 3 each): In-Client chance is 1 / len(classes)
    own = torch.zeros(N, C, dtype=torch.bool)
    for tr, te in zip(data.train_idx, data.test_idx):
        classes = np.unique(data.y_train[tr])
        te = torch.as_tensor(np.asarray(te), dtype=torch.long)
        own[te.unsqueeze(1), torch.as_tensor(classes).unsqueeze(0)] = True
    has_own = own.any(1)
    k_own = float(own[has_own].sum(1).float().mean()) if bool(has_own.any()) else float("nan")

    def acc(logits: torch.Tensor) -> tuple[float, float]:
        """(accuracy over all classes, accuracy among the image's client's classes) in %."""
        full = float((logits.argmax(1) == y_te).float().mean())
        lo = logits[has_own].masked_fill(~own[has_own], float("-inf"))
        return 100 * full, 100 * float((lo.argmax(1) == y_te[has_own]).float().mean())

    print(f"{cfg.data.dataset} test split: {N} images, {C} classes; {cfg.model.name}: {M} patch tokens per image "
          f"(+ CLS), embedding dim {D}, logit scale {s:.2f}; {len(data.test_idx)} clients, {k_own:.1f} classes each "
          f"({int(has_own.sum())} test images in a client's split)")
    print(f"\n0. sanity: cos(CLS token through ln_post @ proj, cached pooled feature) = "
          f"mean {float((cls_te * x_te).sum(-1).mean()):.4f}, min {float((cls_te * x_te).sum(-1).min()):.4f}")

    with torch.no_grad():
        sim_p = torch.einsum("bmd,cd->bmc", patch_te, phrase)  # (N, M, C) patch x class cosines
        rows: list[tuple[str, torch.Tensor | tuple[float, float]]] = [
            ("a. pooled (CLS) feature", s * x_te @ phrase.t()),
            ("b. mean of the mapped patches", s * F.normalize(patch_te.mean(1), dim=-1) @ phrase.t()),
        ]
        per_patch = [acc(s * sim_p[:, m]) for m in range(M)]
        rows.append(("c. one patch (mean over positions)", (float(np.mean([r[0] for r in per_patch])),
                                                          float(np.mean([r[1] for r in per_patch])))))
        best_m = int(np.argmax([r[0] for r in per_patch]))
        rows.append((f"c. the best position alone (#{best_m})", per_patch[best_m]))
        rows.append(("c. best patch per class (max over M)", s * sim_p.max(1).values))
        ot = dict(eps=method.opts.eps, thresh=method.opts.thresh, max_iter=method.opts.max_iter)
        rows.append(("c. FedOTP transport, patches x [phrase, phrase]", ot_logits(s, patch_te, torch.stack([phrase, phrase]), **ot)))
        rows.append(("c. FedOTP transport, patches x 2 N(0,.02^2) ctx", ot_logits(s, patch_te, gauss, **ot)))
        with_cls = torch.cat([x_te.unsqueeze(1), patch_te], dim=1)  # the CLS token as one more point (M + 1)
        rows.append(("   transport, CLS + patches x 2 N(0,.02^2) ctx", ot_logits(s, with_cls, gauss, **ot)))
        rows.append(("   transport, pooled x 2 N(0,.02^2) ctx (=pooled)", ot_logits(s, x_te.unsqueeze(1), gauss, **ot)))
    print(f"\n1. zero-shot accuracy (%), text 'a photo of a {{class}}.'; chance {100 / C:.2f} over all, "
          f"{100 / k_own:.2f} within a client")
    print(f"   {'scored by':50s} {'all classes':>12s} {'own client':>11s}")
    for name, r in rows:
        full, within = r if isinstance(r, tuple) else acc(r)
        print(f"   {name:50s} {full:12.2f} {within:11.2f}")

    with torch.no_grad():
        cos_cls = float((patch_te * x_te.unsqueeze(1)).sum(-1).mean())
        gram = torch.einsum("bmd,bnd->bmn", patch_te, patch_te)
        cos_pp = float((gram.sum((1, 2)) - M).mean() / (M * (M - 1)))
        sim_c = x_te @ phrase.t()
        yi = y_te.unsqueeze(1)
        print("\n2. geometry (cosines)")
        print(f"   patch . own pooled feature {cos_cls:.3f};  patch . other patch of the image {cos_pp:.3f}")
        print(f"   pooled . class texts: mean {float(sim_c.mean()):.3f}, spread across classes (std) {float(sim_c.std(1).mean()):.4f}, "
              f"true class minus mean {float((sim_c.gather(1, yi).squeeze(1) - sim_c.mean(1)).mean()):.4f}")
        tru = sim_p.gather(2, yi.unsqueeze(1).expand(N, M, 1)).squeeze(2)
        print(f"   patch  . class texts: mean {float(sim_p.mean()):.3f}, spread across classes (std) {float(sim_p.std(2).mean()):.4f}, "
              f"true class minus mean {float((tru - sim_p.mean(2)).mean()):.4f}")
        print(f"   (the transport's cost is 1 - cosine at eps {method.opts.eps}: the plan's weights vary by exp(spread / eps))")

    print(f"\n({time.time() - t0:.0f} s)")
    if not a.no_probe:
        from sklearn.linear_model import LogisticRegression

        _, patch_tr = mapped(data.tok_train)
        x_tr = F.normalize(torch.as_tensor(data.x_train).float(), dim=-1)
        y_tr = np.asarray(data.y_train)
        print("\n3. linear probe (logistic regression, C=1.0, at most 500 iterations, on the whole train split; test accuracy %)")
        for name, ftr, fte in [("pooled (CLS) feature", x_tr, x_te),
                               ("mean of the mapped patches", F.normalize(patch_tr.mean(1), dim=-1),
                                F.normalize(patch_te.mean(1), dim=-1))]:
            with warnings.catch_warnings():  # 500 iterations may stop short of convergence (2000: 54.03 vs 54.13)
                warnings.simplefilter("ignore")
                clf = LogisticRegression(max_iter=500).fit(ftr.numpy() * 10, y_tr)
            print(f"   {name:50s} {100 * clf.score(fte.numpy() * 10, y_te.numpy()):6.2f}")
        print(f"\n({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
