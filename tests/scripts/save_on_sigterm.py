"""A rank that saves a checkpoint when told to stop: SIGTERM -> 'saving', 1.5 s, 'saved', exit 0.
A second SIGTERM while saving would print 'saving' again (the handler re-entered)."""

import os
import signal
import sys
import time

rank = os.environ.get("RANK", "0")


def on_term(signum, frame):
    print(f"rank {rank} got SIGTERM, saving", flush=True)
    time.sleep(1.5)
    print(f"rank {rank} saved", flush=True)
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
tick = 0
while True:
    print(f"rank {rank} tick {tick}", flush=True)
    tick += 1
    time.sleep(0.3)
