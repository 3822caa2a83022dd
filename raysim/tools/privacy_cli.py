"""`raysim privacy noise|epsilon ...`: calibrate a DP-SGD noise multiplier or account for one.

    python -m raysim.tools.privacy_cli noise --epsilon 1 --delta 1e-5 --sample-rate 0.5 --steps 100
    python -m raysim.tools.privacy_cli epsilon --sigma 20.47 --delta 1e-5 --sample-rate 0.5 --steps 100
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from raysim.errors import ConfigError
from raysim.privacy.accountant import ACCOUNTANTS, epsilon_spent, noise_multiplier


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2 (raised to main)
        raise _UsageError(f"{self.prog}: {message}")


def _cmd_noise(args: argparse.Namespace) -> int:
    sigma = noise_multiplier(
        epsilon=args.epsilon, delta=args.delta, sample_rate=args.sample_rate, steps=args.steps, accountant=args.accountant
    )
    print(f"{sigma:.6g}")
    return 0


def _cmd_epsilon(args: argparse.Namespace) -> int:
    if args.sigma < 0:
        raise ConfigError(f"sigma must be >= 0, got {args.sigma}")
    eps = epsilon_spent([(args.sigma, args.sample_rate, args.steps)], delta=args.delta, accountant=args.accountant)
    print(f"{eps:.6g}")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--delta", type=float, required=True, help="target delta, in (0, 1)")
    p.add_argument("--sample-rate", type=float, required=True, help="sampling rate q = batch / dataset size, in (0, 1]")
    p.add_argument("--steps", type=int, required=True, help="number of DP-SGD steps, >= 1")
    p.add_argument("--accountant", choices=ACCOUNTANTS, default="rdp", help="Opacus accountant (default rdp)")


def _fill(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="privacy_command", metavar="{noise,epsilon}")
    sub.required = True
    n = sub.add_parser("noise", help="noise multiplier sigma reaching (epsilon, delta)")
    n.add_argument("--epsilon", type=float, required=True, help="target epsilon (> 0; inf prints 0)")
    _common(n)
    n.set_defaults(privacy_func=_cmd_noise)
    e = sub.add_parser("epsilon", help="epsilon spent by DP-SGD with multiplier sigma")
    e.add_argument("--sigma", type=float, required=True, help="noise multiplier, >= 0")
    _common(e)
    e.set_defaults(privacy_func=_cmd_epsilon)


def add_subparser(subparsers) -> argparse.ArgumentParser:
    """Add `privacy` (with `noise` and `epsilon`) to a top-level CLI's subparsers; the parsed
    namespace carries `privacy_func(args) -> int` (and `func`, the same, for generic dispatch)."""
    p = subparsers.add_parser("privacy", help="calibrate or account DP-SGD noise")
    _fill(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Dispatch a parsed namespace; ConfigError is left to the caller (see `main`)."""
    return args.privacy_func(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="raysim privacy", description="DP-SGD noise calibration and accounting (Opacus)")
    _fill(parser)
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        return run(args)
    except (_UsageError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
