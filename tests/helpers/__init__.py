"""Shared pieces of the orchestrator tests: tiny models and tokenizers, `copes-run` drivers, the data folder,
timings scaled to the machine."""
