"""Print a burst of long lines at once, wait, then say it finished (a rank of a test job)."""

import argparse
import os
import time

parser = argparse.ArgumentParser()
parser.add_argument("--lines", type=int, default=2000)
parser.add_argument("--wait", type=float, default=25.0)
args = parser.parse_args()
rank = os.environ.get("RANK", "0")
for i in range(args.lines):
    print(f"rank {rank} line {i} " + "x" * 100, flush=True)
time.sleep(args.wait)
print(f"rank {rank} finished normally", flush=True)
