"""The value lists of the options that take one of a few names, defined once: the library validates against them
and the config / CLI offer them as choices. No imports, so the CLI's --help stays light."""

ALGORITHMS = ("copes", "es", "eggroll", "copes-lowrank")
DTYPES = ("auto", "float32", "bfloat16", "float16")
RESTORE_MODES = ("device", "host", "subtract")
UPDATE_PRECISIONS = ("auto", "native", "stochastic", "master_device", "master_host")
FITNESS_MODES = ("joint", "per_subspace", "centered_rank", "per_question")
OPTIMIZERS = ("sgd", "adam")
TOOL_FORMATS = ("auto", "qwen", "tags")
ROLLOUT_ENGINES = ("hf", "vllm")
VLLM_CPU_WEIGHTS = ("plain", "packed")
