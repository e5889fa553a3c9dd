"""Python sandbox throughput: runs per second of a trivial program, each tier of this checkout's sandbox (the
namespaces tier, and the Landlock tier where the kernel has Landlock) vs the same tier of git main's, in the same
run (goal: ratio >= 0.85 in each tier).

main's sandbox package (`copes/tools/sandbox/`) is read with `git show` into a package in a temporary directory,
its `copes.tools.sandbox` imports pointed at it, and imported from there, so the old implementation stays out of
the package. Each round runs both sandboxes back to back (`harness.alternating_best_seconds`), so load on a shared
machine hits them alike. The rows name the tier this checkout's sandbox ran in.

    python bench/sandbox_throughput.py [--runs-per-round 10] [--rounds 5] [--base main] [--clock wall|cpu]
                                       [--python /usr/bin/python3]

`--clock cpu` times each batch by CPU seconds (this process and the runs it reaped) instead of wall time: on a
machine loaded by other jobs, wall time mostly measures the wait for a core. `--python` is the interpreter every
sandbox runs the program with: root's Landlock tier refuses one a per-run uid cannot reach (a pyenv under /root).
"""

from __future__ import annotations

import argparse
import importlib
import resource
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from copes.tools import PythonSandbox, SandboxUnavailable
from copes.tools.sandbox import landlock

from common.harness import alternating_best_seconds, machine_note, report

REPO = Path(__file__).resolve().parents[1]
TRIVIAL_PROGRAM = "print(sum(range(10)))"


def sandbox_module_from_git(revision: str, folder: Path) -> ModuleType:
    """The `copes/tools/sandbox/` package as of `revision`, as a package of its own (a fresh name for each call, so
    two calls never share modules)."""
    name = f"base_sandbox_{secrets.token_hex(4)}"
    package = folder / name
    package.mkdir()
    listed = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{revision}:copes/tools/sandbox"],
                            capture_output=True, text=True, check=True)
    for module in (line for line in listed.stdout.split() if line.endswith(".py")):
        shown = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:copes/tools/sandbox/{module}"],
                               capture_output=True, text=True, check=True)
        (package / module).write_text(shown.stdout.replace("copes.tools.sandbox", name))
    sys.path.insert(0, str(folder))
    return importlib.import_module(name)


def cpu_seconds() -> float:
    """CPU time of this process and of every child it reaped (a run's bootstrap counts its own reaped children):
    what a run costs, nearly free of the waiting a loaded machine adds to wall time."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def landlock_refused(python: str) -> str | None:
    """Why this checkout's Landlock tier would not run `python` here (no Landlock; as root, an interpreter a per-run
    uid cannot reach), or None."""
    if not landlock.abi():
        return "this kernel has no Landlock"
    try:
        PythonSandbox(tier="landlock", python=python).check()
    except SandboxUnavailable as error:
        return f"{error} (pass --python an interpreter other uids can reach)"
    return None


def measure(base: str, runs_per_round: int, rounds: int, clock: str = "wall",
            python: str = sys.executable) -> list[dict[str, object]]:
    with tempfile.TemporaryDirectory(prefix="copes-bench-sandbox-") as folder:
        base_module = sandbox_module_from_git(base, Path(folder))
        # (name, the base row it is compared with) -> sandbox; a base without tiers has the namespaces tier only.
        sandboxes = {(base, base): base_module.PythonSandbox(python=python),
                     ("this", base): PythonSandbox(python=python)}
        refused = landlock_refused(python)
        if refused:
            print(f"no Landlock rows: {refused}", file=sys.stderr)
        else:
            base_landlock = f"{base}, tier=landlock"
            if "landlock" in getattr(base_module.runner, "TIERS", ()):
                sandboxes[(base_landlock, base_landlock)] = base_module.PythonSandbox(tier="landlock", python=python)
            else:
                base_landlock = base
            sandboxes[("this, tier=landlock", base_landlock)] = PythonSandbox(tier="landlock", python=python)
        tiers = {}
        for (name, _), sandbox in sandboxes.items():
            result = sandbox.run(TRIVIAL_PROGRAM)
            if result.stdout != "45\n":
                raise RuntimeError(f"the {name} sandbox printed {result.stdout!r} for {TRIVIAL_PROGRAM!r}")
            tiers[name] = getattr(result, "tier", "namespaces")  # the base predates tiers: namespaces only

        def batch(sandbox) -> None:
            for _ in range(runs_per_round):
                sandbox.run(TRIVIAL_PROGRAM)

        best = alternating_best_seconds({name: lambda s=sandbox: batch(s) for (name, _), sandbox in sandboxes.items()},
                                        repeats=rounds, clock=cpu_seconds if clock == "cpu" else time.perf_counter)
    rate = {name: runs_per_round / seconds for name, seconds in best.items()}
    return [
        {"sandbox": name, "tier": tiers[name], "clock": clock, "runs_per_s": rate[name],
         "ms_per_run": 1000 / rate[name], "compared_with": compared_with, "ratio": rate[name] / rate[compared_with]}
        for name, compared_with in sandboxes
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs-per-round", type=int, default=10, help="sandbox runs timed together per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds after a warm-up; the fastest is kept")
    parser.add_argument("--base", default="main", help="git revision whose sandbox is the baseline")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall time, or CPU seconds of this process and the runs (for a loaded machine)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter the sandboxes run the program with")
    args = parser.parse_args()
    rows = measure(args.base, args.runs_per_round, args.rounds, args.clock, args.python)
    report("sandbox_throughput", rows, f"Sandbox throughput, trivial program ({machine_note()})")


if __name__ == "__main__":
    main()
