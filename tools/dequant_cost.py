"""What the Q4_1 GGUF costs: perplexity of the de-quantised SmolLM2 on a fixed text, and an
estimate of the quantisation's own cost by adding one more quantisation's worth of error.

No unquantised copy of SmolLM2-135M-Instruct is available offline, so the perplexity loss of
Q4_1 against the original cannot be measured here. The estimate: each de-quantised block of 32
weights lies on a grid ``m + d * q`` (Q4_1: ``q in 0..15``, ``d = (max - min) / 15``; the Q8_0
embedding: ``q in -127..127``, ``d = max|w| / 127``), so the original weights were within
``d / 2`` of it. Adding independent uniform noise ``U(-d/2, d/2)`` to every quantised weight
applies a perturbation of the same size a second time; to first order (loss curvature similar
near both points) the perplexity change it causes is what the first quantisation cost.

    .venv/bin/python tools/dequant_cost.py --model .cache/models/SmolLM2-135M-Instruct --seeds 3
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from sao_megatron.convert.pretrained import text_nll

TEXT = Path(__file__).resolve().parent.parent / "tests" / "real_model" / "fixed_text.txt"


def grid_step(weight: torch.Tensor, levels: int, symmetric: bool) -> torch.Tensor:
    """Per-element quantisation step ``d`` of its block of 32 along the input dimension.

    weight: [out, in] float32 with ``in % 32 == 0``. Q4_1 (``symmetric=False``, 16 levels):
    ``d = (max - min) / 15``; Q8_0 (``symmetric=True``): ``d = max|w| / 127``.
    """
    blocks = weight.reshape(weight.shape[0], -1, 32)
    if symmetric:
        d = blocks.abs().amax(-1, keepdim=True) / levels
    else:
        d = (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / (levels - 1)
    return d.expand_as(blocks).reshape_as(weight)


def grid_residual(weight: torch.Tensor) -> float:
    """Largest distance (in units of d) of a Q4_1 block's weights from its 16-level grid."""
    d = grid_step(weight, 16, symmetric=False).reshape(weight.shape[0], -1, 32)
    blocks = weight.reshape(weight.shape[0], -1, 32)
    q = (blocks - blocks.amin(-1, keepdim=True)) / d.clamp_min(1e-30)
    return (q - q.round()).abs().max().item()


def add_quantisation_noise(model: torch.nn.Module, seed: int) -> None:
    """Add ``U(-d/2, d/2)`` to every quantised weight (2-D, in-place): Q8_0 for the embedding,
    Q4_1 for the attention/MLP projections; norms (fp32 in the GGUF) are left alone."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim != 2:
                continue
            d = grid_step(p, 127, True) if "embed_tokens" in name else grid_step(p, 16, False)
            p.add_((torch.rand(p.shape, generator=gen) - 0.5) * d)


def main() -> None:
    """Print (and with --json write) perplexities of the model and of its noisy copies."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=".cache/models/SmolLM2-135M-Instruct")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(args.model)
    ids = torch.tensor(tok(TEXT.read_text()).input_ids)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    layer0 = model.model.layers[0]
    residual = max(
        grid_residual(p) for p in (layer0.mlp.up_proj.weight, layer0.self_attn.q_proj.weight)
    )
    start = time.perf_counter()
    nll, n = text_nll(model, ids)
    seconds = time.perf_counter() - start
    state = {k: v.clone() for k, v in model.state_dict().items()}
    noisy = []
    for seed in range(args.seeds):
        model.load_state_dict(state)
        add_quantisation_noise(model, seed)
        noisy.append(text_nll(model, ids)[0])
    out = {
        "text": str(TEXT.relative_to(TEXT.parent.parent.parent)),
        "tokens_predicted": n,
        "nll": nll,
        "perplexity": math.exp(nll),
        "forward_seconds": round(seconds, 2),
        "q4_1_grid_residual_layer0": residual,
        "noisy_perplexity": [math.exp(x) for x in noisy],
        "noisy_delta_nll_mean": sum(noisy) / len(noisy) - nll,
    }
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
