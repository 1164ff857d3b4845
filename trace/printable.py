"""Names from outside (thread names, host names, file names, Python function names) made
safe to print: every text output and every error that quotes one goes through
`printable`, so a name cannot move the cursor, recolour or clear a terminal, hide text
(bidirectional overrides) or break a table's lines."""

from __future__ import annotations

import re

# C0 controls (ESC, CR, tab and newline among them), DEL, C1 controls (a terminal takes
# 0x9b as ESC [), the bidirectional and line-separator format characters, and the lone
# surrogates that stand for a name's undecodable bytes.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    if 0xDC80 <= code <= 0xDCFF:  # an undecodable byte (surrogateescape): that byte
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def printable(text: object) -> str:
    """`text` (made a str) with each unprintable character written as its escape (\\x1b,
    \\u202e), as Python writes it in a literal."""
    return _UNPRINTABLE.sub(_escape, str(text))


def printable_lines(text: str) -> str:
    """Each line of `text` made printable, the line breaks between them kept."""
    return "\n".join(printable(line) for line in text.split("\n"))
