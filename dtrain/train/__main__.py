"""`python -m dtrain.train CONFIG [--set k=v ...] [--resume]`: one rank of a training job.

This is what runs in a plain process, under `torchrun`, and in each worker that
`dtrain train --nproc N` starts. User errors print one line and exit non-zero.
"""

from __future__ import annotations

import argparse
import os
import sys

from dtrain.errors import DtrainError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtrain.train", description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", help="training config YAML (defaults when omitted)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--resume", action="store_true", help="continue from OUTPUT/checkpoints/last.pt")
    args = parser.parse_args(argv)
    from dtrain.train.dist import exit_with_launcher

    exit_with_launcher()
    try:
        from dtrain.configio import load_config
        from dtrain.train.config import TrainConfig

        cfg = load_config(TrainConfig, args.config, args.overrides)
        from dtrain.train.trainer import run

        # `dtrain run --rdzv elastic` sets DTRAIN_AUTO_RESUME=1: a restarted worker group
        # continues from the last checkpoint (a fresh start when there is none yet).
        auto = os.environ.get("DTRAIN_AUTO_RESUME") == "1"
        result = run(cfg, resume=args.resume or auto)
    except DtrainError as exc:
        print(f"dtrain: error: {exc}", file=sys.stderr)
        return int(exc.exit_status)
    except KeyboardInterrupt:
        return 130
    if result.checkpoint is not None and os.environ.get("RANK", "0") == "0":
        print(f"checkpoint: {result.checkpoint}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
