"""Write a tiny random Qwen3-MoE checkpoint in Hugging Face format, for tests and benchmarks.

Run it with the vLLM virtualenv's Python (it has transformers), from the repository root:

    PYTHONPATH=. .venv-vllm/bin/python -m sao_megatron.rollout.tiny_model OUT_DIR [--seed 0]

The shape (`sao_megatron.models.tiny.HF_TINY_MOE_FIELDS`) suits both Megatron and vLLM's CPU
backend (docs/ARCHITECTURE.md). About 3M parameters. No tokenizer files are
written: the rollout is token-in/token-out and the server runs with ``--skip-tokenizer-init``.
``--vocab-size`` must equal the tokenizer's (default 300: the smallest sentencepiece vocabulary
`sao_megatron.data.tokenizer` trains, as the tests and ``tools/bench_rollout.py`` use).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from sao_megatron.models.config import MoEModelConfig
from sao_megatron.models.tiny import HF_TINY_MOE_FIELDS

TINY_MOE = MoEModelConfig(**HF_TINY_MOE_FIELDS)
"""The tiny model's shape (its HF config is ``TINY_MOE.to_hf_config(**SPECIAL_IDS)``)."""
SPECIAL_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def write_tiny_qwen3_moe(
    out_dir: str | Path, seed: int = 0, init_std: float = 0.1, vocab_size: int = 300
) -> Path:
    """Save a randomly initialised tiny Qwen3-MoE (fp32 safetensors + config.json) to `out_dir`.

    Args:
        out_dir: folder to create (or overwrite files in).
        seed: torch seed of the random init (same seed -> same weights).
        init_std: std of the normal init of all matrices; larger than the usual 0.02 so that the
            next-token distributions are far from uniform and sampling tests see distinct tokens.
        vocab_size: must equal the tokenizer's vocabulary size.
    Returns the folder path.
    """
    import torch
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    tiny = dataclasses.replace(TINY_MOE, vocab_size=vocab_size, initializer_range=init_std)
    config = Qwen3MoeConfig(**tiny.to_hf_config(**SPECIAL_IDS))
    model = Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(**SPECIAL_IDS).save_pretrained(out)
    (out / "sao_tiny_model.json").write_text(json.dumps({"seed": seed, "init_std": init_std}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-std", type=float, default=0.1)
    parser.add_argument("--vocab-size", type=int, default=300)
    args = parser.parse_args()
    out = write_tiny_qwen3_moe(
        args.out_dir, seed=args.seed, init_std=args.init_std, vocab_size=args.vocab_size
    )
    print(out)


if __name__ == "__main__":
    main()
