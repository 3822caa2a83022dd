"""`raysim audit RUN_DIR | SWEEP_DIR | COMPARE_DIR`: for a run, what each client spent and what an attacker got.

For one run folder (made with output.record_uploads=true) it reads what the server saw (uploads/), the
clients' checkpoints (state/) and their privacy ledgers, runs every attack that applies to the run's
method and writes RUN_DIR/audit.md plus CSVs:

  ledger           per client and mechanism: sigma, sampling rate q, steps, rounds, epsilon spent of its
                   target (audit_ledger.csv)
  prototype methods (an upload `protos` that is a prototype release, a client model with features(x):
                   FedProto, FedTGP, the VPDR frameworks), vpdr.txt section 5.4 / SPEC 3.7:
    FSH            feature-space hijacking of every attacked client's release (raysim.attacks.fsh):
                   Cos Sim, cFFD, Top-1 Hit (audit_fsh.csv: one row per round, client and class)
    prototype MIA  per client up to 800 member (train) and 800 non-member (its own test split) features
                   per class from the client's own extractor, scored against its released prototype of
                   their class (raysim.attacks.prototype_mia): AUC, TPR@1%FPR, TPR@0.1%FPR, advantage,
                   F1 (audit_mia.csv: one row per round and client)
  other methods (the FedSEPT family: prompt uploads), fedsept.txt section 5.5 / SPEC 1.12:
    update MIA     the update-only and update-and-query logistic attackers (raysim.attacks.update_mia):
                   mean AUC over rounds, final-round AUC, HM (audit_update_mia.csv)
    GIA            gradient inversion of the uploaded prompt tensor (raysim.attacks.gradient_inversion),
                   for the prompt methods that declare loss_parts (PromptFL, FedSEPT, DP-FPL): CLIPCos,
                   GradCos, PSNR, zero-shot Top-1 agreement, and CLIPCos of random images (the no-leak
                   level), under a bounded budget (GIABudget: 4 images, 100 iterations, 1 restart, the
                   first 2 clients of the last round; --gia-* flags) (audit_gia.csv)

Threat model of the prototype attacks (SPEC 3.7): a white-box server that knows each client's model. The
model behind a round-r release is the client's checkpoint of round r for a method that releases after
its local training (FedProto, FedTGP), or the state it entered round r with for one that declares
`release_first` (the VPDR frameworks: release, aggregate, then train). A run that records its uploads keeps every round's client state
(output.keep_client_states=auto), so every recorded round is attacked (`rounds="available"`, the
default; `rounds="last"`: only the last). With keep_client_states=last only the last two rounds' models
are on disk, and the other rounds are listed as not attacked.

Averaging (vpdr.txt E.6.2, SPEC 3.7): a client's metrics are the mean over its attacked classes (FSH) or
its macro-average over classes (MIA); per round the mean over clients; the reported value is the mean
over rounds ± the standard deviation over rounds. The GIA's are averaged the same way.

For a folder of runs (a `raysim sweep` experiment, a `raysim compare` output, any folder holding run
folders) every run is audited (its own audit.md), and FOLDER/audit.md + audit.csv gather one row per run
in the paper's layout (epsilon, LDP mechanism, metrics, utility). With two or more values of dp.epsilon
it draws FOLDER/audit_vs_epsilon.png: the attacks' AUC / Cos Sim / GIA CLIPCos against epsilon with the
utility (HM for the update family, In-Client accuracy for the prototype methods) on the same figure.
Long attacks print progress lines ([k/N], elapsed, estimated time left) to stderr.

A run without uploads/ cannot be audited: the message says to rerun it with output.record_uploads=true
(exit status 2).
"""

from raysim.attacks.base import (  # noqa: F401 (the audit's public names)
    ROUNDS,
    Progress,
    attack_family,
    classifier_of,
    clients_then_rounds,
    extractor_of,
    per_round_means,
    record_hint,
    released_prototypes,
)
from raysim.attacks.fsh import FSH_COLUMNS, FSH_REFERENCE  # noqa: F401
from raysim.attacks.gradient_inversion import DEFAULT_GIA, GIA_COLUMNS, GIA_REFERENCE, GIA_ROUNDS, GIABudget  # noqa: F401
from raysim.attacks.prototype_mia import MIA_COLUMNS  # noqa: F401
from raysim.tools.audit.cli import main  # noqa: F401
from raysim.tools.audit.drivers import DEFAULT_FSH, audit_folder, audit_run, find_runs  # noqa: F401
from raysim.tools.audit.report import (  # noqa: F401
    AuditResult,
    GIAAudit,
    PrototypeAudit,
    Series,
    epsilon_series,
    ldp_of,
    ledger_markdown,
    ledger_rows,
    plot_vs_epsilon,
    run_markdown,
    write_run,
)
