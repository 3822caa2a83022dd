"""`raysim audit RUN_DIR | FOLDER [--rounds R] ...`: the command (raysim/tools/audit/__init__.py says what it does)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from raysim.attacks.base import ROUNDS, say
from raysim.attacks.fsh import FSHConfig
from raysim.attacks.gradient_inversion import GIA_ROUNDS, GIABudget
from raysim.errors import RaysimError
from raysim.tools.audit.drivers import audit_folder, audit_run
from raysim.tools.audit.report import run_markdown

DESCRIPTION = ("`raysim audit RUN_DIR | SWEEP_DIR | COMPARE_DIR`: for a run, what each client spent and what an attacker "
               "got.")


def main(argv: Optional[Sequence[str]] = None) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(prog="raysim audit", description=DESCRIPTION)
    ap.add_argument("path", help="a run folder recorded with output.record_uploads=true, or a folder of runs (sweep, compare)")
    ap.add_argument("--rounds", choices=ROUNDS, default="available",
                    help="prototype attacks: every recorded round whose releasing models are on disk (default), or the last")
    ap.add_argument("--clients", type=int, nargs="*", default=None, help="attack only these clients (default: all)")
    ap.add_argument("--no-fsh", action="store_true", help="skip feature-space hijacking")
    ap.add_argument("--no-mia", action="store_true", help="skip the prototype MIA")
    ap.add_argument("--fsh-steps", type=int, default=FSHConfig.max_steps, help="FSH: most optimisation steps (SPEC: 100000)")
    ap.add_argument("--fsh-patience", type=int, default=FSHConfig.patience,
                    help="FSH: early stop after this many steps without improvement")
    ap.add_argument("--fsh-classes", type=int, default=FSHConfig.classes, help="FSH: classes attacked per client (SPEC: 3)")
    ap.add_argument("--fsh-objective", choices=("mse", "cos"), default="mse")
    ap.add_argument("--max-per-class", type=int, default=800, help="MIA: members and non-members per class (SPEC: 800)")
    ap.add_argument("--nonmembers", choices=("other_clients", "own_test"), default="other_clients", help="update MIA non-members")
    ap.add_argument("--no-gia", action="store_true", help="skip the gradient inversion of prompt uploads")
    ap.add_argument("--gia-images", type=int, default=GIABudget.images, help="GIA: dummy images per client (default 4)")
    ap.add_argument("--gia-iterations", type=int, default=GIABudget.iterations,
                    help="GIA: Adam steps per restart (default 100; SPEC 1.12: 2000)")
    ap.add_argument("--gia-restarts", type=int, default=GIABudget.restarts, help="GIA: restarts, best kept (default 1; SPEC: 4)")
    ap.add_argument("--gia-clients", type=int, default=GIABudget.clients,
                    help="GIA: the first N uploading clients of each attacked round (default 2; 0 = all)")
    ap.add_argument("--gia-rounds", choices=GIA_ROUNDS, default=GIABudget.rounds, help="GIA: the last recorded round (default) or all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    path = Path(args.path).expanduser()
    try:
        fsh = None if args.no_fsh else FSHConfig(max_steps=args.fsh_steps, patience=args.fsh_patience, classes=args.fsh_classes,
                                                 objective=args.fsh_objective, min_steps=min(FSHConfig.min_steps, args.fsh_steps))
        gia = None if args.no_gia else GIABudget(images=args.gia_images, iterations=args.gia_iterations, restarts=args.gia_restarts,
                                                 clients=args.gia_clients, rounds=args.gia_rounds)
        kw = dict(rounds=args.rounds, fsh=fsh, mia=not args.no_mia, max_per_class=args.max_per_class, clients=args.clients,
                  seed=args.seed, nonmembers=args.nonmembers, gia=gia, progress=not args.quiet)
        if (path / "config.yaml").is_file():
            res = audit_run(path, **kw)
            sys.stdout.write(run_markdown(res))
            say(f"wrote {path / 'audit.md'}")
        else:
            audit_folder(path, **kw)
            sys.stdout.write((path / "audit.md").read_text())
            say(f"wrote {path / 'audit.md'} and audit.csv")
    except RaysimError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # an unreadable or unwritable run folder, a full disk: one line, exit 2
        from raysim.errors import os_error_line

        print(f"error: {os_error_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
