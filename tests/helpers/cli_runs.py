"""Helpers for tests that drive `copes-run` on the embedded tiny model: a small, fast set of flags, running the
console script in a subprocess (the real entry point, killable with SIGKILL; `integration` tests only) or its
command in-process (click's runner, for input it refuses), and reading a run's results."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import click.testing
import torch
from safetensors.torch import load_file

# Small enough for seconds per run on 2 CPU cores, large enough that every step changes the weights.
FAST_FLAGS = [
    "--population", "4", "--subspaces", "2", "--prompt-batch", "8", "--eval-size", "16",
    "--max-new-tokens", "6", "--cpu-threads", "1", "--sigma", "0.03", "--lr", "0.01", "--quiet",
]
MODEL = os.environ.get("COPES_TEST_MODEL", "tiny")
# Two gloo ranks of a command on this machine, through torch's own launcher.
TORCHRUN_PAIR = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
# Set by conftest.py before each test: whether it is in a lane that may start copes-run (`integration`, `vllm`).
INTEGRATION_TEST = True


def _command(args: tuple[str, ...]) -> list[str]:
    assert INTEGRATION_TEST, "this test starts copes-run: mark it @pytest.mark.integration (see docs/testing.md)"
    executable = shutil.which("copes-run")
    assert executable, "copes-run is not on PATH: pip install -e . first"
    return [executable, "--model", MODEL, *FAST_FLAGS, *args]


def copes_run(*args: str, env: dict[str, str] | None = None, timeout: float = 300,
              cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(_command(args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=cwd)


def copes_run_in_background(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """copes-run started and left running, for a test that acts on it from outside (signals, a second process)."""
    return subprocess.Popen(_command(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def finished_run(tmp_path_factory: Any, *args: str) -> Path:
    """A copes-run that ended normally, in a fresh folder: what faulted runs are compared with (module fixtures)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    result = copes_run(*args, "--output-dir", str(out))
    assert result.returncode == 0, result.stderr
    return out


def run_in_process(*args: str) -> click.testing.Result:
    """copes-run's command in this process through click's runner: for runs that stop before training starts."""
    from copes.cli import run_command

    return click.testing.CliRunner().invoke(run_command, ["--model", MODEL, *FAST_FLAGS, *args])


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / latest / "model.safetensors"))


def metrics_without_time(run_dir: Path) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in record.items() if k != "time"} for record in records]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"
