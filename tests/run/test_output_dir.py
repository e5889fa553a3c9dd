"""No run destroys another (issue #37): a new run into a folder that holds a run is refused in one line naming
--resume and --output-dir; the default folder moves on to a fresh numbered one and says so; --overwrite deletes
the earlier run first, deliberately. Before, the second run silently replaced the first one's journal, metrics and
summary and mixed its checkpoints in with the old ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from copes.config.options import DEFAULT_OUTPUT_DIR, build_config
from copes.errors import ConfigError
from copes.run.record import claim_output_dir

from helpers.cli_runs import copes_run, run_in_process


def _earlier_run(folder: Path) -> None:
    (folder / "checkpoints" / "step-000003").mkdir(parents=True)
    (folder / "journal").write_text("earlier\n")
    (folder / "summary.json").write_text("{}")


def test_a_folder_holding_a_run_is_refused_in_one_line(tmp_path: Path) -> None:
    _earlier_run(tmp_path / "mine")
    result = run_in_process("--output-dir", str(tmp_path / "mine"), "--steps", "1")
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: {tmp_path / 'mine'} holds a run already: continue it with --resume {tmp_path / 'mine'}, start a new "
        "one with --output-dir NEW_DIR, or replace it with --overwrite"]
    assert (tmp_path / "mine" / "journal").read_text() == "earlier\n"


def test_the_default_folder_moves_to_a_fresh_numbered_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    _earlier_run(Path(DEFAULT_OUTPUT_DIR))
    _earlier_run(Path(f"{DEFAULT_OUTPUT_DIR}-2"))
    cfg = claim_output_dir(build_config({}), resuming=False)
    assert cfg.output_dir == f"{DEFAULT_OUTPUT_DIR}-3"
    assert f"this run writes to {DEFAULT_OUTPUT_DIR}-3" in capsys.readouterr().err
    assert claim_output_dir(build_config({}), resuming=True).output_dir == DEFAULT_OUTPUT_DIR
    with pytest.raises(ConfigError, match="holds a run already"):  # ranks of a torchrun could not agree on a folder
        claim_output_dir(build_config({}), resuming=False, may_move=False)


def test_overwrite_deletes_only_the_earlier_runs_files(tmp_path: Path) -> None:
    _earlier_run(tmp_path)
    (tmp_path / "notes.txt").write_text("the user's own")
    claim_output_dir(build_config({"output_dir": str(tmp_path), "overwrite": True}), resuming=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".copes-lock", "notes.txt"]  # the lock: this process holds it


@pytest.mark.integration
@pytest.mark.slow
def test_a_second_copes_run_leaves_the_first_intact(tmp_path: Path) -> None:
    first = copes_run("--steps", "1", "--eval-size", "0", "--output-dir", str(tmp_path / "run"))
    assert first.returncode == 0, first.stderr
    before = {p: p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file()}
    second = copes_run("--steps", "2", "--eval-size", "0", "--output-dir", str(tmp_path / "run"))
    assert second.returncode == 2 and "--resume" in second.stderr and "--output-dir" in second.stderr
    assert {p: p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file()} == before
    replaced = copes_run("--steps", "2", "--eval-size", "0", "--overwrite", "--output-dir", str(tmp_path / "run"))
    assert replaced.returncode == 0, replaced.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["latest", "step-000002"]


def test_ctrl_c_ends_with_the_resume_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards: Ctrl-C printed click's "Aborted!" without the command that continues the run."""
    from copes.run.trainer import Trainer

    def interrupted(self: Trainer) -> dict:
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "train", interrupted)
    result = run_in_process("--output-dir", str(tmp_path / "run"), "--steps", "1")
    assert result.exit_code == 130
    assert result.output.strip().splitlines()[-1] == (
        f"interrupted; continue this run with: copes-run --resume {(tmp_path / 'run').resolve()}")
