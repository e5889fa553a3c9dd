"""vLLM as the rollout engine: `engine` (the `RolloutEngine` over `vllm.LLM`), `views` (HF-named views of the
engine's own weights, traced through vLLM's loader), `worker` (the extension that runs inside vLLM's worker) and
`lora` (EGGROLL members as in-memory LoRA adapters). Importing this package does not import vLLM: `lora` serves
the HF side too."""

# Shared by the engine and the memory plan (copes.plan.memory), which must agree on them.
DEFAULT_KV_CACHE_GIB = 1.0  # vLLM's KV pool when neither --vllm-kv-cache-gib nor the plan (CUDA) sizes it
# Tokens one vLLM scheduler step processes at most (chunked prefill): the plan counts one step's activations over
# this many tokens, and the engine starts vLLM with it (max_num_batched_tokens).
STEP_TOKENS = 2048
# Rows one vLLM scheduler step decodes at most (max_num_seqs): the plan counts their logits.
STEP_ROWS = 256
