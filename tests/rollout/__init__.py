"""Tests of copes/rollout/. A package, so that pytest puts tests/ on sys.path for them and not this folder: its
`vllm/` subfolder would otherwise be found by `import vllm` as a namespace package where vLLM is not installed."""
