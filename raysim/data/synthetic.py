"""Generated labelled images with captions over several visual domains with the same classes.

Every image shows one object of a class (a shape, a digit or a letter) with attributes (colour, size,
position, background texture, a small rotation), drawn with Pillow in one of four styles ("domains") that
change the look and not the class:

    clean    flat object on a lightly patterned, light background
    photo    shaded object on a noisy, unevenly lit textured background, slightly blurred
    sketch   pencil outlines on paper, hatched background
    cartoon  flat saturated colours with a thick black outline

Classes come in groups with graded similarity: shapes (circle / ring / hexagon / ...), digits (six / nine,
one / seven, zero / circle) and letters (O / zero, I / one). Each image has a natural-language caption that
names the class and its attributes ("a photo of a small red seven on a striped background").

Generation is deterministic from the seed: every (split, class, domain) cell has its own random stream, so
an image does not change when other cells are added. Results are cached as uint8 tensors under
`cache_dir/synthetic/<key>.pt`, keyed by every generation parameter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from raysim.data.base import DatasetBundle, ImageSet, LoadSpec, TensorImages, register_dataset

GENERATOR_VERSION = 1

DOMAINS = ["clean", "photo", "sketch", "cartoon"]
# how each domain is named in captions and prompts
DOMAIN_WORDS = {"clean": "rendering", "photo": "photo", "sketch": "sketch", "cartoon": "cartoon"}

SHAPES = ["circle", "square", "triangle", "star", "heart", "hexagon", "diamond", "cross", "ring", "arrow",
          "crescent", "pentagon"]
DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
DIGIT_GLYPHS = {name: str(i) for i, name in enumerate(DIGITS)}
LETTERS = [f"letter {c}" for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ"]
LETTER_GLYPHS = {f"letter {c}": c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ"}

# The class pool is interleaved so that every prefix mixes shapes, digits and letters (with confusable
# pairs early: circle/zero/letter O, one/letter I, six/nine, square/diamond).
CLASS_POOL: list[str] = [
    "circle", "zero", "square", "seven", "triangle", "one", "star", "letter O", "nine", "six",
    "heart", "letter A", "two", "hexagon", "letter X", "three", "diamond", "letter I", "eight", "cross",
    "four", "ring", "letter T", "five", "arrow", "letter H", "crescent", "letter L", "pentagon", "letter E",
    "letter B", "letter C", "letter D", "letter F", "letter G", "letter J", "letter K", "letter M",
    "letter N", "letter P", "letter Q", "letter R", "letter S", "letter U", "letter V", "letter W",
    "letter Y", "letter Z",
]
assert len(CLASS_POOL) == len(set(CLASS_POOL)) == len(SHAPES) + len(DIGITS) + len(LETTERS)

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 30),
    "orange": (245, 140, 20),
    "purple": (140, 50, 180),
    "black": (25, 25, 25),
    "pink": (240, 110, 180),
}
SIZES = {"small": 0.45, "medium": 0.62, "large": 0.82}  # object extent as a fraction of the canvas
POSITIONS = {  # centre of a small object, in canvas fractions
    "center": (0.5, 0.5),
    "top left": (0.3, 0.3),
    "top right": (0.7, 0.3),
    "bottom left": (0.3, 0.7),
    "bottom right": (0.7, 0.7),
}
BACKGROUNDS = ["plain", "striped", "dotted", "checkered"]


@dataclass(frozen=True)
class SyntheticParams:
    """Everything that determines the generated images (all of it goes into the cache key)."""

    classes: tuple[str, ...] = tuple(CLASS_POOL[:10])
    domains: tuple[str, ...] = tuple(DOMAINS)
    train_per_cell: int = 60  # training images per (class, domain)
    test_per_cell: int = 20  # test images per (class, domain)
    resolution: int = 32  # stored image size (the loader resizes to the model's size)
    seed: int = 0
    version: int = GENERATOR_VERSION

    def key(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:16]


@dataclass
class SyntheticSplit:
    """One generated split: uint8 images (N, 3, R, R), labels, domain ids, captions and attributes."""

    images: torch.Tensor
    labels: np.ndarray
    domains: np.ndarray
    captions: list[str]
    attributes: list[dict]

    def __len__(self) -> int:
        return int(self.labels.shape[0])


# --------------------------------------------------------------------------------------------------------
# drawing


_FONT_CACHE: dict[int, ImageFont.FreeTypeFont | ImageFont.ImageFont] = {}


def _font(px: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    if px not in _FONT_CACHE:
        try:
            from matplotlib import font_manager

            path = font_manager.findfont(font_manager.FontProperties(family="DejaVu Sans", weight="bold"))
            _FONT_CACHE[px] = ImageFont.truetype(path, px)
        except Exception:  # pragma: no cover - matplotlib missing: Pillow's built-in scalable font
            _FONT_CACHE[px] = ImageFont.load_default(size=px)
    return _FONT_CACHE[px]


def _regular_polygon(n: int, r: float, phase: float = -math.pi / 2) -> list[tuple[float, float]]:
    return [(r * math.cos(phase + 2 * math.pi * k / n), r * math.sin(phase + 2 * math.pi * k / n)) for k in range(n)]


def _shape_polygons(name: str) -> list[list[tuple[float, float]]]:
    """Unit-size polygons (coordinates in [-1, 1]) for a shape; several polygons are drawn filled."""
    if name == "square":
        return [[(-0.8, -0.8), (0.8, -0.8), (0.8, 0.8), (-0.8, 0.8)]]
    if name == "triangle":
        return [[(0.0, -0.95), (0.95, 0.8), (-0.95, 0.8)]]
    if name == "star":
        pts = []
        for k in range(10):
            r = 1.0 if k % 2 == 0 else 0.42
            a = -math.pi / 2 + math.pi * k / 5
            pts.append((r * math.cos(a), r * math.sin(a)))
        return [pts]
    if name == "hexagon":
        return [_regular_polygon(6, 0.95, 0.0)]
    if name == "pentagon":
        return [_regular_polygon(5, 0.98)]
    if name == "diamond":
        return [[(0.0, -1.0), (0.65, 0.0), (0.0, 1.0), (-0.65, 0.0)]]
    if name == "cross":
        a, b = 0.3, 0.9
        return [[(-a, -b), (a, -b), (a, -a), (b, -a), (b, a), (a, a), (a, b), (-a, b), (-a, a), (-b, a), (-b, -a),
                 (-a, -a)]]
    if name == "arrow":
        return [[(-0.95, -0.25), (0.2, -0.25), (0.2, -0.65), (0.95, 0.0), (0.2, 0.65), (0.2, 0.25), (-0.95, 0.25)]]
    if name == "heart":
        pts = []
        for k in range(40):
            t = 2 * math.pi * k / 40
            x = 16 * math.sin(t) ** 3
            y = 13 * math.cos(t) - 5 * math.cos(2 * t) - 2 * math.cos(3 * t) - math.cos(4 * t)
            pts.append((x / 17.0, -y / 17.0 - 0.1))
        return [pts]
    raise KeyError(name)


def _draw_mask(name: str, S: int, cx: float, cy: float, extent: float, angle: float) -> Image.Image:
    """An 'L' mask (S x S) with the object in 255, centred at (cx, cy) px, about `extent` px wide."""
    mask = Image.new("L", (S, S), 0)
    d = ImageDraw.Draw(mask)
    r = extent / 2
    if name in DIGIT_GLYPHS or name in LETTER_GLYPHS:
        glyph = DIGIT_GLYPHS.get(name) or LETTER_GLYPHS[name]
        d.text((cx, cy), glyph, fill=255, font=_font(max(6, int(extent * 1.15))), anchor="mm")
    elif name == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=255)
    elif name == "ring":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=255)
        q = r * 0.58
        d.ellipse([cx - q, cy - q, cx + q, cy + q], fill=0)
    elif name == "crescent":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=255)
        q = r * 0.85
        ox = cx + r * 0.45
        d.ellipse([ox - q, cy - q - r * 0.1, ox + q, cy + q - r * 0.1], fill=0)
    else:
        ca, sa = math.cos(angle), math.sin(angle)
        for poly in _shape_polygons(name):
            pts = [(cx + r * (x * ca - y * sa), cy + r * (x * sa + y * ca)) for x, y in poly]
            d.polygon(pts, fill=255)
        return mask
    if abs(angle) > 1e-3:  # glyphs and round shapes: rotate the mask about the object centre
        mask = mask.rotate(-math.degrees(angle), resample=Image.Resampling.BILINEAR, center=(cx, cy))
    return mask


def _jitter(rgb: Sequence[int], rng: np.random.Generator, amount: int) -> tuple[int, int, int]:
    r, g, b = (int(v) for v in np.clip(np.asarray(rgb) + rng.integers(-amount, amount + 1, 3), 0, 255))
    return r, g, b


def _pattern_mask(kind: str, S: int, rng: np.random.Generator, scale: float) -> Optional[np.ndarray]:
    """A boolean (S, S) pattern for a background texture, or None for plain."""
    if kind == "plain":
        return None
    yy, xx = np.mgrid[0:S, 0:S]
    period = max(4, int(S * scale * rng.uniform(0.8, 1.2)))
    off = int(rng.integers(0, period))
    if kind == "striped":
        if rng.random() < 0.5:
            return ((yy + off) % period) < period // 2
        return ((xx + yy + off) % period) < period // 2
    if kind == "checkered":
        return (((xx + off) // max(2, period // 2)) + ((yy + off) // max(2, period // 2))) % 2 == 0
    if kind == "dotted":
        c = period // 2
        rad = max(1.0, period * 0.22)
        return (((xx + off) % period - c) ** 2 + ((yy + off) % period - c) ** 2) <= rad**2
    raise KeyError(kind)


def _contrasting_background(obj: tuple[int, int, int], rng: np.random.Generator, light: bool) -> np.ndarray:
    for _ in range(20):
        bg: np.ndarray
        if light:
            bg = rng.integers(170, 256, 3)
        else:
            bg = np.asarray(list(COLOURS.values())[int(rng.integers(0, len(COLOURS)))]) * 0.6 + rng.integers(
                0, 100, 3
            )
        if np.abs(bg - np.asarray(obj)).sum() > 200:
            return bg.astype(np.float32)
    return np.array([235, 235, 235], np.float32) if sum(obj) < 400 else np.array([40, 40, 40], np.float32)


def render(
    classname: str, domain: str, attrs: dict, S: int, rng: np.random.Generator
) -> np.ndarray:
    """Draw one (S, S, 3) uint8 image of `classname` with `attrs` in `domain` style."""
    colour = _jitter(COLOURS[attrs["colour"]], rng, 20)
    extent = SIZES[attrs["size"]] * S * rng.uniform(0.92, 1.08)
    px, py = POSITIONS[attrs["position"]]
    cx = px * S + rng.uniform(-0.04, 0.04) * S
    cy = py * S + rng.uniform(-0.04, 0.04) * S
    angle = math.radians(rng.uniform(-20, 20))
    mask = _draw_mask(classname, S, cx, cy, extent, angle)
    m = np.asarray(mask, dtype=np.float32)[..., None] / 255.0
    obj = np.asarray(colour, np.float32)

    if domain == "clean":
        bg_col = _contrasting_background(colour, rng, light=True)
        img = np.broadcast_to(bg_col, (S, S, 3)).copy()
        pat = _pattern_mask(attrs["background"], S, rng, 0.18)
        if pat is not None:
            img[pat] = img[pat] * 0.82
        img = img * (1 - m) + obj * m

    elif domain == "photo":
        bg_col = _contrasting_background(colour, rng, light=rng.random() < 0.5)
        yy, xx = np.mgrid[0:S, 0:S].astype(np.float32) / S
        g = rng.uniform(-0.5, 0.5, 2)
        light = 1.0 + 0.35 * (g[0] * (xx - 0.5) + g[1] * (yy - 0.5)) * 2
        img = bg_col * light[..., None]
        pat = _pattern_mask(attrs["background"], S, rng, 0.14)
        if pat is not None:
            img[pat] = img[pat] * 0.7 + 20
        img = img + rng.normal(0, 18, (S, S, 1)) + rng.normal(0, 8, (S, S, 3))  # grain
        shade = 1.0 + 0.3 * ((cx / S - xx) + (cy / S - yy))  # lit from the object's top left
        img = img * (1 - m) + (obj * shade[..., None] + rng.normal(0, 10, (S, S, 3))) * m
        img = np.clip(img, 0, 255).astype(np.uint8)
        img = np.asarray(Image.fromarray(img).filter(ImageFilter.GaussianBlur(radius=S / 64 * rng.uniform(0.6, 1.2))),
                         np.float32)
        img = img + rng.normal(0, 6, (S, S, 3))

    elif domain == "sketch":
        paper = rng.uniform(235, 255) + rng.normal(0, 4, (S, S, 1))
        img = np.broadcast_to(paper, (S, S, 3)).astype(np.float32).copy()
        pat = _pattern_mask(attrs["background"], S, rng, 0.2)
        if pat is not None:  # faint hatching
            edges = pat ^ np.roll(pat, 1, axis=1)
            img[edges] = img[edges] * 0.85
        w = max(3, int(round(S / 16)) | 1)
        grown = np.asarray(mask.filter(ImageFilter.MaxFilter(w)), np.float32) / 255.0
        outline = np.clip(grown - m[..., 0], 0, 1)
        # a second, shifted stroke makes it look hand drawn
        dx, dy = rng.integers(-1, 2, 2)
        outline = np.maximum(outline, 0.6 * np.roll(np.roll(outline, dx, 1), dy, 0))
        pencil = obj * 0.6  # the pencil is a darkened version of the object colour
        img = img * (1 - outline[..., None]) + pencil * outline[..., None]

    elif domain == "cartoon":
        bg_col = _contrasting_background(colour, rng, light=rng.random() < 0.5)
        bg_col = np.clip((bg_col - 128) * 1.4 + 128, 0, 255)  # saturated flat colours
        img = np.broadcast_to(bg_col, (S, S, 3)).copy()
        pat = _pattern_mask(attrs["background"], S, rng, 0.3)
        if pat is not None:
            img[pat] = np.clip(bg_col * 0.75 + 50, 0, 255)
        w = max(3, int(round(S / 12)) | 1)
        grown = np.asarray(mask.filter(ImageFilter.MaxFilter(w)), np.float32)[..., None] / 255.0
        flat = np.clip((obj - 128) * 1.3 + 128, 0, 255)
        img = img * (1 - grown) + np.float32(10) * grown  # thick black outline
        img = img * (1 - m) + flat * m
    else:
        raise KeyError(f"unknown domain {domain!r}; valid: {DOMAINS}")
    return np.clip(img, 0, 255).astype(np.uint8)


# --------------------------------------------------------------------------------------------------------
# attributes and captions


def sample_attributes(rng: np.random.Generator) -> dict:
    size = str(rng.choice(list(SIZES)))
    position = "center" if size == "large" else str(rng.choice(list(POSITIONS)))
    return {
        "colour": str(rng.choice(list(COLOURS))),
        "size": size,
        "position": position,
        "background": str(rng.choice(BACKGROUNDS)),
    }


def _article(word: str) -> str:
    return "an" if word[0].lower() in "aeiou" else "a"


def caption(classname: str, domain: str, attrs: dict, rng: Optional[np.random.Generator] = None) -> str:
    """A natural-language caption naming the class, the domain and the attributes."""
    rng = rng or np.random.default_rng(0)
    kind = DOMAIN_WORDS[domain]
    size, colour, bg, pos = attrs["size"], attrs["colour"], attrs["background"], attrs["position"]
    obj = f"{size} {colour} {classname}"
    where = "" if pos == "center" else f" in the {pos}"
    bg_phrase = "a plain background" if bg == "plain" else f"{_article(bg)} {bg} background"
    templates = [
        f"{_article(kind)} {kind} of {_article(obj)} {obj}{where} on {bg_phrase}.",
        f"{_article(kind)} {kind} of {_article(obj)} {obj} on {bg_phrase}.",
        f"{_article(kind)} {kind} of {_article(classname)} {classname}.",
        f"{_article(colour)} {colour} {classname}{where}, {kind} style, on {bg_phrase}.",
        f"{_article(kind)} {kind} showing {_article(size)} {size} {classname} in {colour}.",
        f"{_article(classname)} {classname} drawn in {colour}, {kind}.",
    ]
    return templates[int(rng.integers(0, len(templates)))]


# --------------------------------------------------------------------------------------------------------
# generation and caching


def _cell(params: SyntheticParams, split: int, c: int, d: int, n: int):
    classname, domain = params.classes[c], params.domains[d]
    # One random stream per (seed, split, class name, domain name): adding cells changes nothing else.
    name_id = int(hashlib.sha1(f"{classname}|{domain}".encode()).hexdigest()[:8], 16)
    rng = np.random.default_rng([params.seed, split, name_id, params.resolution])
    S = params.resolution * 2  # draw at twice the size, then downsample (anti-aliasing)
    imgs = np.empty((n, params.resolution, params.resolution, 3), np.uint8)
    caps, attrs_list = [], []
    for i in range(n):
        attrs = sample_attributes(rng)
        big = render(classname, domain, attrs, S, rng)
        imgs[i] = np.asarray(Image.fromarray(big).resize((params.resolution,) * 2, Image.Resampling.BOX))
        caps.append(caption(classname, domain, attrs, rng))
        attrs_list.append(dict(attrs, domain=domain))
    return imgs, caps, attrs_list


def _generate_split(params: SyntheticParams, split: int, per_cell: int, workers: int) -> SyntheticSplit:
    jobs = [(c, d) for c in range(len(params.classes)) for d in range(len(params.domains))]
    if workers > 1 and len(jobs) * per_cell >= 4000:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers) as ex:
            futs = [ex.submit(_cell, params, split, c, d, per_cell) for c, d in jobs]
            results = [f.result() for f in futs]
    else:
        results = [_cell(params, split, c, d, per_cell) for c, d in jobs]
    images = np.concatenate([r[0] for r in results]) if results else np.zeros((0, params.resolution,
                                                                               params.resolution, 3), np.uint8)
    labels = np.repeat([c for c, _ in jobs], per_cell).astype(np.int64)
    domains = np.repeat([d for _, d in jobs], per_cell).astype(np.int64)
    return SyntheticSplit(
        images=torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(),
        labels=labels,
        domains=domains,
        captions=[c for r in results for c in r[1]],
        attributes=[a for r in results for a in r[2]],
    )


def generate(
    params: SyntheticParams, cache_dir: Optional[str] = "~/.cache/raysim", workers: int = 0
) -> tuple[SyntheticSplit, SyntheticSplit]:
    """(train, test) for `params`, from the cache when present. `workers` > 1 draws in processes
    (0 = use the CPUs available, capped at 8; the output does not depend on it)."""
    for c in params.classes:
        if c not in CLASS_POOL:
            raise ValueError(f"unknown class {c!r}; valid: {CLASS_POOL}")
    for d in params.domains:
        if d not in DOMAINS:
            raise ValueError(f"unknown domain {d!r}; valid: {DOMAINS}")
    path = None
    if cache_dir:
        path = Path(os.path.expanduser(cache_dir)) / "synthetic" / f"{params.key()}.pt"
        if path.exists():
            try:
                from raysim.safeio import read_regular, safe_load

                # a regular file, size-capped; plain data only (tensors, numpy arrays, strings): a cache file cannot run code
                blob = safe_load(read_regular(path, root=path.parent))
                return SyntheticSplit(**blob["train"]), SyntheticSplit(**blob["test"])
            except Exception:  # a corrupt or partial file: regenerate
                pass
    if workers <= 0:
        workers = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    train = _generate_split(params, 0, params.train_per_cell, workers)
    test = _generate_split(params, 1, params.test_per_cell, workers)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save({"params": dataclasses.asdict(params), "train": dataclasses.asdict(train),
                    "test": dataclasses.asdict(test)}, tmp)
        os.replace(tmp, path)  # atomic: concurrent loaders never see a partial file
    return train, test


def get_captions(
    params: SyntheticParams = SyntheticParams(), split: str = "train", cache_dir: Optional[str] = "~/.cache/raysim"
) -> tuple[torch.Tensor, list[str], np.ndarray, np.ndarray]:
    """(uint8 images (N, 3, R, R), captions, labels, domain ids) of one split, for contrastive pretraining."""
    train, test = generate(params, cache_dir)
    s = train if split == "train" else test
    return s.images, s.captions, s.labels, s.domains


class UInt8Images(TensorImages):
    """uint8 images (N, 3, h, w) kept as bytes, scaled to [0, 1], resized and normalised on access."""

    def __getitem__(self, i: int) -> torch.Tensor:
        x = self.images[i].float().div_(255.0)
        if x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            x = torch.nn.functional.interpolate(
                x[None], size=(self.image_size, self.image_size), mode="bilinear", align_corners=False
            )[0]
        return (x - self.mean) / self.std


def make_bundle(params: SyntheticParams, spec: LoadSpec, name: str = "synthetic") -> DatasetBundle:
    train, test = generate(params, spec.cache_dir)

    def imageset(s: SyntheticSplit) -> ImageSet:
        return ImageSet(UInt8Images(s.images, spec.image_size, spec.mean, spec.std), s.labels, s.domains)

    return DatasetBundle(
        name=name,
        classnames=list(params.classes),
        train=imageset(train),
        test=imageset(test),
        domain_names=list(params.domains),
        signature=f"{name}-v{params.version}-{params.key()}-img{spec.image_size}",
        meta={
            "params": dataclasses.asdict(params),
            "train_captions": train.captions,
            "test_captions": test.captions,
            "prompt_template": "a {domain} of a {classname}.",
        },
    )


# Registered variants. The data's own seed is fixed (it is the dataset, like a real dataset's split); the run
# seed only changes partitions and training. The pretraining data of raysim.tools.pretrain uses another seed.
DEFAULT = SyntheticParams()
SMALL = SyntheticParams(classes=tuple(CLASS_POOL[:6]), train_per_cell=16, test_per_cell=8)
LARGE = SyntheticParams(classes=tuple(CLASS_POOL[:30]), train_per_cell=100, test_per_cell=25)


@register_dataset("synthetic")
def load_synthetic(spec: LoadSpec) -> DatasetBundle:
    """10 classes x 4 domains, 60 train + 20 test images per (class, domain) at 32x32 (3,200 images)."""
    return make_bundle(DEFAULT, spec, "synthetic")


@register_dataset("synthetic-small")
def load_synthetic_small(spec: LoadSpec) -> DatasetBundle:
    """6 classes x 4 domains, 16 train + 8 test per (class, domain): for tests."""
    return make_bundle(SMALL, spec, "synthetic-small")


@register_dataset("synthetic-large")
def load_synthetic_large(spec: LoadSpec) -> DatasetBundle:
    """30 classes x 4 domains, 100 train + 25 test per (class, domain) (15,000 images)."""
    return make_bundle(LARGE, spec, "synthetic-large")
