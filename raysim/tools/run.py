"""The run command: `python raysim/run.py [--config FILE.yaml] [key=value ...]` (also `raysim run ...`).

Runs one federation (or, with --sweep, a Ray Tune sweep) and prints the paper-style table.
Bad input ends with one clear message and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence


def build_parser(prog: str = "python raysim/run.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run a federated learning simulation (defaults: PromptFL on digits, 10 clients, offline).",
        epilog="Examples: train.rounds=20 method=promptfl data.dataset=digits execution.backend=inline  |  dp.epsilon=1.0  |  "
               "output.resume=runs/X",
    )
    p.add_argument("--config", "-c", help="YAML file with config keys (key=value arguments override it)")
    p.add_argument("--sweep", help="YAML sweep file: run a Ray Tune sweep instead of one federation")
    p.add_argument("--resume", action="store_true", help="with --sweep: continue that sweep's Tune experiment (Tuner.restore)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.rounds=5 dp.epsilon=1")
    return p


def main(argv: Optional[Sequence[str]] = None, prog: str = "python raysim/run.py") -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser(prog).parse_intermixed_args(argv)  # options and key=value in any order (k=v --config F)
    from raysim.errors import RaysimError

    cfg = None
    try:
        if args.sweep:
            from raysim.tools.sweep import run_sweep_file

            return run_sweep_file(args.sweep, [*args.overrides, *(["--resume"] if args.resume else [])])
        if args.resume:
            from raysim.errors import ConfigError

            raise ConfigError("--resume continues a sweep (with --sweep FILE); to continue a run pass output.resume=OUT_DIR")
        from raysim.build import config_from_cli
        from raysim.config import parse_user_overrides
        from raysim.engine.loop import resume_config, run

        overrides = parse_user_overrides(args.overrides)  # user input: old flat keys moved into their sections
        resume = (overrides.get("output") or {}).get("resume")
        if resume:
            cfg = resume_config(str(resume), overrides)
        else:
            cfg = config_from_cli(args.config, args.overrides)
        result = run(cfg)
    except RaysimError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a read-only or forbidden folder, a name too long: one line, exit 2
        from raysim.errors import os_error_line

        where = (cfg.output.out_dir if cfg is not None else "") or ""
        print(f"error: {os_error_line(e, where, resume=_resumable(where), again=not _resumable(where))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        where = _resumable((cfg.output.out_dir if cfg is not None else "") or "")
        print(f"interrupted: every completed round is saved; continue with output.resume={where}" if where else
              "interrupted: the run folder held no run yet, so nothing was kept; run the command again", file=sys.stderr)
        return 130
    print()
    print((result.out_dir / "summary.md").read_text())
    print(f"outputs: {result.out_dir}  (tensorboard --logdir {result.out_dir / 'tensorboard'})")
    return 0


def _resumable(out_dir: str) -> str:
    """`out_dir` when it holds a run that output.resume can continue (its config.yaml is there), else "": a run
    that failed while starting removes what it wrote, so a hint to resume it would name a folder that is gone."""
    from raysim.storage.runfolder import RunFolder

    return out_dir if out_dir and RunFolder(out_dir).is_run() else ""


if __name__ == "__main__":
    sys.exit(main())
