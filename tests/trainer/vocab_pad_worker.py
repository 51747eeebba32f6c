"""Worker of tests/trainer/test_vocab_padding.py: the shipped TP=2/EP=2 example's model with a
415-token tokenizer (Megatron vocabulary padded to 416), on 2 gloo ranks.

Records, on rank 0, into ``<out>/result.pt``: the HF config's vocab_size, the row counts of the
exported embedding / lm_head, the float64 sum over the real vocabulary of the trainer's token
probabilities, and the entropy error against a float64 reference, with and without the mask.
"""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "multirank_tp2_ep2.yaml"
NUM_TOKENS = 415  # the trained tokenizer of the issue; Megatron pads to 416 for TP=2
TEMPERATURE = 0.7


def _probe(chunk, parallel, ids):
    """(sum_v p(v) over the real ids [b, s-1] float64, entropy error vs float64, pad logits)."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from sao_megatron.models import causal_padding_mask, token_logprobs_and_entropy

    am = torch.ones_like(ids)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        logits = chunk(ids, pos, causal_padding_mask(am))[:, :-1]  # [b, s-1, V/tp]
        b, s, _ = logits.shape
        total = torch.zeros(b, s, dtype=torch.float64)
        entropy = None
        for v in range(NUM_TOKENS):
            target = torch.full((b, s), v, dtype=torch.long)
            lp, ent = token_logprobs_and_entropy(
                logits, target, TEMPERATURE, tp_group=parallel.pg_collection.tp
            )
            total += lp.double().exp()
            entropy = ent
        full = gather_from_tensor_model_parallel_region(logits.contiguous())  # [b, s-1, V]
        z = full[..., :NUM_TOKENS].double() / TEMPERATURE
        ref_ent = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
        ent_err = float((entropy.double() - ref_ent).abs().max())
    return total, ent_err, full[..., NUM_TOKENS:]


def worker(rank: int, world_size: int, out: str) -> None:
    from sao_megatron.configs import load_config
    from sao_megatron.convert.spec import ConversionSpec
    from sao_megatron.models import build_policy
    from sao_megatron.parallel import destroy_parallel, initialize_parallel
    from sao_megatron.trainer import runtime
    from sao_megatron.trainer.job import JobConfig
    from sao_megatron.weight_sync import gather_hf_weights

    job = load_config(JobConfig, str(CONFIG), [])
    tok = types.SimpleNamespace(vocab_size=NUM_TOKENS, bos_id=1, eos_id=2, pad_id=0)
    job = dataclasses.replace(job, model=dataclasses.replace(job.model, vocab_size=1024))
    fitted = runtime.fit_vocab_to_tokenizer(job, tok, job.parallel.tp)
    parallel = initialize_parallel(fitted.parallel)
    torch.manual_seed(0)
    chunks = build_policy(fitted.model, parallel, fitted.precision)
    hf_config = runtime.hf_config_for(fitted.model, tok, fitted.precision.params_dtype)
    spec = ConversionSpec.from_hf_config(hf_config)
    weights = gather_hf_weights(chunks, spec, parallel) or {}  # {} on ranks other than 0
    rows = {
        n: t.shape[0]
        for n, t in weights.items()
        if n in ("model.embed_tokens.weight", "lm_head.weight")
    }
    ids = torch.randint(0, NUM_TOKENS, (2, 8), generator=torch.Generator().manual_seed(3))
    unmasked_sum, unmasked_err, _ = _probe(chunks[0], parallel, ids)
    masked = runtime.mask_vocab_padding(chunks, hf_config["vocab_size"], parallel)
    masked_sum, masked_err, pad_logits = _probe(chunks[0], parallel, ids)
    if rank == 0:
        torch.save(
            {
                "model_vocab": fitted.model.vocab_size,
                "hf_vocab": hf_config["vocab_size"],
                "rows": rows,
                "masked_ids": masked,
                "unmasked_sum": unmasked_sum,
                "unmasked_entropy_err": unmasked_err,
                "masked_sum": masked_sum,
                "masked_entropy_err": masked_err,
                "pad_logits": pad_logits,
            },
            Path(out) / "result.pt",
        )
    destroy_parallel()
