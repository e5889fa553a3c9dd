"""vLLM as the rollout engine: `engine` (the `RolloutEngine` over `vllm.LLM`), `views` (HF-named views of the
engine's own weights, traced through vLLM's loader), `worker` (the extension that runs inside vLLM's worker) and
`lora` (EGGROLL members as in-memory LoRA adapters). Importing this package does not import vLLM: `lora` serves
the HF side too."""
