"""Python sandbox throughput: runs per second of a trivial program, this checkout's sandbox vs git main's, in
the same run (goal: no more than 20% slower).

main's `copes/tools/sandbox.py` is read with `git show` into a temporary directory and imported from there (it
was one self-contained file, its own bootstrap), so the old implementation stays out of the package. Each round
runs both sandboxes back to back (`common.alternating_best_seconds`), so load on a shared machine hits them alike.

    python bench/sandbox_throughput.py [--runs-per-round 10] [--rounds 5] [--base main]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from harness import alternating_best_seconds, machine_note, report

from copes.tools import PythonSandbox

REPO = Path(__file__).resolve().parents[1]
TRIVIAL_PROGRAM = "print(sum(range(10)))"


def sandbox_module_from_git(revision: str, folder: Path) -> ModuleType:
    """`copes/tools/sandbox.py` as of `revision`, imported from a copy in `folder`."""
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{revision}:copes/tools/sandbox.py"],
        capture_output=True, text=True, check=True,
    ).stdout
    path = folder / f"sandbox_{revision.replace('/', '_')}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def measure(base: str, runs_per_round: int, rounds: int) -> list[dict[str, object]]:
    with tempfile.TemporaryDirectory(prefix="copes-bench-sandbox-") as folder:
        sandboxes = {base: sandbox_module_from_git(base, Path(folder)).PythonSandbox(), "this": PythonSandbox()}
        for name, sandbox in sandboxes.items():
            output = sandbox.run(TRIVIAL_PROGRAM).stdout
            if output != "45\n":
                raise RuntimeError(f"the {name} sandbox printed {output!r} for {TRIVIAL_PROGRAM!r}")

        def batch(sandbox) -> None:
            for _ in range(runs_per_round):
                sandbox.run(TRIVIAL_PROGRAM)

        best = alternating_best_seconds({name: lambda s=sandbox: batch(s) for name, sandbox in sandboxes.items()},
                                        repeats=rounds)
    rate = {name: runs_per_round / seconds for name, seconds in best.items()}
    return [
        {"sandbox": name, "runs_per_s": rate[name], "ms_per_run": 1000 / rate[name],
         "ratio_vs_base": rate[name] / rate[base]}
        for name in sandboxes
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs-per-round", type=int, default=10, help="sandbox runs timed together per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds after a warm-up; the fastest is kept")
    parser.add_argument("--base", default="main", help="git revision whose sandbox is the baseline")
    args = parser.parse_args()
    rows = measure(args.base, args.runs_per_round, args.rounds)
    report("sandbox_throughput", rows, f"Sandbox throughput, trivial program ({machine_note()})")


if __name__ == "__main__":
    main()
