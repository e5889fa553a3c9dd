"""Untrusted text made safe to hand on: tool output, a retrieval server's answer and the strings decoded from a
model's tool-call JSON can hold surrogate code points, which no tokenizer, JSON-in-UTF-8 writer or file accepts.

Python strings may hold lone surrogates: JSON `"\\ud800"` decodes to one, and so do bytes decoded with
`surrogatepass` (what `json.loads` does with bytes) or `surrogateescape`.
"""

from __future__ import annotations


def valid_unicode(text: str) -> str:
    """`text` as valid Unicode: a surrogate pair split over two code points is joined into its character, a lone
    surrogate becomes U+FFFD; everything else is kept as it is."""
    if text.isascii():
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
