"""A rank that shows which values it got for the named variables without printing them:
`NAME sha256 <first 16 hex digits>` per name (or `NAME unset`)."""

import hashlib
import os
import sys

for name in sys.argv[1:]:
    value = os.environ.get(name)
    digest = hashlib.sha256(value.encode()).hexdigest()[:16] if value is not None else None
    print(f"rank {os.environ['RANK']} {name} " + (f"sha256 {digest}" if digest else "unset"), flush=True)
