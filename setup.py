"""Package set-up for sao_megatron (see README for the two commands that install and run it)."""

from setuptools import find_packages, setup

# torch is pinned by the Makefile (`torch==2.13.0` picks the local CPU wheel); here we only state
# the range we test against, so pip never resolves an unpinned torch to a CUDA build on its own.
INSTALL_REQUIRES = [
    "torch>=2.6,<2.15",
    "megatron-core==0.16.*",
    "numpy>=1.26",
    "sentencepiece>=0.2,<0.3",
    "omegaconf>=2.3,<2.5",
    "safetensors>=0.4",
    "psutil>=5.9",  # megatron dist_checkpointing's async writer hangs without it
    "reasoning-gym==0.1.25",
    "math-verify>=0.7,<0.10",
    "tqdm>=4.66",
    "tensorboard>=2.16",
    "matplotlib>=3.8",
    "requests>=2.31",
    "httpx>=0.27,<1",  # rollout: async HTTP client of the vLLM engines
    "aiohttp>=3.9,<4",  # rollout: the agents' OpenAI-compatible chat gateway (rollout/gateway/)
    "openai>=1.40,<2",  # the client agent code is written against (examples/agents, tests)
    "minigrid>=3.0,<3.3",  # BabyAI levels + expert bot (sao_megatron/envs/babyai.py), offline
    # convert tests (reference logits of tiny HF models) and HF tokenizers; <5: 5.x fuses MoE experts
    "transformers>=4.51,<5",
    # GGUF de-quantisation of the real model (sao-convert fetch-smollm2): transformers'
    # from_pretrained(gguf_file=...) needs gguf; accelerate for its low-memory loading path
    "gguf>=0.10,<1",
    "accelerate>=1.0,<2",
]

EXTRAS = {
    # GPU-only, the pin of requirements-gpu.txt (tests/tools/test_gpu_install.py keeps them
    # equal). Its transformer_engine_torch is an sdist that must build against the installed CUDA
    # torch with nvcc: install it with `GPU=1 make install` (--no-build-isolation), not bare.
    "gpu": ["transformer-engine[pytorch]==2.11.0"],
    "dev": [
        # <9.2: pytest 9.2 names a test by Node._id, and pytest-xdist 3.8's loadgroup still
        # renames Node._nodeid: `make test`'s groups would split silently (tests/test_xdist_groups)
        "pytest>=8,<9.2",
        "pytest-timeout>=2.3",
        "pytest-xdist>=3.6",
        "ruff>=0.6",
        "import-linter>=2.1",
    ],
}

setup(
    name="sao_megatron",
    version="0.1.0",
    description="SAO: single-trajectory asynchronous RL post-training for MoE LLMs on Megatron-Core",
    license="Apache-2.0",
    packages=find_packages(include=["sao_megatron", "sao_megatron.*"]),
    python_requires=">=3.10,<3.13",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": [
            "sao-train=sao_megatron.cli.train:main",
            "sao-convert=sao_megatron.convert.cli:main",
            "sao-plan=sao_megatron.cli.plan:main",
            "sao-serve=sao_megatron.cli.serve:main",
        ]
    },
)
