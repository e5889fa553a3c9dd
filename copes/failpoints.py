"""Named crash points for the kill -9 tests of crash safety.

`COPES_FAILPOINT=name@n` sends SIGKILL to this process the n-th time the point `name` is passed (no cleanup, no
flush — exactly what a preempted GPU or an OOM killer does). Unset, which is always the case outside those tests,
a point costs one environment lookup.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

_passes: Counter[str] = Counter()


def failpoint(name: str) -> None:
    spec = os.environ.get("COPES_FAILPOINT")
    if not spec:
        return
    target, _, hit = spec.partition("@")
    if target != name:
        return
    _passes[name] += 1
    if _passes[name] == int(hit or 1):
        os.kill(os.getpid(), signal.SIGKILL)
