"""GGUF in and out (copes/gguf_io.py), offline: the embedded tiny model written as GGUF by copes-export's writer, read
back by transformers with the same logits, trained by copes-run from the file, its checkpoints plain folders, a
changed file refused on resume, and bad files refused in one line with status 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

from copes.cli import eval_command, export_command
from copes.errors import UserError
from copes.gguf_io import dense_folder, export_gguf, llama_cpp_pre_tokenizer, load_gguf
from copes.modeling import EMBEDDED_MODELS, load_model, resolve_model_path
from copes.run.journal import read_header

from helpers.cli_runs import copes_run, run_in_process
from helpers.tiny_models import QWEN2_SPLIT

TINY = EMBEDDED_MODELS["tiny"]
TEXT = "12+34=46\n7*8="


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.fixture(autouse=True)
def machine_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The per-machine cache (dense copies of GGUF files) in this session's temporary folder."""
    folder = tmp_path_factory.getbasetemp() / "copes-cache"
    monkeypatch.setenv("COPES_CACHE_DIR", str(folder))
    return folder


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny model (Qwen3, character vocabulary) as a float32 GGUF."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    export_gguf(TINY, path, "f32")
    return path


def test_a_float32_gguf_reads_back_with_the_same_tokens_and_logits(tiny_gguf):
    """transformers reads the written file (`gguf_file=`); copes loads it dense, in the asked dtype, savable."""
    reference = AutoModelForCausalLM.from_pretrained(str(TINY), dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(str(TINY))(TEXT, return_tensors="pt").input_ids
    model, tokenizer = load_gguf(tiny_gguf, torch.float32)
    assert tokenizer(TEXT, return_tensors="pt").input_ids.tolist() == ids.tolist()
    assert tokenizer.decode(ids[0]) == TEXT
    assert torch.equal(logits(model, ids), logits(reference, ids))
    assert not getattr(model, "is_quantized", False)  # save_pretrained refuses what transformers marks quantised


def test_a_gguf_is_converted_once_per_machine_and_loads_in_the_run_dtype(tiny_gguf, machine_cache):
    lm, _, _ = load_model(str(tiny_gguf), device="cpu", dtype="bfloat16")
    assert {p.dtype for p in lm.parameters()} == {torch.bfloat16}
    folder = dense_folder(tiny_gguf)
    assert folder.parent == machine_cache / "gguf" and (folder / "config.json").is_file()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    load_model(str(tiny_gguf), device="cpu", dtype="float32")
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # read from the cache, not converted again


@pytest.mark.parametrize("tensor_type, dtype", [("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_precision_exports_hold_the_rounded_weights(tiny_gguf, tmp_path, tensor_type, dtype):
    """Matrices are stored rounded to the type (norms stay float32): the logits are those of the rounded model."""
    path = tmp_path / f"tiny-{tensor_type}.gguf"
    export_gguf(TINY, path, tensor_type)
    rounded = AutoModelForCausalLM.from_pretrained(str(TINY), dtype=torch.float32)
    for tensor in rounded.state_dict().values():
        if tensor.ndim > 1:
            tensor.copy_(tensor.to(dtype).float())
    model, tokenizer = load_gguf(path, torch.float32)
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    torch.testing.assert_close(logits(model, ids), logits(rounded, ids), rtol=1e-5, atol=1e-5)
    assert path.stat().st_size < tiny_gguf.stat().st_size * 0.7


def _unsupported_architecture(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "rwkv6")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _bad_gguf(case: str, folder: Path, good: Path) -> Path:
    path = folder / f"{case}.gguf"
    if case == "truncated":
        path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif case == "not-gguf":
        path.write_text("{}", encoding="utf-8")
    elif case == "architecture":
        _unsupported_architecture(path)
    return path


@pytest.mark.parametrize("case, expected", [
    ("truncated", "is truncated or damaged"),
    ("not-gguf", "is not a GGUF file"),
    ("architecture", "holds a 'rwkv6' model, which transformers cannot read from GGUF"),
    ("missing", "does not exist"),
])
def test_a_bad_gguf_is_refused_in_one_sentence_before_anything_loads(tiny_gguf, tmp_path, case, expected):
    with pytest.raises(UserError, match=expected):
        resolve_model_path(str(_bad_gguf(case, tmp_path, tiny_gguf)))


def test_copes_run_says_a_bad_gguf_in_one_line_with_status_2(tiny_gguf, tmp_path):
    result = run_in_process("--model", str(_bad_gguf("truncated", tmp_path, tiny_gguf)),
                            "--output-dir", str(tmp_path / "run"))
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "is truncated or damaged" in lines[0], result.output


def test_copes_eval_and_the_plan_read_a_gguf(tiny_gguf, tmp_path):
    evaluated = CliRunner().invoke(eval_command, ["--model", str(tiny_gguf), "--limit", "4", "--max-new-tokens", "6",
                                                  "--output", str(tmp_path / "eval.json")])
    assert evaluated.exit_code == 0, evaluated.output
    assert json.loads((tmp_path / "eval.json").read_text())["arithmetic"]["n_examples"] == 4
    plan = run_in_process("--plan", "--model", str(tiny_gguf))
    assert plan.exit_code == 0 and "memory plan" in plan.output, plan.output


LLAMA3_SPLIT = QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


def _byte_level(use_regex: bool, add_prefix_space: bool = False) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": False, "use_regex": use_regex}


def _split(regex: str, behavior: str = "Isolated") -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": behavior, "invert": False}


def _sequence(*steps: dict) -> dict:
    return {"type": "Sequence", "pretokenizers": list(steps)}


@pytest.mark.parametrize("spec, expected", [
    (_byte_level(use_regex=True), "gpt-2"),  # GPT-2; SmolLM2 as transformers reads its GGUF
    (_sequence({"type": "Digits", "individual_digits": True}, _byte_level(use_regex=True)), "smollm"),
    (_sequence(_split(QWEN2_SPLIT), _byte_level(use_regex=False)), "qwen2"),  # Qwen2, Qwen2.5, Qwen3
    (_sequence(_split(LLAMA3_SPLIT), _byte_level(use_regex=False)), "llama-bpe"),  # Llama 3
    # splits llama.cpp does not make: it would tokenize differently, so the file names none of its own
    (_byte_level(use_regex=True, add_prefix_space=True), None),
    (_sequence(_split(QWEN2_SPLIT), _byte_level(use_regex=True)), None),  # the regex, then GPT-2's on top
    (_sequence(_split(LLAMA3_SPLIT, behavior="Removed"), _byte_level(use_regex=False)), None),
    (_sequence({"type": "Digits", "individual_digits": False}, _byte_level(use_regex=True)), None),
    (_split(r"[\s\S]"), None),  # the embedded tiny model's character split
    ({"type": "Whitespace"}, None),
    (None, None),
])
def test_llama_cpp_is_told_the_split_the_tokenizer_makes(spec, expected):
    """tokenizer.ggml.pre names the split llama.cpp makes before its merges: the one the model's tokenizer makes."""
    assert llama_cpp_pre_tokenizer(spec) == expected


def test_an_export_llama_cpp_would_tokenize_differently_says_so_in_one_line(tmp_path):
    """The embedded tiny model splits text into characters, which no llama.cpp pre-tokenizer does: the file names
    llama.cpp's default, transformers still reads it as the model, and copes-export warns in one line."""
    exported = tmp_path / "tiny.gguf"
    result = CliRunner().invoke(export_command, [str(TINY), "--output", str(exported)])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "llama.cpp has no pre-tokenizer" in warnings[0], result.output
    field = gguf.GGUFReader(exported).fields["tokenizer.ggml.pre"]
    assert bytes(field.parts[-1]).decode() == "default"


def test_export_refuses_what_it_cannot_write(tmp_path):
    result = CliRunner().invoke(export_command, [str(tmp_path), "--output", str(tmp_path / "out.gguf")])
    assert result.exit_code == 2 and "is not a checkpoint" in result.output, result.output


@pytest.mark.integration
def test_a_gguf_run_checkpoints_folders_exports_gguf_and_refuses_a_changed_file(tiny_gguf, tmp_path):
    """copes-run --model FILE.gguf (the issue's flags); its checkpoint is a folder from_pretrained reads alone;
    copes-export of the run reads back with the checkpoint's logits; a resume after the file changed is refused."""
    model_file = tmp_path / "model.gguf"
    shutil.copy(tiny_gguf, model_file)
    run_dir = tmp_path / "run"
    done = copes_run("--model", str(model_file), "--task", "arithmetic", "--steps", "1", "--eval-size", "4",
                     "--no-tools", "--dtype", "float32", "--checkpoint-every", "1", "--output-dir", str(run_dir))
    assert done.returncode == 0, done.stderr[-2000:]
    header = read_header(run_dir)
    assert header["model"]["sha256"] and header["model"]["path"] == str(model_file)
    checkpoint = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (checkpoint / "config.json").is_file()
    trained = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(str(checkpoint))(TEXT, return_tensors="pt").input_ids

    exported = tmp_path / "trained.gguf"
    result = CliRunner().invoke(export_command, [str(run_dir), "--output", str(exported)])
    assert result.exit_code == 0, result.output
    read_back, _ = load_gguf(exported, torch.float32)  # plain transformers takes a Qwen3 file's head_dim as 128
    assert torch.equal(logits(read_back, ids), logits(trained, ids))

    export_gguf(TINY, model_file, "bf16")  # the same path, other bytes
    refused = copes_run("--model", str(model_file), "--resume", str(run_dir), "--steps", "2")
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "changed since the run started" in refused.stderr.strip().splitlines()[-1]


def test_copes_train_and_es_trainer_take_a_gguf(tiny_gguf, tmp_path):
    """The Python faces name the file as the command line does (both load through copes.modeling)."""
    import copes
    from copes import ESConfig, ESTrainer

    from helpers.trl_twin import answer_column_reward, arithmetic_rows

    summary = copes.train({"model": str(tiny_gguf), "population": 2, "subspaces": 1, "prompt_batch": 4, "steps": 1,
                           "eval_size": 4, "max_new_tokens": 6, "checkpoint_every": 0, "cpu_threads": 1,
                           "output_dir": str(tmp_path / "train")})
    assert summary["steps"] == 1 and summary["config"]["model"] == str(tiny_gguf)
    args = ESConfig(output_dir=str(tmp_path / "trl"), population_size=2, num_subspaces=1, prompt_batch_size=4,
                    max_steps=1, max_completion_length=4, eval_size=0, seed=0)
    trainer = ESTrainer(model=str(tiny_gguf), reward_funcs=[answer_column_reward], args=args,
                        train_dataset=arithmetic_rows(False))
    trainer.train()
    assert trainer.state.global_step == 1
