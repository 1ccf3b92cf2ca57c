"""`python -m dtrain.requirements EXTRA`: the packages of one of dtrain's extras, one a
line, read from the installed metadata (so pyproject.toml stays the one list).

For a machine that installs dtrain with --no-deps (an inspection PC without torch):

    pip install --no-deps . && python -m dtrain.requirements runtime > req.txt && pip install -r req.txt

Standard library only: it runs before any dependency is installed.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from importlib.metadata import requires

_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")
_SELF = re.compile(r"dtrain\[([^\]]+)\]")


def extra_requirements(extra: str, read: Callable[[str], list[str] | None] = requires) -> list[str]:
    """The requirements `pip install 'dtrain[EXTRA]'` adds to the core ones, extras of
    dtrain itself (serve = dtrain[runtime] + ...) expanded."""
    found: list[str] = []
    for line in read("dtrain") or []:
        spec, _, marker = line.partition(";")
        match = _EXTRA.search(marker)
        if match is None or match[1] != extra:
            continue
        inner = _SELF.fullmatch(spec.strip())
        if inner is None:
            found.append(spec.strip())
        else:
            found += [r for e in inner[1].split(",") for r in extra_requirements(e.strip(), read)]
    return list(dict.fromkeys(found))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m dtrain.requirements EXTRA   (e.g. runtime)", file=sys.stderr)
        return 2
    found = extra_requirements(argv[0])
    if not found:
        print(f"dtrain has no extra {argv[0]!r} (or it is empty); see [project.optional-dependencies] in pyproject.toml",
              file=sys.stderr)
        return 1
    print("\n".join(found))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
