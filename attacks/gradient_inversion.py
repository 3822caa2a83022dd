"""Multi-client gradient inversion by an honest-but-curious server (fedsept.txt section 5.5, SPEC 1.12).

The server sees a client's shared tensor before and after local training (FedSEPT's A, PromptFL's
ctx) and takes the effective gradient g^ = -(theta_post - theta_pre) / eta. Inverting-Gradients style,
it optimises dummy images (Gaussian start in normalised space, labels known) with Adam so that the
gradient they induce matches g^:

    loss = 1 - cos(grad_shared l(dummy), g^) + tv_weight * TV(dummy),

clamping pixels to the valid normalised range after every step, over several restarts, keeping the
lowest-loss one. The dummy gradient flows image -> frozen CLIP image tower -> L2-normalised feature
-> the method's training loss -> shared tensor, through a `SharedGrad` function the caller builds
(`prompt_shared_grad` does it for the CLIP prompt methods), so any prompt method can be attacked.
Its costly part, the Jacobian of the text features w.r.t. the shared tensor, depends on theta_pre and
the client's private text-side state (FedSEPT's R) but not on the router or the data, so clients that
share both share it through a `TextJacobianCache`.

g^ is exact when the client takes one plain SGD step (no momentum) on one batch; weight decay is
removed if given. The private parts the loss needs (FedSEPT's R and router) are not seen by the
server: passing the client's real private state is the white-box upper bound, a freshly initialised
one a surrogate. The router is used in eval mode (no dropout), so a client that trained with router
dropout makes g^ only approximately reproducible.

Metrics (`reconstruction_metrics`): PSNR against the closest true image (Hungarian matching within
the client), CLIPCos (cosine of the CLIP image embeddings of a reconstruction and its closest original,
matched in embedding space), Top-1 agreement of the CLIP zero-shot predictions of those pairs, and
GradCos (cosine of the final dummy gradient to g^).
The paper's 2,000 iterations and 4 restarts are the defaults; `image_size` is the CLIP model's input
size (224 for ViT-B/16, 32 for raysim-tiny and raysim-clip).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, cast

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from raysim.attacks.base import Attack, AttackOutput, Progress, clients_then_rounds, declares, register_attack
from raysim.data.base import CLIP_MEAN, CLIP_STD

SharedGrad = Callable[[Tensor, Tensor], Tensor]  # (normalised images (B, 3, S, S), labels (B,)) -> d loss / d shared


def observed_gradient(pre: Tensor, post: Tensor, *, lr: float, weight_decay: float = 0.0) -> Tensor:
    """g^ = -(post - pre) / lr, minus the weight-decay term weight_decay * pre of plain SGD."""
    return -(post.double() - pre.double()).float() / lr - weight_decay * pre.float()


def pixel_range(mean: Sequence[float] = CLIP_MEAN, std: Sequence[float] = CLIP_STD) -> tuple[Tensor, Tensor]:
    """Per-channel (low, high), shape (1, 3, 1, 1): where pixels in [0, 1] land after normalisation."""
    m, s = (torch.tensor(v, dtype=torch.float32).view(1, -1, 1, 1) for v in (mean, std))
    return (0 - m) / s, (1 - m) / s


def to_pixels(images: Tensor, mean: Sequence[float] = CLIP_MEAN, std: Sequence[float] = CLIP_STD) -> Tensor:
    low, high = pixel_range(mean, std)
    return ((images - low) / (high - low)).clamp(0, 1)


def image_features(clip: torch.nn.Module, images: Tensor) -> Tensor:
    """L2-normalised CLIP image features, differentiable w.r.t. the images (the tower stays frozen)."""
    encode = cast(Callable[[Tensor], Tensor], clip.encode_image)  # an open_clip model's method (nn.Module hides it from mypy)
    return F.normalize(encode(images).float(), dim=-1)


def total_variation(x: Tensor) -> Tensor:
    return (x[..., 1:, :] - x[..., :-1, :]).abs().mean() + (x[..., :, 1:] - x[..., :, :-1]).abs().mean()


# -- the gradient of the shared tensor, for the CLIP prompt methods ----------------------------

@dataclass
class PromptGradient:
    """What the attacker can compute of a prompt method's gradient at theta_pre.

    `fn(images, labels)`: the gradient of the mean data loss (CE) w.r.t. the shared tensor, differentiable
    w.r.t. the images. `offset`: the gradient of the data-independent regulariser (FedSEPT's
    lambda_div L_div; zero for PromptFL), which the server computes itself and removes from g^, since it
    would otherwise dominate g^ and make every image match."""

    name: str
    fn: SharedGrad
    offset: Tensor

    def target(self, observed: Tensor) -> Tensor:
        return observed - self.offset


def _prompt_parts(method: Any, env: Any, private: dict[str, Any]) -> Any:
    """The method's declared split of its loss at the text features (Method.loss_parts)."""
    return method.loss_parts(env, private)


def jacobian(f: Callable[[Tensor], Tensor], x: Tensor, *, chunk: int = 32) -> Tensor:
    """d f / d x at x as a (f(x).numel(), x.numel()) matrix, `chunk` directions at a time: forward mode
    over the input's directions or reverse mode over the output's, whichever are fewer."""
    y, vjp = torch.func.vjp(f, x)[:2]  # (output, vjp function); the stubs also admit a third item (aux)
    if y.numel() < x.numel():
        eye = torch.eye(y.numel(), dtype=y.dtype, device=y.device).view(-1, *y.shape)
        rows = [torch.func.vmap(vjp)(e)[0].reshape(len(e), -1) for e in eye.split(chunk)]
        return torch.cat(rows)
    eye = torch.eye(x.numel(), dtype=x.dtype, device=x.device).view(-1, *x.shape)
    cols = [torch.func.vmap(lambda t: torch.func.jvp(f, (x,), (t,))[1])(e).reshape(len(e), -1) for e in eye.split(chunk)]
    return torch.cat(cols).t()


class TextJacobianCache:
    """Text-side linearisations (T0 = text(theta_pre), J = dT/dtheta at theta_pre) shared by
    `prompt_shared_grad` calls, least recently used first out beyond `maxsize`.

    The linearisation depends on the method object (experts, basis, variant), the env (the text tower,
    class names, context), the shared tensor theta_pre and the client's private text-side state
    (FedSEPT's R; not its router, not its data). The key is the identities of method and env (the cache
    holds them, so the identities stay theirs) and the bytes, dtypes and shapes of theta_pre and the
    private text-side tensors: clients that start from the same broadcast theta_pre with the same R
    (e.g. R = 0 before their first round) share one Jacobian; a client whose R differs gets its own.
    Do not change a cached method or env in place."""

    def __init__(self, maxsize: int = 4) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self.hits = self.misses = 0
        self._entries: OrderedDict[tuple, tuple[Any, Any, Tensor, Tensor]] = OrderedDict()

    @staticmethod
    def digest(*tensors: Tensor) -> str:
        h = hashlib.blake2b(digest_size=20)
        for t in tensors:
            t = t.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)};".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return h.hexdigest()

    def get(self, method: Any, env: Any, parts: Any, theta: Tensor, compute: Callable[[], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        key = (id(method), id(env), parts.name, self.digest(theta), len(parts.text_state), self.digest(*parts.text_state))
        hit = self._entries.get(key)
        if hit is not None and hit[0] is method and hit[1] is env:
            self._entries.move_to_end(key)
            self.hits += 1
            return hit[2], hit[3]
        self.misses += 1
        T0, J = compute()
        self._entries[key] = (method, env, T0, J)
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)
        return T0, J

    def __len__(self) -> int:
        return len(self._entries)


def prompt_shared_grad(
    method: Any, env: Any, clip: torch.nn.Module, shared: dict[str, Tensor], private: dict[str, Any], *, linearise: bool = True,
    cache: Optional[TextJacobianCache] = None,
) -> PromptGradient:
    """The gradient of a CLIP prompt method's training loss w.r.t. its shared tensor at `shared`
    (PromptFL: CE on ctx; FedSEPT: CE + lambda_div L_div on A, with the client's R and router).

    The text features do not depend on the images, so with `linearise` (where the method allows it) the
    Jacobian J of text features w.r.t. the shared tensor is computed once, at theta_pre, and every call
    costs the image side only: grad = J^T dCE/dT. The result is the same gradient. J is the expensive
    part (a forward-mode pass of the text tower per coordinate of theta) and is the same for every client
    with the same theta_pre and private text-side state (R): pass one `cache` to the calls for several
    clients to compute it once per distinct (theta_pre, R)."""
    parts = _prompt_parts(method, env, private)
    theta = shared[parts.name].detach().to(env.device)
    p = theta.clone().requires_grad_(True)
    (offset,) = torch.autograd.grad(parts.regulariser(p), [p], allow_unused=True, materialize_grads=True)

    with sdpa_kernel(SDPBackend.MATH):  # the fused attention kernels have neither double nor forward-mode AD
        if linearise and parts.separable:

            def linearisation() -> tuple[Tensor, Tensor]:
                with sdpa_kernel(SDPBackend.MATH):
                    return parts.text(theta).detach(), jacobian(parts.text, theta)

            T0, J = linearisation() if cache is None else cache.get(method, env, parts, theta, linearisation)

            def fn(images: Tensor, labels: Tensor) -> Tensor:
                T = T0.clone().requires_grad_(True)
                with sdpa_kernel(SDPBackend.MATH):
                    loss = F.cross_entropy(parts.head(theta, T, image_features(clip, images)), labels.to(env.device))
                    (c,) = torch.autograd.grad(loss, [T], create_graph=True)
                return (c.reshape(1, -1) @ J).view_as(theta)
        else:

            def fn(images: Tensor, labels: Tensor) -> Tensor:
                q = theta.clone().requires_grad_(True)
                with sdpa_kernel(SDPBackend.MATH):
                    loss = F.cross_entropy(parts.head(q, parts.text(q), image_features(clip, images)), labels.to(env.device))
                    (g,) = torch.autograd.grad(loss, [q], create_graph=True)
                return g

    return PromptGradient(parts.name, fn, offset.detach())


# -- the attack -------------------------------------------------------------------------------

@dataclass
class Inversion:
    images: Tensor  # (B, 3, S, S), normalised
    loss: float
    grad_cos: float


def _objective(shared_grad: SharedGrad, x: Tensor, labels: Tensor, target: Tensor, tv_weight: float) -> tuple[Tensor, Tensor]:
    cos = F.cosine_similarity(shared_grad(x, labels).reshape(-1), target.reshape(-1), dim=0)
    return 1 - cos + tv_weight * total_variation(x), cos


def invert_gradient(
    shared_grad: SharedGrad,
    target: Tensor,
    labels: Tensor,
    *,
    image_size: int,
    iterations: int = 2000,
    restarts: int = 4,
    lr: float = 0.1,
    tv_weight: float = 1e-4,
    generator: torch.Generator,
    mean: Sequence[float] = CLIP_MEAN,
    std: Sequence[float] = CLIP_STD,
) -> Inversion:
    """Dummy images whose gradient matches `target` (the lowest-loss restart)."""
    low, high = (t.to(target.device) for t in pixel_range(mean, std))
    best: Inversion | None = None
    for _ in range(restarts):
        x = torch.randn((len(labels), 3, image_size, image_size), generator=generator).to(target.device)
        x = torch.max(torch.min(x, high), low).requires_grad_(True)
        opt = torch.optim.Adam([x], lr=lr)
        for _ in range(iterations):
            loss, _ = _objective(shared_grad, x, labels, target, tv_weight)
            (x.grad,) = torch.autograd.grad(loss, [x])
            opt.step()
            with torch.no_grad():
                x.copy_(torch.max(torch.min(x, high), low))
        loss, cos = _objective(shared_grad, x, labels, target, tv_weight)
        if best is None or float(loss.detach()) < best.loss:
            best = Inversion(x.detach().clone(), float(loss.detach()), float(cos.detach()))
    if best is None:
        raise ValueError("restarts must be >= 1")
    return best


@dataclass
class GIAMetrics:
    psnr: float
    clip_cos: float
    top1: float
    grad_cos: float

    def as_dict(self) -> dict[str, float]:
        return {"PSNR": self.psnr, "CLIPCos": self.clip_cos, "Top-1": self.top1, "GradCos": self.grad_cos}


def psnr(a: Tensor, b: Tensor) -> Tensor:
    """PSNR (dB) of every pair of images a[i], b[j] in [0, 1]: shape (len(a), len(b))."""
    mse = (a.flatten(1)[:, None, :] - b.flatten(1)[None, :, :]).pow(2).mean(-1)
    return 10 * torch.log10(1 / mse.clamp_min(1e-10))


def _matched(score: Tensor) -> tuple[Tensor, Tensor]:
    """Hungarian matching of reconstructions (rows) to originals (columns) maximising the total score."""
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(score.double().numpy(), maximize=True)
    return torch.as_tensor(rows), torch.as_tensor(cols)


@torch.no_grad()
def reconstruction_metrics(recon: Tensor, original: Tensor, *, clip: torch.nn.Module, env: Any, grad_cos: float = math.nan) -> GIAMetrics:
    """Each reconstruction is compared with the closest original of its client (Hungarian matching): by
    PSNR for PSNR, by CLIP-embedding cosine for CLIPCos and the zero-shot Top-1 agreement.
    `env`: the run's ClipEnv (class names and text tower, for the zero-shot classifier)."""
    from raysim.methods import TrainConfig, get_method

    pairs = psnr(to_pixels(recon), to_pixels(original))
    fr, fo = image_features(clip, recon), image_features(clip, original)
    cos = fr @ fo.t()
    zeroshot = get_method("zeroshot")
    predict = zeroshot(TrainConfig(), zeroshot.Options()).predictor(env, {}, {})
    pr, po = predict(fr).argmax(-1), predict(fo).argmax(-1)
    (a, b), (c, d) = _matched(pairs), _matched(cos)
    return GIAMetrics(
        psnr=float(pairs[a, b].mean()),
        clip_cos=float(cos[c, d].mean()),
        top1=float((pr[c] == po[d]).float().mean()),
        grad_cos=grad_cos,
    )


@dataclass
class ClientView:
    """What the attacker holds for one client: the data-term gradient function at theta_pre, the target
    (g^ with the data-independent part removed) and the labels; `originals` only score the result."""

    fn: SharedGrad
    target: Tensor
    labels: Tensor
    originals: Tensor


def invert_client(
    view: ClientView, index: int, *, clip: torch.nn.Module, env: Any, image_size: int, iterations: int = 2000,
    restarts: int = 4, lr: float = 0.1, tv_weight: float = 1e-4, seed: int = 0,
) -> tuple[Inversion, GIAMetrics]:
    """Invert client `index`'s update (its own seeded stream) and score the reconstruction within the client."""
    inv = invert_gradient(
        view.fn, view.target, view.labels, image_size=image_size, iterations=iterations, restarts=restarts, lr=lr,
        tv_weight=tv_weight, generator=torch.Generator().manual_seed(seed * 1000 + index),
    )
    return inv, reconstruction_metrics(inv.images, view.originals, clip=clip, env=env, grad_cos=inv.grad_cos)


def multi_client_gia(
    views: Sequence[ClientView], *, clip: torch.nn.Module, env: Any, image_size: int, iterations: int = 2000,
    restarts: int = 4, lr: float = 0.1, tv_weight: float = 1e-4, seed: int = 0,
) -> list[GIAMetrics]:
    """Invert every client's update separately (seeded) and score each reconstruction within its client."""
    knobs = dict(clip=clip, env=env, image_size=image_size, iterations=iterations, restarts=restarts, lr=lr,
                 tv_weight=tv_weight, seed=seed)
    return [invert_client(v, i, **knobs)[1] for i, v in enumerate(views)]


# -- in the audit: the recorded prompt uploads of a run, inverted ------------------------------------------------

GIA_COLUMNS = ("CLIPCos", "GradCos", "PSNR", "Top-1")
GIA_REFERENCE = ("rand CLIPCos", "rand Top-1")  # random images (the inversion's start): the no-leak level
GIA_ROUNDS = ("last", "all")


@dataclass(frozen=True)
class GIABudget:
    """How much gradient inversion an audit runs (fedsept.txt 5.5, SPEC 1.12: 2,000 iterations x 4
    restarts per client). The default is small so that an audit of the offline benchmark takes about a
    minute on a CPU: `images` dummies per client, `iterations` Adam steps, `restarts`, the first `clients`
    uploading clients (0 = all) of the last recorded round (`rounds="all"`: every recorded round)."""

    images: int = 4
    iterations: int = 100
    restarts: int = 1
    clients: int = 2
    rounds: str = "last"
    lr: float = 0.1
    tv_weight: float = 1e-4

    def __post_init__(self) -> None:
        from raysim.errors import ConfigError

        if self.images < 1 or self.iterations < 1 or self.restarts < 1 or self.clients < 0 or not self.lr > 0 or self.tv_weight < 0:
            raise ConfigError("gia: images >= 1, iterations >= 1, restarts >= 1, clients >= 0 (0 = all), lr > 0, tv_weight >= 0")
        if self.rounds not in GIA_ROUNDS:
            raise ConfigError(f"gia rounds must be one of {', '.join(GIA_ROUNDS)}, got {self.rounds!r}")


DEFAULT_GIA = GIABudget()


def client_images(run: Any, size: int) -> Callable[[int], Tensor]:
    """cid -> the client's training images (normalised, at the CLIP input size), in its train order."""
    from raysim.data import DATASETS, LoadSpec
    from raysim.data.partition import is_pooled

    cfg = run.cfg
    bundle = DATASETS.get(cfg.data.dataset)(LoadSpec(data_root=cfg.data.data_root, image_size=size, download=False,
                                                     seed=cfg.train.seed, cache_dir=cfg.output.cache_dir))
    pooled = is_pooled(cfg.data.partition)

    def images(cid: int) -> Tensor:
        rows = run.data.train_idx[cid]
        n = len(bundle.train.labels)  # a pooled partition's indices run over train, then test
        pick = [bundle.test.images[int(i) - n] if pooled and int(i) >= n else bundle.train.images[int(i)] for i in rows]
        return torch.stack([torch.as_tensor(p[0] if isinstance(p, (tuple, list)) else p) for p in pick]).float()

    return images


def dummy_labels(labels: Tensor, k: int) -> Tensor:
    """The labels the server gives its k dummies: the client's classes by how many samples it holds
    (most first, ties lower id first), cycled when it holds fewer than k classes. Labels are known to
    the attacker in the SPEC 1.12 setting (the batch's label counts leak from the update)."""
    counts = torch.bincount(labels)
    order = sorted((c for c in range(len(counts)) if counts[c] > 0), key=lambda c: (-int(counts[c]), c))
    return torch.tensor([order[i % len(order)] for i in range(k)], dtype=torch.long)


@register_attack
class GradientInversion(Attack):
    """Invert each attacked client's recorded update of the shared prompt tensor (options: a GIABudget).

    The server's view: theta_pre (the round's broadcast), theta_post (the upload), the client's lr and
    weight decay, the labels, and (white box, the upper bound) the client's private state as it entered
    the round (FedSEPT's R and router; its checkpoint of its previous round, or its initial state).
    g^ = -(theta_post - theta_pre) / lr is the summed update of the client's local steps: exact for one
    plain SGD step on one batch (benchmarks/gia_fedsept.py), the direction of the average gradient over
    its data for several small steps; gradient matching by cosine needs only the direction. The dummies'
    gradient is the mean over a batch of `budget.images` images with the labels of `dummy_labels`;
    each reconstruction is scored against the client's closest training image (reconstruction_metrics)."""

    name = "gradient_inversion"
    family = "update"
    order = 40  # after the update MIA

    def applies(self, run: Any, method: Any) -> bool:
        """A CLIP prompt method that declares its loss split (`loss_parts`: PromptFL, FedSEPT, DP-FPL) and
        uploads that shared tensor."""
        return declares(method, "loss_parts")

    def run(self, run: Any, method: Any, *, rounds: str = "available", clients: Optional[Sequence[int]] = None, seed: int = 0,
            options: Any = None, progress: bool = True) -> AttackOutput:
        import time

        from raysim.models.clip import ModelSpec, image_size_of, load_clip

        budget = DEFAULT_GIA if options is None else options
        out = AttackOutput()
        cfg, env = run.cfg, run.env
        recorded = run.upload_rounds()
        todo = recorded[-1:] if budget.rounds == "last" else recorded
        jobs: list[tuple[int, int]] = []
        for r in todo:
            ids = [c for c in sorted(run.uploads(r)["uploads"]) if clients is None or c in clients]
            jobs += [(r, c) for c in (ids[:budget.clients] if budget.clients else ids)]
        if not jobs:
            out.summary = clients_then_rounds(out.rows, GIA_COLUMNS + GIA_REFERENCE)
            return out
        clip = load_clip(ModelSpec(cfg.model.name, cfg.model.pretrained, cache_dir=cfg.output.cache_dir), device=env.device)
        size = image_size_of(clip)
        images_of = client_images(run, size)
        low, high = pixel_range()
        cache = TextJacobianCache()
        bar = Progress(f"audit {run.run_dir.name}: gradient inversion ({budget.images} images, {budget.iterations} iterations x "
                       f"{budget.restarts} restarts per client)", len(jobs), enabled=progress)
        for r, cid, record in run.records(jobs):
            saved = run.state_before(cid, r)
            if saved is None:
                out.skipped.append(f"round {r}, client {cid}: its state entering round {r} is no longer on disk "
                                   "(rerun with output.keep_client_states=all)")
                bar.step(f"round {r} client {cid}: skipped (state not on disk)")
                continue
            t0 = time.perf_counter()
            grad = prompt_shared_grad(method, env, clip, record["pre"], saved["private"], cache=cache)
            name = grad.name
            post = record["uploads"][cid][name].to(env.device)
            g_hat = observed_gradient(record["pre"][name].to(env.device), post, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
            target = grad.target(g_hat)
            cdata = run.data.client(cid)
            labels = dummy_labels(cdata.y_train, budget.images)
            gen = torch.Generator().manual_seed(seed * 1_000_003 + r * 1009 + cid)
            with torch.enable_grad():
                inv = invert_gradient(grad.fn, target, labels, image_size=size, iterations=budget.iterations,
                                      restarts=budget.restarts, lr=budget.lr, tv_weight=budget.tv_weight, generator=gen)
            originals = images_of(cid).to(env.device)
            got = reconstruction_metrics(inv.images, originals, clip=clip, env=env, grad_cos=inv.grad_cos).as_dict()
            noise = torch.randn((budget.images, 3, size, size), generator=gen).to(env.device)
            noise = torch.max(torch.min(noise, high.to(env.device)), low.to(env.device))
            ref = reconstruction_metrics(noise, originals, clip=clip, env=env).as_dict()
            out.rows.append({"round": r, "client": cid, **got, "rand CLIPCos": ref["CLIPCos"], "rand Top-1": ref["Top-1"],
                             "rand PSNR": ref["PSNR"], "seconds": time.perf_counter() - t0})
            if r not in out.rounds:
                out.rounds.append(r)
            bar.step(f"round {r} client {cid}: CLIPCos {got['CLIPCos']:.3f} (random images {ref['CLIPCos']:.3f}), "
                     f"GradCos {got['GradCos']:.3f}")
        out.summary = clients_then_rounds(out.rows, GIA_COLUMNS + GIA_REFERENCE)
        return out
