"""What the six ProtoPFL frameworks of VPDR share (vpdr.txt, SPEC 3): the ViT-adapter client model, its
local fine-tuning with DCR, the prototype release through the host, and the `privacy` knob.

Model (SPEC 3.6, raysim/models/vit_adapter.py): a frozen backbone (the shipped raysim-vit offline, any
local `transformers` ViT folder, an open_clip visual tower, or a SPEC 3.6 heterogeneous setting) with a
bottleneck adapter after every block, a frozen seeded projection to 512 and an MLP head; adapters and head
train with AdamW (lr 1e-3, wd 5e-4), the optimiser state kept per client in its private state.

The privacy setting (SPEC 3.2-3.3; vpdr.txt Table 1 and the ablation table): one knob per choice.

    dp.epsilon     inf: no LDP (plain prototypes); finite: every release is the host's, into the client's ledger
    dp.prototypes  the release mechanism: igpp (default: per-example L2 clip to R = dp.proto_clip, class mean,
                   isotropic Gaussian, the paper's Eq. 4-6) | vpp (private top-k partition, dp.vpp.split x
                   epsilon, + group clipping + reallocated noise); privacy/mechanisms/igpp.py, vpp.py
    <method>.dcr   DCR local training (false by default; it needs LDP: the soft clip aims at the release's R)

The paper's rows: no LDP = dp.epsilon=inf; IGPP = dp.epsilon=1; VPP only = dp.epsilon=1 dp.prototypes=vpp;
DCR only = dp.epsilon=1 <method>.dcr=true; VPDR = dp.epsilon=1 dp.prototypes=vpp <method>.dcr=true.
The previous knob `<method>.privacy=none|igpp|vpp|dcr|vpdr|auto` works in this release (one deprecation
message per value; `legacy_privacy` maps it onto the method's dp section and DCR, with its old refusals).
VPP's constants are the run's dp section (dp.vpp.rho = the paper's rho in (0, 0.5], dp.vpp.H, dp.vpp.split,
dp.proto_clip = R); DCR's are this section's (soft_clip_gamma, expand, ema_beta, kd_tau, kd_weight, warmup).

DCR (SPEC 3.3): z_hat = soft_clip(z) (shrink-only by default; `expand=true` is the paper's Eq. 15) feeds
the head for CE, accuracy-in-training and the framework's losses ("feat"); an EMA teacher copy of the head
(made on first use, beta 0.999, updated after every optimiser step once the client's step counter is >= 5)
gives KD KL(softmax(t(z)/tau) || softmax(head(z_hat)/tau)) tau^2 with weight 0.05, skipped for the first 5
steps of the client's lifetime (the counter is never reset across rounds). Testing uses head(z), no clip.

Training augmentation (data.augment=official, the default `auto` on vpdr_digits, pacs and office_caltech10: the
VPDR code's RandomCrop(224, padding 4) + horizontal flip, raysim/data/padcrop.py): every pass over the training
images, each local epoch and the release's (the code computes its prototypes through its training loader), reads
them through `data.train_batch(idx, epoch)`, freshly cropped and flipped; testing reads them as they are.

Round order (SPEC 3.4), the engine's two-phase round (`release_first`, raysim/engine/backends.py). Per round t:
(a) every participating client's `local_release` uploads the `release` hook's noisy prototypes of its
current model (in round 1 the untrained adapters; eval mode, un-soft-clipped features), each through the
host's release into the client's ledger; (b) the server aggregates them; (c) broadcasts; (d) each of those
clients' `local_train` runs E epochs with these fresh global prototypes and uploads nothing; (e) every
client is tested (the engine's evaluation). So round 1 already trains with the untrained adapters'
prototypes, and a client makes T releases over T participations: the accounting is the paper's.

Hooks a framework overrides (H7's methods/vpdr_frameworks.py wires FPL, FedPLVM, FedPCL, FedTGP, MPFT here):

    init_shared(env, rng) -> dict            the initial broadcast state (tensors); required
    aggregate(env, shared, uploads, rng)     the server step -> dict or ServerResult; required
    round_context(env, shared, private, data) -> Any
                                             per-round, per-client state the losses read (default: the
                                             broadcast tensors on the device, as a dict)
    loss_terms(env, ctx, *, feat, logits, y, x, model) -> dict[str, Tensor]
                                             the framework's loss on one batch, one entry per term, each
                                             already weighted (their sum is minimised; default {"ce": CE}).
                                             feat: the (soft-clipped under DCR) 512-d feature, logits =
                                             head(feat), x the images, model the ViTAdapterNet.
                                             Names must be in `loss_names` (they are logged per term);
                                             the base adds "kd" under DCR.
    release_features(env, model, data) -> Tensor
                                             (N, d) features the prototypes are computed from (eval mode,
                                             un-soft-clipped: SPEC 3.3); default the adapter path model.features
    release(env, model, data, privacy, ctx) -> dict[str, Tensor]
                                             the upload, from the model before this round's training (ctx:
                                             round_context of the broadcast it is made under, the previous
                                             round's aggregate); default {"protos": host-released class
                                             means, "counts": public class counts}
    predictor(env, shared, private, data)    default logits head(z) of the client's model (no soft clip)

and declares `releases` (default protos + counts), `loss_names` (default ("ce",)), `server_metrics`.
local_release and local_train run the hooks inside a torch RNG fork seeded from their `rng` (dropout draws
from the global generator): a hook that builds modules on its first call must seed them itself (as
`ViTAdapterNet` does), or inline, Ray and resumed runs part ways.
Helpers for them: `model(env, private)`, `train_features(env, model, data)`, `self.dcr`, `self.opts`.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.data.padcrop import NAME as PAD_CROP_FLIP
from raysim.errors import ConfigError
from raysim.methods.base import ClientData, EnvSpec, LocalResult, Method, Needs, TrainConfig, Upload
from raysim.methods.families.prototype import COUNTS_NOTE
from raysim.models.vit_adapter import (
    BUNDLED_VIT,
    HETERO,
    Backbone,
    ModelConfig,
    ViTAdapterNet,
    backbone_image_size,
    client_model_config,
    load_backbone,
)
from raysim.privacy.dcr import EMATeacher, kd_loss, soft_clip
from raysim.privacy.mechanisms import ReleaseSpec, prototype, public
from raysim.sampling import epoch_batches

PRIVACY = ("auto", "none", "igpp", "vpp", "dcr", "vpdr")  # the deprecated <method>.privacy values
WITH_DCR = ("dcr", "vpdr")
# what each deprecated value is written as now (the deprecation message)
LEGACY = {
    "auto": "nothing: drop it (the default: dp.epsilon and dp.prototypes decide, without DCR)",
    "none": "dp.epsilon=inf (no LDP)",
    "igpp": "dp.epsilon=EPS (dp.prototypes=igpp is the default)",
    "vpp": "dp.epsilon=EPS dp.prototypes=vpp",
    "dcr": "dp.epsilon=EPS <method>.dcr=true",
    "vpdr": "dp.epsilon=EPS dp.prototypes=vpp <method>.dcr=true",
}
_WARNED: set[str] = set()


@dataclass
class VPDROptions:
    """The knobs every VPDR framework shares (its section is the method's name, e.g. vpdr_fedproto.dcr=true)."""

    dcr: bool = False  # DCR local training (soft clip + EMA-teacher KD); with dp.prototypes=vpp: VPDR (module docstring)
    privacy: str = ""  # deprecated: none | igpp | vpp | dcr | vpdr | auto, mapped onto dp.* and dcr ("" = not used)
    backbone: str = BUNDLED_VIT  # raysim-vit | a local transformers ViT folder | open_clip:NAME[:TAG] | resnet18 | resnet34
    hetero: str = ""  # "" (homogeneous) | HtFE4 | HtC4 | HtFE4-HtC2 (client i gets config i mod 4)
    vit_tiny: str = BUNDLED_VIT  # hetero: the ViT-tiny backbone (a local folder; offline the shipped ViT)
    vit_small: str = BUNDLED_VIT  # hetero: the ViT-small backbone
    resnet_weights: str = ""  # hetero: a folder with resnet18.pth / resnet34.pth ("" = random frozen)
    head: tuple[int, ...] = (512,)  # hidden sizes of the MLP head (homogeneous)
    adapter_dim: int = 0  # 0 = by backbone width (8 / 16 / 32 for ViT tiny / small / base)
    proj_seed: int = 0  # seed of the frozen random projection to 512 (the same for every client)
    lr: float = 1e-3  # AdamW (persistent per client); train.lr is not used
    weight_decay: float = 5e-4
    soft_clip_gamma: float = 0.05  # DCR gamma
    expand: bool = False  # DCR: drop the soft clip's cap at 1 (the paper's Eq. 15; the code only shrinks)
    ema_beta: float = 0.999
    kd_tau: float = 4.0
    kd_weight: float = 0.05  # lambda_1
    warmup: int = 5  # local steps before KD and EMA start (per client lifetime)

    def __post_init__(self) -> None:
        # built at config time only (the engine's hosts receive it built): one message per deprecated value
        if self.privacy in LEGACY and self.privacy not in _WARNED:
            _WARNED.add(self.privacy)
            warnings.warn(f"<method>.privacy={self.privacy} is deprecated; write {LEGACY[self.privacy]} instead "
                          "(the old knob works in this release and will be refused in the next)", FutureWarning, stacklevel=3)


def validate_vpdr(o: VPDROptions, name: str) -> None:
    if o.privacy and o.privacy not in PRIVACY:
        raise ConfigError(f"{name}.privacy (deprecated) must be one of {', '.join(PRIVACY)}, got {o.privacy!r}; "
                          f"better: choose the mechanism by dp.prototypes and DCR by {name}.dcr=true|false")
    if o.privacy and o.dcr:
        raise ConfigError(f"{name}.privacy={o.privacy} (deprecated) and {name}.dcr=true both say whether DCR runs; "
                          f"drop {name}.privacy and write {LEGACY[o.privacy].replace('<method>', name)}")
    if o.hetero and o.hetero not in HETERO:
        raise ConfigError(f"{name}.hetero must be one of {', '.join(HETERO)} or empty (homogeneous), got {o.hetero!r}")
    if not o.backbone.strip():
        raise ConfigError(f"{name}.backbone must name a backbone ({BUNDLED_VIT}, a ViT folder, open_clip:NAME, resnet18)")
    if not o.head or any(int(h) < 1 for h in o.head):
        raise ConfigError(f"{name}.head must be a non-empty list of positive hidden sizes, got {list(o.head)}")
    if o.adapter_dim < 0:
        raise ConfigError(f"{name}.adapter_dim must be >= 0 (0 = by backbone width)")
    if not (o.lr > 0 and o.weight_decay >= 0):
        raise ConfigError(f"{name}.lr must be > 0 and {name}.weight_decay >= 0")
    if not (o.soft_clip_gamma >= 0 and 0 <= o.ema_beta < 1 and o.kd_tau > 0 and o.kd_weight >= 0 and o.warmup >= 0):
        raise ConfigError(f"{name}: DCR needs soft_clip_gamma >= 0, ema_beta in [0, 1), kd_tau > 0, kd_weight >= 0, warmup >= 0")


def effective_dp(dp: Any, o: VPDROptions, *, method: str) -> tuple[Any, bool]:
    """(the dp section the host resolves this method's releases with, whether DCR is on): the run's dp and
    `o.dcr`, or what the deprecated `o.privacy` maps them to."""
    if o.privacy:
        return legacy_privacy(dp, o.privacy, method=method)
    if o.dcr and not dp.enabled:
        raise ConfigError(
            f"{method}.dcr=true shapes training toward the clip bound R = dp.proto_clip of a private prototype release, "
            f"so it needs a budget: set dp.epsilon (the paper uses 1 or 2), or leave {method}.dcr=false"
        )
    return dp, bool(o.dcr)


def legacy_privacy(dp: Any, privacy: str, *, method: str) -> tuple[Any, bool]:
    """The deprecated knob `<method>.privacy`, mapped at the edge onto (dp with dp.prototypes set, DCR), with
    the refusals it always had."""
    if privacy == "auto":  # as the dp section says: no LDP, or dp.prototypes' mechanism; no DCR
        return dp, False
    if privacy == "none":
        if dp.enabled:
            raise ConfigError(
                f"{method}.privacy=none releases prototypes without LDP, but dp.epsilon={dp.epsilon:g} asks for LDP; "
                f"leave dp.epsilon=inf, or choose {method}.privacy=igpp|vpp|dcr|vpdr"
            )
        return dp, False
    if not dp.enabled:
        raise ConfigError(
            f"{method}.privacy={privacy} is a local-DP release, so it needs a budget: set dp.epsilon (the paper uses 1 or 2), "
            f"or choose {method}.privacy=none"
        )
    if dp.level != "sample":
        raise ConfigError(f"{method}.privacy={privacy} releases prototypes (example-level LDP); use dp.level=sample")
    mech = "vpp" if privacy in ("vpp", "vpdr") else "igpp"
    if dp.prototypes not in ("igpp", mech):  # igpp is the default: only a deliberate other choice conflicts
        raise ConfigError(
            f"{method}.privacy={privacy} releases with {mech}, but dp.prototypes={dp.prototypes}; "
            f"leave dp.prototypes at its default (the privacy knob sets it) or choose {method}.privacy to match"
        )
    return dataclasses.replace(dp, prototypes=mech), privacy in WITH_DCR


@dataclass
class VPDREnv:
    """Per host: the device, class count, feature dim, the frozen backbones (by spec, loaded once) and a
    cache of client models (their weights live in each client's private state)."""

    device: torch.device
    num_classes: int
    feature_dim: int = 512
    backbones: dict[str, Backbone] = field(default_factory=dict)
    models: dict[int, ViTAdapterNet] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # the frameworks' own per-host things


class VPDRMethod(Method):
    """Base of the VPDR ProtoPFL frameworks (see the module docstring for the hooks)."""

    Options: ClassVar[type] = VPDROptions
    eval_ignores: ClassVar[tuple[str, ...]] = ("opt",)  # the optimiser state only continues training
    releases: ClassVar[dict[str, ReleaseSpec]] = {"protos": prototype(), "counts": public(COUNTS_NOTE)}
    loss_names: ClassVar[tuple[str, ...]] = ("ce",)
    release_first: ClassVar[bool] = True  # SPEC 3.4: release, aggregate, broadcast, then train (module docstring)
    image_augment: ClassVar[str] = PAD_CROP_FLIP  # the code's RandomCrop(224, padding 4) + flip, under data.augment

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.client_metrics = ("loss",) + tuple(cls.loss_names) + ("kd",)

    def __init__(self, train: TrainConfig, options: Any, dp: Any = None) -> None:
        super().__init__(train, options, dp)
        validate_vpdr(options, self.name)
        plain = TrainConfig()
        if train.momentum != plain.momentum or train.weight_decay != plain.weight_decay:
            raise ConfigError(
                f"{self.name} trains adapters and head with AdamW (SPEC 3.1): train.momentum and train.weight_decay do not apply; "
                f"leave them at their defaults and set {self.name}.lr / {self.name}.weight_decay"
            )
        dp_eff, self.dcr = effective_dp(self.dp, options, method=self.name)
        self.dp: Any = dp_eff

    # -- what the method needs -----------------------------------------------------------------
    def client_configs(self) -> list[ModelConfig]:
        o = self.opts
        n = 4 if o.hetero else 1
        return [self.model_config(i) for i in range(n)]

    def model_config(self, client_id: int) -> ModelConfig:
        o = self.opts
        return client_model_config(backbone=o.backbone, hetero=o.hetero, client_id=client_id, head=o.head,
                                   adapter_dim=o.adapter_dim, vit_tiny=o.vit_tiny, vit_small=o.vit_small,
                                   resnet_weights=o.resnet_weights)

    def needs(self) -> Needs:
        return Needs(input="images", image_size=max(backbone_image_size(c.backbone) for c in self.client_configs()),
                     image_augment=self.image_augment)

    # -- env and the client's model ------------------------------------------------------------
    def build_env(self, spec: EnvSpec, *, role: str) -> VPDREnv:
        return VPDREnv(torch.device(spec.device), len(spec.classnames))

    def backbone(self, env: VPDREnv, spec: str) -> Backbone:
        bb = env.backbones.get(spec)
        if bb is None:
            bb = load_backbone(spec, image_size=self.needs().image_size).to(env.device)
            env.backbones[spec] = bb
        return bb

    def build_model(self, env: VPDREnv, cfg: ModelConfig, *, init_seed: int = 0) -> ViTAdapterNet:
        return ViTAdapterNet(self.backbone(env, cfg.backbone), env.num_classes, head=cfg.head, adapter_dim=cfg.adapter_dim,
                             feature_dim=env.feature_dim, proj_seed=self.opts.proj_seed, init_seed=init_seed)

    def init_private(self, env: VPDREnv, data: ClientData, rng: torch.Generator) -> dict[str, Any]:
        cfg = self.model_config(data.client_id)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
        model = self.build_model(env, cfg, init_seed=seed)
        return {"client": data.client_id, "config": dataclasses.asdict(cfg), "model": model.trainable_state(),
                "opt": None, "teacher": None, "steps": 0}

    def model(self, env: VPDREnv, private: dict[str, Any]) -> ViTAdapterNet:
        """The client's model with its weights loaded (one cached module per client on this host)."""
        cid = int(private["client"])
        c = private["config"]
        cfg = ModelConfig(c["backbone"], tuple(c["head"]), int(c["adapter_dim"]))
        m = env.models.get(cid)
        if m is None or getattr(m, "config", None) != cfg:
            m = self.build_model(env, cfg)
            m.config = cfg  # type: ignore[assignment]
            env.models[cid] = m
        m.load_trainable(private["model"])
        return m.to(env.device)

    def optimizer(self, model: ViTAdapterNet, private: dict[str, Any]) -> torch.optim.Optimizer:
        opt = torch.optim.AdamW(model.trainable_parameters(), lr=self.opts.lr, weight_decay=self.opts.weight_decay)
        if private.get("opt") is not None:
            opt.load_state_dict(_clone(private["opt"]))
        return opt

    def teacher(self, model: ViTAdapterNet, private: dict[str, Any]) -> EMATeacher:
        t = EMATeacher(model.head, beta=self.opts.ema_beta, warmup=self.opts.warmup)
        if private.get("teacher") is not None:
            t.teacher.load_state_dict(private["teacher"])
        return t.to(next(model.head.parameters()).device)

    @torch.no_grad()
    def train_features(self, env: VPDREnv, model: ViTAdapterNet, data: ClientData, batch: int = 256, test: bool = False) -> Tensor:
        """(N, d) features z (adapter path, un-clipped, eval mode) of the client's training set as the release's pass
        sees it (its drawn crops under data.augment), or of its test set."""
        model.eval()
        if test:
            return torch.cat([model.features(data.x_test[i : i + batch].to(env.device)).float().cpu()
                              for i in range(0, data.x_test.shape[0], batch)])
        return torch.cat([model.features(data.train_batch(torch.arange(i, min(i + batch, data.num_train)), device=env.device)).float().cpu()
                          for i in range(0, data.num_train, batch)])

    # -- hooks (frameworks override) -------------------------------------------------------------
    def round_context(self, env: VPDREnv, shared: dict[str, Tensor], private: dict[str, Any], data: ClientData) -> Any:
        return {k: v.to(env.device) for k, v in shared.items()}

    def loss_terms(self, env: VPDREnv, ctx: Any, *, feat: Tensor, logits: Tensor, y: Tensor, x: Tensor,
                   model: ViTAdapterNet) -> dict[str, Tensor]:
        return {"ce": F.cross_entropy(logits, y)}

    def release_features(self, env: VPDREnv, model: ViTAdapterNet, data: ClientData) -> Tensor:
        return self.train_features(env, model, data)

    def release(self, env: VPDREnv, model: ViTAdapterNet, data: ClientData, privacy: Any, ctx: Any) -> dict[str, Tensor]:
        feats = self.release_features(env, model, data)
        protos = privacy.release("protos", features=feats, labels=data.y_train, num_classes=data.num_classes)
        return {"protos": protos, "counts": torch.bincount(data.y_train, minlength=data.num_classes).float()}

    def init_shared(self, env: VPDREnv, rng: torch.Generator) -> dict[str, Tensor]:
        raise NotImplementedError

    def aggregate(self, env: VPDREnv, shared: dict[str, Tensor], uploads: list[Upload], rng: torch.Generator):
        raise NotImplementedError

    # -- the client's round ----------------------------------------------------------------------

    def local_release(self, env: VPDREnv, shared: dict[str, Tensor], private: dict[str, Any], data: ClientData, *,
                      rng: torch.Generator, privacy: Any) -> LocalResult:
        """(a) The round's upload: the `release` hook on the client's current model (before this round's
        training; in its first round the untrained adapters). The private state is unchanged."""
        model = self.model(env, private)
        upload = _forked(env, rng, lambda: self.release(env, model, data, privacy, self.round_context(env, shared, private, data)))
        return LocalResult(upload=upload, private=private, num_samples=data.num_train)

    def local_train(self, env: VPDREnv, shared: dict[str, Tensor], private: dict[str, Any], data: ClientData, *,
                    rng: torch.Generator, privacy: Any) -> LocalResult:
        """(d) E epochs of the framework's loss (+ DCR) with the just-broadcast state; uploads nothing.
        Dropout draws from torch's global generator, so it is seeded here from `rng` (and restored after),
        once the model is built (building a backbone may draw from it too, and only on a host's first call)."""
        model = self.model(env, private)
        return _forked(env, rng, lambda: self._local_train(env, model, shared, private, data, rng=rng))

    def _local_train(self, env: VPDREnv, model: ViTAdapterNet, shared: dict[str, Tensor], private: dict[str, Any],
                     data: ClientData, *, rng: torch.Generator) -> LocalResult:
        opt = self.optimizer(model, private)
        teacher = self.teacher(model, private) if self.dcr else None
        ctx = self.round_context(env, shared, private, data)
        o = self.opts
        R = float(self.dp.proto_clip)
        steps = int(private.get("steps", 0))
        sums: dict[str, float] = {}
        n_batches = 0
        model.train()
        for epoch in range(self.train.local_epochs):
            for idx in epoch_batches(data.num_train, self.train.batch_size, rng, shuffle=True):
                x, y = data.train_batch(idx, epoch, device=env.device), data.y_train[idx].to(env.device)
                z = model.features(x)
                feat = soft_clip(z, R=R, gamma=o.soft_clip_gamma, expand=o.expand) if self.dcr else z
                logits = model.head_logits(feat)
                terms = dict(self.loss_terms(env, ctx, feat=feat, logits=logits, y=y, x=x, model=model))
                if teacher is not None and steps >= o.warmup and o.kd_weight > 0:
                    terms["kd"] = o.kd_weight * kd_loss(logits, teacher(z.detach()), o.kd_tau)
                loss = torch.stack([t.reshape(()) for t in terms.values()]).sum()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if teacher is not None:
                    teacher.update(model.head, steps)
                steps += 1
                n_batches += 1
                sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
                for k, t in terms.items():
                    sums[k] = sums.get(k, 0.0) + float(t.detach())
        new_private = {
            **private,
            "model": model.trainable_state(),
            "opt": _clone(opt.state_dict(), cpu=True),
            "teacher": None if teacher is None else {k: v.detach().cpu().clone() for k, v in teacher.teacher.state_dict().items()},
            "steps": steps,
        }
        metrics = {k: v / max(1, n_batches) for k, v in sums.items()}
        return LocalResult(upload={}, private=new_private, num_samples=data.num_train, metrics=metrics)

    def predictor(self, env: VPDREnv, shared: dict[str, Tensor], private: dict[str, Any], data: Optional[ClientData] = None):
        """Logits head(z) of the client's own model (no soft clip at test time: SPEC 3.3)."""
        model = self.model(env, private).eval()
        return lambda x: model(x.to(env.device))[1]


def _forked(env: VPDREnv, rng: torch.Generator, fn: Any) -> Any:
    """fn() with torch's global generator (and the device's) forked and seeded from `rng`."""
    seed = int(torch.randint(0, 2**62, (1,), generator=rng))
    devices = [env.device.index or 0] if env.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return fn()


def _clone(obj: Any, cpu: bool = False) -> Any:
    """A deep copy of an optimiser state dict (tensors cloned, to the CPU when `cpu`)."""
    if isinstance(obj, Tensor):
        t = obj.detach()
        return (t.cpu() if cpu else t).clone()
    if isinstance(obj, dict):
        return {k: _clone(v, cpu) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v, cpu) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone(v, cpu) for v in obj)
    return copy.copy(obj)
