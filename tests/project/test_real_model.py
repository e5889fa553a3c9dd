"""The real pretrained model of docs/real-model.md, SmolLM2-135M-Instruct from its Q4_1 GGUF release: load, one ES
step, a checkpoint folder with its chat template, copes-export, and transformers reading the export back with the
checkpoint's logits. Runs where the model is in this machine's cache (`.ci/run` fetches it first with
`copes-fetch smollm2-135m-instruct`); a test never fetches it."""

from __future__ import annotations

import gguf
import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

from copes.cli import export_command
from copes.downloads import DOWNLOADABLE_MODELS, cache_dir

from helpers.cli_runs import copes_run

NAME = "smollm2-135m-instruct"
CACHED = cache_dir() / "models" / f"{DOWNLOADABLE_MODELS[NAME].member.rsplit('/', 1)[-1]}"


@pytest.mark.integration
@pytest.mark.skipif(not CACHED.is_file(), reason=f"{NAME} is not cached here: copes-fetch {NAME}")
def test_the_real_model_trains_a_step_checkpoints_and_exports_to_gguf(tmp_path):
    run_dir = tmp_path / "run"
    done = copes_run("--model", NAME, "--task", "arithmetic", "--steps", "1", "--population", "2", "--subspaces", "1",
                     "--prompt-batch", "1", "--max-new-tokens", "4", "--eval-size", "0", "--no-tools",
                     "--dtype", "float32", "--checkpoint-every", "1", "--output-dir", str(run_dir))
    assert done.returncode == 0, done.stderr[-2000:]
    checkpoint = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    trained = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    assert type(trained).__name__ == "LlamaForCausalLM" and tokenizer.chat_template
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt").input_ids

    exported = tmp_path / "trained.gguf"
    result = CliRunner().invoke(export_command, [str(run_dir), "--output", str(exported), "--type", "f32"])
    assert result.exit_code == 0 and "warning" not in result.output, result.output
    pre_tokenizer = gguf.GGUFReader(exported).fields["tokenizer.ggml.pre"]
    assert bytes(pre_tokenizer.parts[-1]).decode() == "gpt-2"  # llama.cpp splits text as the model's tokenizer
    read_back = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=exported.name, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(read_back(ids).logits, trained(ids).logits)
