"""copes-run end to end on the embedded tiny model: outputs, config layering, checkpoints that load through
from_pretrained, bit-exact resume, determinism, and one clear sentence (exit status 2) for every user mistake."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.cli_runs import assert_same_weights, copes_run, final_weights, metrics_without_time, run_in_process


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    """Four uninterrupted steps, checkpoint every step: the run every other one is compared with."""
    out = tmp_path_factory.mktemp("reference")
    result = copes_run("--steps", "4", "--checkpoint-every", "1", "--output-dir", str(out))
    assert result.returncode == 0, result.stderr
    assert " budget=120min -> " in result.stdout  # the embedded model's time budget (a hang guard), said at start
    return out


@pytest.mark.integration
def test_run_writes_metrics_summary_curve_and_loadable_checkpoints(reference_run):
    records = [json.loads(line) for line in (reference_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert {"mean_reward", "max_reward", "update_norm", "num_invalid_rewards", "time"} <= record.keys()
        assert {"generate", "perturb", "restore", "update"} <= record["time"].keys()
    summary = json.loads((reference_run / "summary.json").read_text())
    for key in ("steps", "wall_seconds", "peak_memory_bytes", "phase_seconds"):
        assert key in summary
    assert summary["steps"] == 4 and summary["peak_memory_bytes"] > 0
    assert 0 <= summary["eval_before"]["accuracy"] <= 1 and 0 <= summary["eval_after"]["accuracy"] <= 1
    assert (reference_run / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    checkpoint = reference_run / "checkpoints" / "step-000004"
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    weights = final_weights(reference_run)
    for name, tensor in model.state_dict().items():
        if name in weights:
            assert torch.equal(tensor, weights[name])
    assert any(r["update_norm"] > 0 for r in records), "the run never changed the weights"


@pytest.mark.integration
def test_resume_continues_bit_exactly(reference_run, tmp_path):
    first = copes_run("--steps", "2", "--checkpoint-every", "1", "--output-dir", str(tmp_path))
    assert first.returncode == 0, first.stderr
    resumed = copes_run("--steps", "4", "--checkpoint-every", "1", "--output-dir", str(tmp_path),
                        "--resume", str(tmp_path))
    assert resumed.returncode == 0, resumed.stderr
    assert_same_weights(final_weights(tmp_path), final_weights(reference_run))
    assert metrics_without_time(tmp_path) == metrics_without_time(reference_run)


@pytest.mark.integration
def test_two_identical_runs_are_identical(reference_run, tmp_path):
    again = copes_run("--steps", "4", "--checkpoint-every", "1", "--output-dir", str(tmp_path))
    assert again.returncode == 0, again.stderr
    assert_same_weights(final_weights(tmp_path), final_weights(reference_run))
    assert metrics_without_time(tmp_path) == metrics_without_time(reference_run)


@pytest.mark.integration
def test_config_file_is_overridden_by_flags(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("population: 6\nsubspaces: 3\nsteps: 1\nchunk_size: 512\n")
    result = copes_run("--config", str(config), "--population", "4", "--subspaces", "2",
                       "--output-dir", str(tmp_path / "out"), "--checkpoint-every", "0")
    assert result.returncode == 0, result.stderr
    used = json.loads((tmp_path / "out" / "summary.json").read_text())["config"]
    assert (used["population"], used["subspaces"], used["chunk_size"], used["steps"]) == (4, 2, 512, 1)


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    no_weights = tmp_path / "empty-model"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    broken_yaml = tmp_path / "broken.yaml"
    broken_yaml.write_text("population: [4\n")
    unknown_key = tmp_path / "unknown.yaml"
    unknown_key.write_text("popsize: 4\n")
    bad_data = tmp_path / "data" / "math"
    bad_data.mkdir(parents=True)
    (bad_data / "gsm8k_train.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": broken\n')
    (bad_data / "gsm8k_test.jsonl").write_text('{"question": "2+2?"}\n')
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    not_a_checkpoint = tmp_path / "not-a-checkpoint"
    not_a_checkpoint.mkdir()
    out = str(tmp_path / "out")
    return {
        "unknown task": (["--task", "chess", "--output-dir", out], "unknown task 'chess'"),
        "unknown algorithm": (["--algorithm", "sgd", "--output-dir", out], "Invalid value for '--algorithm'"),
        "missing model": (["--model", str(tmp_path / "nope"), "--output-dir", out], "does not exist"),
        "model without weights": (["--model", str(no_weights), "--output-dir", out], "has no weights"),
        "invalid yaml": (["--config", str(broken_yaml), "--output-dir", out], "invalid YAML in"),
        "unknown config key": (["--config", str(unknown_key), "--output-dir", out], "unknown config key(s)"),
        "N not divisible by K": (["--population", "6", "--subspaces", "4", "--output-dir", out],
                                 "not divisible by --subspaces 4"),
        "sigma <= 0": (["--sigma", "0", "--output-dir", out], "--sigma must be > 0"),
        "lr <= 0": (["--lr", "-0.1", "--output-dir", out], "--lr must be > 0"),
        "rank <= 0": (["--rank", "0", "--output-dir", out], "--rank must be >= 1"),
        "broken dataset line": (["--task", "gsm8k", "--data-dir", str(tmp_path / "data"), "--output-dir", out],
                                "gsm8k_train.jsonl:2"),
        "unwritable output dir": (["--output-dir", str(a_file / "run")], "is not writable"),
        "resume from a non-checkpoint": (["--output-dir", out, "--resume", str(not_a_checkpoint)],
                                         "is not a checkpoint"),
    }


BAD_INPUTS = ("unknown task", "unknown algorithm", "missing model", "model without weights", "invalid yaml",
              "unknown config key", "N not divisible by K", "sigma <= 0", "lr <= 0", "rank <= 0", "broken dataset line",
              "unwritable output dir", "resume from a non-checkpoint")


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_sentence_and_status_2(case, tmp_path):
    args, message = _bad_inputs(tmp_path)[case]
    result = run_in_process(*args)
    assert result.exit_code == 2, (result.exit_code, result.stderr, result.exception)
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.integration
def test_bad_input_through_the_console_script_is_one_line_and_status_2(tmp_path):
    """The same refusal from the installed `copes-run` process: its stderr, exit status and nothing else."""
    args, message = _bad_inputs(tmp_path)["unknown task"]
    result = copes_run(*args)
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


@pytest.mark.integration
def test_resuming_a_finished_run_without_more_steps_says_how_to_go_on(reference_run):
    """--resume of a run that finished its steps changes nothing and says to raise --steps (it used to re-run the
    final evaluation and print the old result as if it were new)."""
    summary = (reference_run / "summary.json").read_bytes()
    result = run_in_process("--resume", str(reference_run))
    assert result.exit_code == 0, result.stderr
    assert "already finished its 4 steps" in result.output and "--steps N, N > 4" in result.output
    assert (reference_run / "summary.json").read_bytes() == summary


@pytest.mark.integration
def test_resume_from_a_different_run_is_refused(reference_run, tmp_path):
    result = copes_run("--steps", "5", "--sigma", "0.5", "--output-dir", str(tmp_path), "--resume", str(reference_run))
    assert result.returncode == 2
    assert "belongs to a different run: sigma=" in result.stderr


@pytest.mark.integration
def test_debug_shows_the_traceback(tmp_path):
    result = copes_run("--sigma", "0", "--output-dir", str(tmp_path), "--debug")
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_every_config_field_has_a_generated_flag_with_its_help_and_default():
    import dataclasses

    from click.testing import CliRunner

    from copes.cli import run_command
    from copes.config.options import TrainConfig

    help_text = " ".join(CliRunner().invoke(run_command, ["--help"], terminal_width=400).output.split())
    for option in dataclasses.fields(TrainConfig):
        assert "--" + option.name.replace("_", "-") in help_text
    assert "N: perturbed members per step (paper: 40) [default: 40]" in help_text
    assert "--restore [device|host|subtract]" in help_text


@pytest.mark.integration
def test_ignored_options_are_named_and_task_options_reach_the_task(tmp_path):
    result = copes_run("--algorithm", "eggroll", "--restore", "host", "--steps", "1", "--eval-size", "0",
                       "--checkpoint-every", "0", "--task-options", "digit_shaping=0.5", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "warning: --restore does not apply to --algorithm eggroll; ignored" in result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["task_options"] == {"digit_shaping": 0.5}
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert {"perturb", "rollout", "update"} <= record["time"].keys() and "evaluate" not in record["time"]


def test_train_runs_a_whole_copes_run_from_python(tmp_path):
    import copes

    summary = copes.train({"population": 4, "subspaces": 2, "prompt_batch": 4, "steps": 1, "eval_size": 8,
                           "max_new_tokens": 6, "checkpoint_every": 0, "cpu_threads": 1, "output_dir": str(tmp_path)})
    assert summary["steps"] == 1 and summary["eval_after"]["accuracy"] is not None
    assert summary["config"]["sigma"] == 0.01 and summary["config"]["lr"] == 0.0025  # the embedded model's preset
    assert {"compile", "held_out", "rollout", "update"} <= summary["phase_seconds"].keys()
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 1


def test_copes_eval_sets_cpu_threads_as_copes_run_does(tmp_path):
    """copes-eval --cpu-threads N runs on N torch threads; a negative count is one sentence and status 2."""
    from click.testing import CliRunner

    from copes.cli import eval_command

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # so that the flag's 1 is a change the test can see
    try:
        result = CliRunner().invoke(eval_command, ["--cpu-threads", "1", "--limit", "2",
                                                   "--output", str(tmp_path / "scores.json")])
        assert result.exit_code == 0, result.output
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    refused = CliRunner().invoke(eval_command, ["--cpu-threads", "-1"])
    assert refused.exit_code == 2, refused.output
    assert "--cpu-threads must be >= 0, got -1" in refused.output and "Traceback" not in refused.output
