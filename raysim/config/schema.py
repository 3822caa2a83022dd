"""The run configuration's sections: one dataclass per section, field comments are the config reference.

This module is the leaf of the config package: it imports nothing of raysim but `raysim.errors`, so every
layer (methods, privacy, data, the engine) may use the dataclasses. Parsing lives in `raysim.config.load`,
the checks that consult the registries with the parts that own them, called from `raysim.build`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import yaml

PLACEMENTS = ("pooled", "actor_per_client")
ON_CLIENT_ERROR = ("fail", "drop")
KEEP_CLIENT_STATES = ("auto", "last", "all")
# execution.backend choices, by name (raysim.engine.backends.BACKENDS holds their classes; a test checks the two agree)
BACKEND_NAMES = ("inline", "ray")
# data.augment choices (raysim/data/augment.py): auto = official where the method's official code augments, else off
AUGMENT_CHOICES = ("auto", "off", "official")

RESUMABLE = {"resume": True}  # field metadata: the key may change when a run is resumed (it does not change results)


@dataclass
class TrainConfig:
    """The run's `train` section: the federated schedule and local optimisation. Methods receive this
    section of the run's config itself (`self.train`)."""

    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.01  # client SGD of the prompt methods (the papers use 0.001-0.002 with ViT-B/16)
    momentum: float = 0.9
    # fresh: a new SGD state per client per round | shared: one SGD state every client's round continues, client after
    # client in id order and round after round, as the FedSEPT code's one optimiser for all clients (a simulation
    # artifact of that code: its momentum carries one client's gradients into the next; no deployment could do it).
    # Needs one client host (execution.backend=inline or execution.num_actors=1), trains client by client, and under
    # DP marks every ledger invalid (docs/papers/fedsept.md "One optimiser for all clients")
    optimizer_state: str = "fresh"
    weight_decay: float = 5e-4
    n_ctx: int = 4  # learned context tokens of the CoOp prompt (the papers use 16)
    # PromptFL starts its context from this phrase; "" = random N(0, 0.02^2) (methods that do not read it take only those two)
    ctx_init: str = "a photo of a"
    rounds: int = field(default=10, metadata=RESUMABLE)  # may grow on resume, to extend a run
    num_clients: int = 10
    participation: float = 1.0  # fraction of clients sampled per round, in (0, 1]
    seed: int = 1  # one seed for the partition, client sampling and every per-(round, client) stream


@dataclass
class VPPConfig:
    """`dp.vpp`: the constants of VPP, the prototype release of vpdr.txt (dp.prototypes=vpp)."""

    rho: float = 0.3  # share of dimensions in the top-k group I_A, in (0, 0.5]
    H: float = 0.1  # cap of the discriminativeness scores
    split: float = 0.1  # r, the share of epsilon spent on the Laplace top-k partition


@dataclass
class DPConfig:
    """Local DP on what a client releases. `epsilon: inf` turns DP off."""

    epsilon: float = math.inf
    delta: float = 1e-5
    clip: float = 1.0  # per-example L2 clipping norm R_c of DP-SGD
    accountant: str = "rdp"  # rdp | prv (Opacus accountants)
    # RDP -> epsilon (dp.accountant=rdp): "tight" = Opacus' conversion; "classic" = rdp + ln(1/delta)/(alpha-1)
    # at the VPDR code's orders (SPEC 3.2 item 8; looser, so more noise at the same epsilon). Both are valid.
    conversion: str = "tight"
    microbatch: int = 8  # per-example gradients are computed this many at a time (memory bound); 0 = sized from memory
    # Steps used to calibrate sigma: "participated" = the rounds a client really takes part in
    # (fedsept.txt appendix B.2); "all_rounds" = every round, as the official code does (conservative).
    calibration: str = "participated"
    # "sample": DP-SGD on the uploaded parameters (example-level, the papers' setting);
    # "client": clip the whole uploaded update to `clip` and add Gaussian noise (user-level LDP).
    level: str = "sample"
    # DP-SGD batches: "poisson" (each example joins each batch with probability q = B/n, what the
    # accountants assume) or "shuffle" (fixed-size shuffled batches, the papers' code, accounted as if Poisson)
    sampling: str = "poisson"
    prototypes: str = "igpp"  # the mechanism of prototype releases: igpp | vpp (vpdr.txt)
    proto_clip: float = 5.0  # R, the per-example L2 clip of prototype releases (vpdr.txt clip_proto_norm)
    vpp: VPPConfig = field(default_factory=VPPConfig)  # VPP's constants (dp.vpp.rho, dp.vpp.H, dp.vpp.split)

    @property
    def enabled(self) -> bool:
        return math.isfinite(self.epsilon)



@dataclass
class DataConfig:
    """What data, and how it is split over the clients."""

    dataset: str = "synthetic"
    data_root: str = field(default="./data", metadata=RESUMABLE)  # folder holding real datasets (README "Datasets")
    download: bool = field(default=False, metadata=RESUMABLE)  # let torchvision download datasets that support it
    partition: str = "pathological"  # a registered partitioner: pathological | dirichlet | domain | iid | pfllib
    beta: float = 0.5  # Dirichlet concentration (dirichlet, domain and pfllib partitions)
    shots: int = 16  # training images per class per client (0 = all)
    # redraw the Dirichlet split until every client has this many samples; 0 = the partition's default:
    # dirichlet 10 train and 10 test samples, pfllib 40 samples in all (PFLlib's least_samples)
    min_samples: int = 0
    # data.partition=domain only: as the FedSEPT code, re-seed numpy to 0 before each class's shuffle and Dirichlet draw,
    # so every class of a domain gets the same proportions until a client is full (SPEC 1.9 item 9; train.seed unused)
    domain_reseed: bool = False
    # keep this random fraction of each domain's training split (the whole split without domains), drawn from
    # the run seed, the test split whole (raysim/data/subset.py): the VPDR code's keep_ratio, 0.1 for Digits and
    # 0.3 for PACS and Office-Caltech; 1 = every training image
    train_fraction: float = 1.0
    # training augmentation (raysim/data/augment.py), as the method's official code does it: "official" = for
    # frozen-feature methods the FedSEPT code's RandomResizedCrop(scale 0.08-1) + horizontal flip, `augment_views`
    # views per training image encoded once, one drawn per image per local epoch; for the VPDR frameworks (which
    # train on images) the VPDR code's RandomCrop(size, padding 4) + horizontal flip, drawn per image per pass from
    # the (round, client) stream; "off" = the test transform for training too; "auto" = official where that code
    # augments (FedSEPT: the CoOp and domain datasets; VPDR: vpdr_digits, pacs, office_caltech10), off elsewhere
    augment: str = "auto"
    # CIFAR's deterministic transform (raysim/data/folders.py): clip = ToTensor, Resize(bicubic), CLIP's mean/std;
    # official = the FedSEPT code's: ToTensor, the CIFAR set's own mean/std, then Resize (bilinear)
    cifar_transform: str = "clip"
    augment_views: int = 8  # augmented views per training image (the official code draws a fresh one every epoch)
    # data.dataset=pfllib: the folder's config.json, recorded here when the config is built (not set by hand)
    folder_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelConfig:
    """The foundation model: any open_clip name (ViT-B-16, ...), raysim-clip3 (bundled, the default: a ViT tower
    with patch tokens, a near-zero CoOp context scores like the phrase, room for prompt tuning; its model card),
    raysim-clip2 (bundled: its predecessor, trained on the benchmark classes' prompts), raysim-clip (bundled: the
    first, a CNN tower, captions only) or raysim-tiny."""

    name: str = "raysim-clip3"
    pretrained: str = "bundled"  # open_clip tag (openai, ...), a checkpoint path, "bundled" (the shipped raysim-clip*), "" = random init


@dataclass
class EvalConfig:
    """Evaluation (SPEC 1.10: every `every` rounds plus each of the last `last` rounds)."""

    protocol: str = "in_cross"  # the evaluation protocol (raysim/engine/evaluation.py registry)
    every: int = 5
    last: int = 5
    batch_size: int = 512
    # clients evaluated per evaluated round: 0 = all; N = a sample of N clients drawn once from train.seed (the
    # same every round); a sampled client's Cross-Client accuracy is on the other sampled clients' test splits
    clients: int = 0


@dataclass
class ExecutionConfig:
    """Where and how the run executes; none of it changes results (except num_threads, bitwise, and the
    text-tower fast paths autocast and compile, within float tolerance: README "GPUs")."""

    backend: str = field(default="ray", metadata=RESUMABLE)  # ray | inline (same code, one process, no Ray)
    placement: str = field(default="pooled", metadata=RESUMABLE)  # pooled | actor_per_client
    num_actors: int = field(default=0, metadata=RESUMABLE)  # pooled: client actors (0 = as many as the CPUs allow)
    client_cpus: float = field(default=1.0, metadata=RESUMABLE)  # CPUs reserved per client actor
    client_gpus: float = field(default=0.0, metadata=RESUMABLE)  # fraction of a GPU per client actor
    server_cpus: float = field(default=0.0, metadata=RESUMABLE)
    server_gpus: float = field(default=0.0, metadata=RESUMABLE)
    num_threads: int = 1  # torch threads per actor (results are bitwise reproducible for a fixed value)
    # clients a host trains at once, each on its own thread (with num_threads torch threads each), for methods
    # whose clients' steps are independent (Method.independent_clients: the zoo methods); results are bitwise
    # the same for any value. 0 = as many as the host has CPUs: the cores this process may use (inline), the
    # actor's client_cpus (ray)
    client_threads: int = field(default=0, metadata=RESUMABLE)
    device: str = field(default="auto", metadata=RESUMABLE)  # auto | cpu | cuda
    autocast: str = "off"  # off | bf16 | fp16: the frozen text tower under torch.autocast (fp16 needs CUDA)
    compile: bool = False  # torch.compile the text tower's forward (refused with DP-SGD: see README "GPUs")
    # "" = join the cluster `ray start --head` runs on this machine when one is up, else start one here;
    # "local" = always start a new one here; "auto" (on a node of a running cluster) or HOST:PORT = join that one
    address: str = field(default="", metadata=RESUMABLE)
    # start Ray's dashboard (bound to localhost) with a cluster raysim starts itself; a joined cluster keeps its own
    dashboard: bool = field(default=False, metadata=RESUMABLE)
    max_actor_restarts: int = field(default=3, metadata=RESUMABLE)  # actors replaced after a crash, per run
    # client failures: a client whose local training raises, uploads a non-finite tensor or takes longer
    # than client_timeout seconds (0 = no limit) stops the run (fail) or is left out of its round (drop);
    # under drop the run stops when fewer than min_clients of a round's participants remain
    on_client_error: str = field(default="fail", metadata=RESUMABLE)  # fail | drop
    client_timeout: float = field(default=0.0, metadata=RESUMABLE)
    min_clients: int = field(default=1, metadata=RESUMABLE)
    # client-batched local training (raysim/engine/batched.py): the round's participants, in id order, train in
    # stacks of up to stack_size, one text-tower forward per step for the stack, for methods that support it
    # (PromptFL, DP-FPL per_example, FedPGP); the stacks do not depend on the hosts (a stack's members of other
    # hosts are brought to the host of its first member), so results are bitwise the same on any backend and pool
    # size; equal to client by client up to float reassociation (1e-5 for PromptFL; docs/concepts/architecture.md). false: client by client
    batch_clients: bool = True
    stack_size: int = 64


@dataclass
class OutputConfig:
    """Where the run writes, and what."""

    out_dir: str = field(default="", metadata=RESUMABLE)  # "" = runs/<method>-<dataset>-<timestamp>
    resume: str = field(default="", metadata=RESUMABLE)  # a run folder to continue from its last completed round
    cache_dir: str = field(default="~/.cache/raysim", metadata=RESUMABLE)  # frozen image features, generated data
    tensorboard: bool = field(default=True, metadata=RESUMABLE)
    progress: bool = field(default=True, metadata=RESUMABLE)
    record_uploads: bool = field(default=False, metadata=RESUMABLE)  # what the server saw, for the attacks
    # clients' checkpoints kept under state/clients/: "last" (the two a resume can need), "all" (every round's:
    # an audit attacks each recorded round with the model that made its release), "auto" = all with record_uploads
    keep_client_states: str = field(default="auto", metadata=RESUMABLE)


def keeps_all_client_states(output: OutputConfig) -> bool:
    """Whether every round's client checkpoint stays on disk (output.keep_client_states, auto: with record_uploads)."""
    return output.keep_client_states == "all" or (output.keep_client_states == "auto" and bool(output.record_uploads))


SECTIONS: dict[str, type] = {
    "data": DataConfig, "model": ModelConfig, "train": TrainConfig, "eval": EvalConfig,
    "execution": ExecutionConfig, "output": OutputConfig, "dp": DPConfig,
}


@dataclass
class RunConfig:
    """Everything that defines one federated run, in sections. Field comments are the config reference."""

    method: str = "promptfl"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)  # what every method's local training sees (this object)
    eval: EvalConfig = field(default_factory=EvalConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    dp: DPConfig = field(default_factory=DPConfig)
    # per-method sections (validated against each method's Options dataclass)
    methods: dict[str, Any] = field(default_factory=dict)

    def resumable_keys(self) -> set[str]:
        """Dotted keys that may differ between a run and its resume (field metadata)."""
        return {f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)
                if f.metadata.get("resume")}

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("methods")
        for name, section in sorted(self.methods.items()):
            d[name] = dataclasses.asdict(section) if dataclasses.is_dataclass(section) and not isinstance(section, type) else dict(section)
        return d

    def to_yaml(self) -> str:
        return yaml.dump(_yaml_safe(self.to_dict()), Dumper=_PlainDumper, sort_keys=False)


class _PlainDumper(yaml.SafeDumper):
    """Writes every value out, never as an anchor and aliases: config.yaml is read back by a loader that
    refuses aliases (raysim.config.load.NoAliasLoader)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _yaml_safe(obj: Any) -> Any:
    if isinstance(obj, float) and math.isinf(obj):
        return "inf" if obj > 0 else "-inf"
    if isinstance(obj, dict):
        return {k: _yaml_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_yaml_safe(v) for v in obj]
    return obj
