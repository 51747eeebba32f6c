"""Gateway replies cut by the token limit, at any turn, and ``logprobs`` served to the agent.

A reply cut at its token budget (``finish_reason: "length"``) is flagged on its node
(`ActionNode.truncated`) whichever turn it is; the agent goes on after it. A truncated episode
whose last reply was cut is not bootstrapped; a cut reply in the middle is an ordinary GAE step.
``logprobs=True`` returns the recorded behaviour log-probs in OpenAI's chat format, read back
through the real `openai` client; ``top_logprobs > 0`` is refused with a 400 naming it.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch

from sao_megatron.algorithm import registry
from sao_megatron.algorithm.config import AlgorithmConfig, SAOConfig
from sao_megatron.data.batch import gather_to_streams, pack_trajectories
from sao_megatron.data.micro_batches import layout_micro_batches
from sao_megatron.rollout.gateway import ChatGateway
from sao_megatron.rollout.status import EpisodeStatus
from sao_megatron.trainer.step_advantages import StepAdvantages
from tests.rollout.test_gateway import (  # noqa: F401 (fixtures)
    CONFIG,
    ScriptedEngine,
    _episode,
    formatter,
    smollm2_tok_dir,
)

GAMMA, LAM = 0.9, 0.8
MESSAGES = [{"role": "user", "content": "hi"}]


def _agent_cutting(cut_turn: int, seen: dict):
    """Calls the model until the gateway refuses (turn budget), with max_tokens=3 on
    `cut_turn`; every reply, cut or not, goes back into the history; returns 0.5."""

    async def agent(task, client):
        msgs = [{"role": "user", "content": "Count to three, slowly."}]
        seen["finish"] = []
        for turn in range(10):
            extra = {"max_tokens": 3} if turn == cut_turn else {}
            try:
                r = await client.chat.completions.create(model="policy", messages=msgs, **extra)
            except openai.BadRequestError as e:
                seen["refusal"] = e.code
                break
            seen["finish"].append(r.choices[0].finish_reason)
            msgs.append(r.choices[0].message.model_dump(exclude_none=True))
            msgs.append({"role": "user", "content": f"and then? ({turn})"})
        return 0.5

    return agent


def _gae_reference(rewards, values, v_last, lam):
    """float64 token-level GAE over one action stream (rewards on each node's last token)."""
    n = len(rewards)
    adv = [0.0] * n
    nxt_v, nxt_a = v_last, 0.0
    for j in reversed(range(n)):
        delta = rewards[j] + GAMMA * nxt_v - values[j]
        adv[j] = nxt_a = delta + GAMMA * lam * nxt_a
        nxt_v = values[j]
    return torch.tensor(adv, dtype=torch.float64)


@pytest.mark.parametrize("cut_turn", [1, 2], ids=["middle_reply_cut", "last_reply_cut"])
def test_cut_reply_is_flagged_and_never_bootstrapped(formatter, cut_turn):  # noqa: F811
    """Three replies, then the 4th request is refused (max_turns=3): ``truncated``. The cut
    reply's node is flagged whichever turn it is and validates; GAE bootstraps from V_last only
    when the last reply was complete (cut in the middle: an ordinary step the agent went on
    from; cut last: the return is the rewards, as for the text runner's cut action)."""
    seen: dict = {}
    script = ["one, two, three and so on", "four, five, six", "seven, eight, nine"]
    out, engine = asyncio.run(
        _episode(formatter, _agent_cutting(cut_turn, seen), None, script, max_turns=3)
    )
    assert out.status == EpisodeStatus.TRUNCATED and out.trainable, out.error
    assert seen["refusal"] == "context_length_exceeded"
    expected_finish = ["stop"] * 3
    expected_finish[cut_turn] = "length"
    assert seen["finish"] == expected_finish
    traj = out.trajectory
    assert traj.truncated and not traj.terminated and traj.info["truncated_by"] == "max_turns"
    assert [n.truncated for n in traj.nodes] == [t == cut_turn for t in range(3)]
    cut = traj.nodes[cut_turn]
    assert len(cut.action_token_ids) == 3 and cut.action_token_ids[-1] != formatter.end_of_turn_id
    assert [n.reward for n in traj.nodes] == [0.0, 0.0, 0.5]
    traj.validate()  # a cut node anywhere is a valid trajectory
    for n in range(1, 3):  # the agent went on: each prompt extends the previous one by its action
        before = engine.prompts[n - 1] + engine.generations[n - 1].token_ids
        assert engine.prompts[n][: len(before)] == before

    batch = pack_trajectories([traj], pad_token_id=0, max_seq_len=4096)
    last_cut = cut_turn == 2
    assert batch.truncated.tolist() == [not last_cut]  # the GAE bootstrap flag
    assert batch.cut_action.tolist() == [last_cut]

    cfg = AlgorithmConfig(name="sao", sao=SAOConfig(gamma=GAMMA, lam_policy=LAM, lam_value=1.0))
    algorithm = registry.build(cfg)
    rank = layout_micro_batches(batch, dp_rank=0, dp_size=1, micro_batch_size=1, by_group=False)
    inputs = StepAdvantages(algorithm).inputs(rank)
    num_tokens = traj.num_action_tokens
    values = torch.linspace(0.3, -0.2, num_tokens, dtype=torch.float64)
    v_last = 2.5
    inputs.values = values[None, :]
    inputs.bootstrap_values = torch.tensor([v_last], dtype=torch.float64)
    got = algorithm.compute_advantages(inputs)

    node_of, _ = gather_to_streams(batch, batch.node_index)
    node_of = node_of[0].tolist()
    rewards = [
        traj.nodes[k].reward if j + 1 == num_tokens or node_of[j + 1] != k else 0.0
        for j, k in enumerate(node_of)
    ]
    v_next = 0.0 if last_cut else v_last
    vals = values.tolist()
    ref_adv = _gae_reference(rewards, vals, v_next, LAM)
    ref_ret = _gae_reference(rewards, vals, v_next, 1.0) + values
    torch.testing.assert_close(got.advantages[0].double(), ref_adv, rtol=0, atol=1e-12)
    torch.testing.assert_close(got.returns[0].double(), ref_ret, rtol=0, atol=1e-12)
    # the return of the first token: 0.5 discounted from the end, plus V_last only if complete
    first = 0.5 * GAMMA ** (num_tokens - 1) + (0.0 if last_cut else v_last * GAMMA**num_tokens)
    assert float(got.returns[0, 0]) == pytest.approx(first, abs=1e-12)


def _agent_reading_logprobs(seen: dict, **kw):
    async def agent(task, client):
        msgs = [{"role": "user", "content": "Say café ✓ 日本, please."}]
        r = await client.chat.completions.create(model="policy", messages=msgs, **kw)
        seen["first"] = r
        msgs.append(r.choices[0].message.model_dump(exclude_none=True))
        msgs.append({"role": "user", "content": "Again, cut short."})
        r2 = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=4, **kw)
        seen["second"] = r2
        return 1.0

    return agent


def test_logprobs_are_the_recorded_behaviour_logprobs(formatter):  # noqa: F811
    """``logprobs=True`` (``top_logprobs=0``): each reply's ``logprobs.content`` has one entry
    per sampled token (the stop token included), with the recorded behaviour log-prob, the
    token's text and its exact bytes (joined, the UTF-8 of the reply's tokens, also where a
    character spans tokens); ``top_logprobs`` lists are empty. Without the parameter: None."""
    seen: dict = {}
    script = ["Café ✓ 日本, here you are.", "Café ✓ 日本 again"]
    agent = _agent_reading_logprobs(seen, logprobs=True, top_logprobs=0)
    out, engine = asyncio.run(_episode(formatter, agent, None, script))
    assert out.status == EpisodeStatus.COMPLETED and out.trainable, out.error
    assert "ignored_params" not in out.trajectory.info
    for key, node, gen in zip(
        ("first", "second"), out.trajectory.nodes, engine.generations, strict=True
    ):
        choice = seen[key].choices[0]
        content = choice.logprobs.content
        assert len(content) == len(node.action_token_ids) == len(gen.token_ids)
        assert [c.logprob for c in content] == node.behaviour_logprobs
        assert [c.logprob for c in content] == [min(x, 0.0) for x in gen.logprobs]
        assert choice.logprobs.content[0].logprob == node.behaviour_logprobs[0]
        assert [c.token for c in content] == [
            formatter.hf.decode([i], skip_special_tokens=False) for i in node.action_token_ids
        ]
        text = formatter.hf.decode(node.action_token_ids, skip_special_tokens=False)
        joined = b"".join(bytes(c.bytes) for c in content)
        assert joined.decode("utf-8", errors="replace") == text
        assert all(c.top_logprobs == [] for c in content)
    first_text = formatter.hf.decode(engine.generations[0].token_ids, skip_special_tokens=False)
    first_bytes = b"".join(bytes(c.bytes) for c in seen["first"].choices[0].logprobs.content)
    assert first_bytes == first_text.encode("utf-8")  # "✓" spans three tokens
    assert seen["first"].choices[0].finish_reason == "stop"
    assert seen["first"].choices[0].logprobs.content[-1].token == formatter.end_of_turn
    assert seen["second"].choices[0].finish_reason == "length"  # cut: no stop token
    assert any("\ufffd" in c.token for c in seen["first"].choices[0].logprobs.content)

    seen = {}
    out, _ = asyncio.run(_episode(formatter, _agent_reading_logprobs(seen), None, script))
    assert out.status == EpisodeStatus.COMPLETED, out.error
    assert seen["first"].choices[0].logprobs is None


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"logprobs": True, "top_logprobs": 2}, "top_logprobs=2"),
        ({"top_logprobs": 1}, "top_logprobs=1"),
        ({"extra_body": {"logprobs": "yes"}}, "logprobs='yes'"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs=-1"),
    ],
    ids=["top_logprobs_2", "top_logprobs_without_logprobs", "logprobs_not_bool", "negative"],
)
def test_unservable_logprobs_requests_are_refused(formatter, kw, match):  # noqa: F811
    """``top_logprobs > 0`` (the engine returns only the sampled token's log-prob) and
    malformed values get HTTP 400 naming the parameter, before any engine call, and fail the
    episode ``agent_error`` (also when run by the agent runner)."""

    async def main():
        gw = await ChatGateway().start()
        engine = ScriptedEngine(formatter, ["hello"])
        session = gw.open_session(
            episode_id="lp#0",
            task_id="lp",
            group_index=0,
            formatter=formatter,
            generate=engine,
            config=CONFIG,
            is_stale=lambda version: False,
            max_turns=4,
        )
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0)
        try:
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model="policy", messages=MESSAGES, **kw)
        finally:
            await client.close()
            await gw.aclose()
        return err.value, session, engine

    err, session, engine = asyncio.run(main())
    assert err.status_code == 400 and err.code == "invalid_request"
    assert match in err.message
    assert session.failure is not None and session.failure[0] == EpisodeStatus.AGENT_ERROR
    assert engine.prompts == []  # refused before any engine call

    async def agent(task, client):
        await client.chat.completions.create(model="policy", messages=MESSAGES, **kw)
        return 1.0

    out, engine = asyncio.run(_episode(formatter, agent, None, ["hello"]))
    assert out.status == EpisodeStatus.AGENT_ERROR and not out.trainable
    assert match in out.error and engine.prompts == []
