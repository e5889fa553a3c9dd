"""Named crash points for the kill -9 tests of crash safety.

`COPES_FAILPOINT=name@n` sends SIGKILL to this process the n-th time the point `name` is passed (no cleanup, no
flush — exactly what a preempted GPU or an OOM killer does); `name@n:SIGSTOP` (any signal's name) sends that signal
instead, e.g. to hold a run still at a known point while a test acts on it from outside.
`COPES_FAILPOINT_LOG=path` appends the name of every point passed to that file, so a test can count work done
across killed and resumed processes (e.g. rollouts started). Unset, which is always the case outside those tests,
a point costs two environment lookups.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

_passes: Counter[str] = Counter()


def failpoint(name: str) -> None:
    log = os.environ.get("COPES_FAILPOINT_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as handle:
            handle.write(name + "\n")
    spec = os.environ.get("COPES_FAILPOINT")
    if not spec:
        return
    target, _, hit = spec.partition("@")
    if target != name:
        return
    hit, _, signal_name = hit.partition(":")
    _passes[name] += 1
    if _passes[name] == int(hit or 1):
        os.kill(os.getpid(), signal.Signals[signal_name or "SIGKILL"])
