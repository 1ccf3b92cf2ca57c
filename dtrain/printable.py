"""Names from the data (file and folder names) made safe to print on a terminal.

A file name may hold any character but "/" and NUL: an escape (ESC ] sets a terminal's
title or, in some terminals, its clipboard; ESC [ moves the cursor and erases lines, so
printed text can hide what came before), a carriage return, or a Unicode direction
override that shows the name's characters in another order than they are. Printed as
they are, such names act on the terminal of whoever trains on the set. Shown here as
Python would write them in a string (`\\x1b`, `\\t`, `\\u202e`), they read as the name
and do nothing; files on disk (the inspection CSV, JSON) keep names exactly as they are.
A byte that is not UTF-8 (Python keeps it as a lone surrogate, which a strict terminal
write refuses) is shown as that byte, `\\xff`.
"""

from __future__ import annotations

import unicodedata

# Direction controls ("Trojan Source", CVE-2021-42574): not control characters to Unicode
# (category Cf), yet they reorder what is shown.
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def unsafe(ch: str) -> bool:
    """A character that acts on a terminal or on how text is shown, instead of being shown
    (or that is no character: a byte that was not UTF-8)."""
    return unicodedata.category(ch) in ("Cc", "Cs") or ch in _BIDI


def printable(text: str, keep: str = "") -> str:
    """`text` with every unsafe character but those in `keep` written as its escape; the
    rest unchanged. `keep="\\n"`: a message of several lines that may quote a name."""
    if not any(unsafe(ch) and ch not in keep for ch in text):
        return text
    return "".join(_escaped(ch) if unsafe(ch) and ch not in keep else ch for ch in text)


def _escaped(ch: str) -> str:
    if 0xDC80 <= ord(ch) <= 0xDCFF:  # os.fsdecode's stand-in for the byte ord - 0xDC00
        return f"\\x{ord(ch) - 0xDC00:02x}"
    return ch.encode("unicode_escape").decode("ascii")
