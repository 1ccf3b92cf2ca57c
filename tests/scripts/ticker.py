"""A tiny non-training rank for launch tests: prints ticks, can stall or fail on cue.

Uses only torchrun's environment (RANK); with --heartbeat it also reports each tick
through dtrain's two-line API, as a training script would.
"""

import argparse
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--ticks", type=int, default=10)
parser.add_argument("--every", type=float, default=0.2)
parser.add_argument("--quiet-ranks", default="", help="comma-separated ranks that never print")
parser.add_argument("--stall-rank", type=int, default=-1, help="this rank stops at --stall-at ...")
parser.add_argument("--stall-at", type=int, default=-1, help="... and the others 3 ticks later")
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--fail-at", type=int, default=-1)
parser.add_argument("--heartbeat", action="store_true")
args = parser.parse_args()

rank = int(os.environ["RANK"])
quiet = {int(r) for r in args.quiet_ranks.split(",") if r}
if args.heartbeat:
    from dtrain.monitor.rank.client import report_step
for i in range(args.ticks):
    if args.stall_at >= 0 and i == (args.stall_at if rank == args.stall_rank else args.stall_at + 3):
        time.sleep(3600)
    if rank == args.fail_rank and i == args.fail_at:
        print(f"rank {rank} failing on purpose", flush=True)
        raise SystemExit(7)
    if rank not in quiet:
        print(f"rank {rank} tick {i}", flush=True)
    if args.heartbeat:
        report_step(step=i, epoch=0, loss=0.0, lr=0.0, step_time_s=args.every, data_wait_s=0.0, samples=1)
    time.sleep(args.every)
print(f"rank {rank} done", file=sys.stderr, flush=True)
