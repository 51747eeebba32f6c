import random

import pytest
import torch

from sao_megatron.data.demonstrations import DemonstrationConfig, corpus_lines
from sao_megatron.data.episode import (
    EpisodeFormatConfig,
    EpisodeFormatter,
    build_trajectory,
    episode_text,
)
from sao_megatron.data.tokenizer import TokenizerConfig, train_sentencepiece
from sao_megatron.envs import EnvSpec, make_env


@pytest.fixture(scope="module")
def tok():
    cfg = DemonstrationConfig(
        envs=[EnvSpec(name="hanoi", options={"horizon": 20}), EnvSpec(name="chain_sum")],
        num_episodes=20,
    )
    return train_sentencepiece(corpus_lines(cfg), TokenizerConfig(vocab_size=400))


def _fake_engine(formatter, rng, text):
    """Stands in for the rollout engine: returns sampled ids (stop token included),
    log-probs and versions. The ids are what a policy emits for `text`."""
    ids = formatter.action_ids(text)
    return ids, [-rng.random() for _ in ids], [rng.randint(3, 4) for _ in ids]


def _play(formatter, env, seed):
    rng = random.Random(seed)
    obs = env.reset(seed)
    builder = formatter.new_episode(f"{env.name}:{seed}", obs)
    observations, actions, contexts = [obs], [], []
    while True:
        contexts.append(builder.next_context_ids())
        ids, lps, vers = _fake_engine(formatter, rng, env.gold_action())
        text = formatter.action_text(ids)
        r = env.step(text)
        builder.add_action(ids, lps, vers, r.reward)
        actions.append(text)
        if r.done or r.truncated:
            break
        builder.add_observation(r.observation)
        observations.append(r.observation)
    traj = builder.to_trajectory(terminated=r.done, truncated=r.truncated, info={"x": 1})
    return traj, observations, actions, contexts


def test_full_history_trajectory_matches_episode_text(tok):
    fmt = EpisodeFormatter(tok)
    env = make_env("hanoi", horizon=12)
    traj, observations, actions, contexts = _play(fmt, env, 5)
    traj.validate()
    assert traj.total_reward == 1.0 and traj.terminated and traj.context_mode == "full_history"
    assert len(traj.nodes) == 12 and traj.info == {"x": 1}
    seq = traj.to_token_sequence()
    assert seq.token_ids[0].item() == tok.bos_id
    assert tok.decode(seq.token_ids.tolist()) == episode_text(observations, actions)
    assert fmt.episode_text(observations, actions) == episode_text(observations, actions)
    # action mask covers exactly the actions + stop markers, node by node
    for n in range(len(traj.nodes)):
        sel = seq.action_mask & (seq.node_index == n)
        assert tok.decode(seq.token_ids[sel].tolist()) == actions[n] + "<|eoa|>"
        assert seq.token_ids[sel][-1].item() == tok.token_to_id("<|eoa|>")
        assert traj.nodes[n].action_text == actions[n]
    # the prompt each node was sampled with is the trajectory prefix before its action
    starts = torch.nonzero(seq.action_mask[1:] & ~seq.action_mask[:-1]).flatten() + 1
    for n, s in enumerate(starts.tolist()):
        assert contexts[n] == seq.token_ids[:s].tolist()
    assert all(n.context_token_ids is None for n in traj.nodes)
    again = build_trajectory(
        fmt,
        traj.task_id,
        observations,
        [n.action_token_ids for n in traj.nodes],
        [n.behaviour_logprobs for n in traj.nodes],
        [n.policy_versions for n in traj.nodes],
        [n.reward for n in traj.nodes],
        terminated=True,
        truncated=False,
        info={"x": 1},
    )
    assert again == traj
    with pytest.raises(ValueError, match="build_trajectory"):
        build_trajectory(
            fmt,
            "t",
            observations[:-1],
            [[1]] * 12,
            [[0.0]] * 12,
            [[0]] * 12,
            [0.0] * 12,
            terminated=True,
            truncated=False,
        )


@pytest.mark.parametrize("window", [0, 1, 3, 100])
def test_window_mode_contexts(tok, window):
    full = EpisodeFormatter(tok)
    fmt = EpisodeFormatter(tok, EpisodeFormatConfig(context_mode="window", window_size=window))
    env = make_env("hanoi", horizon=8)
    traj, observations, actions, _ = _play(fmt, env, 2)
    traj.validate()
    assert traj.context_mode == "window"
    full_traj, *_ = _play(full, env, 2)
    full_seq = full_traj.to_token_sequence()
    seqs = traj.to_node_sequences()
    for n, (node, seq) in enumerate(zip(traj.nodes, seqs, strict=True)):
        first = max(0, n - window)
        expected = full.prompt_text(observations[0]) + "".join(
            actions[j] + "<|eoa|>" + full.observation_text(observations[j + 1])
            for j in range(first, n)
        )
        assert tok.decode(node.context_token_ids) == expected
        assert node.context_token_ids[0] == tok.bos_id
        assert tok.decode(seq.token_ids[seq.action_mask].tolist()) == actions[n] + "<|eoa|>"
        if window >= n:  # the window holds everything: identical to the full-history prefix
            k = len(node.context_token_ids)
            assert node.context_token_ids == full_seq.token_ids[:k].tolist()


def test_stop_tokens_and_action_text(tok):
    fmt = EpisodeFormatter(tok)
    eoa = tok.token_to_id("<|eoa|>")
    assert fmt.stop_token_ids == [eoa, tok.eos_id] and fmt.stop_strings == ["<|eoa|>"]
    ids = tok.encode("A->C") + [eoa]
    assert fmt.action_text(ids) == "A->C" and fmt.is_complete_action(ids)
    assert fmt.action_text(tok.encode("A->")) == "A->" and not fmt.is_complete_action(
        tok.encode("A->")
    )
    assert fmt.action_text(tok.encode("B->A") + [tok.eos_id]) == "B->A"
    assert fmt.is_complete_action(tok.encode("B->A") + [tok.eos_id])
    assert fmt.prompt_ids("x") == [tok.bos_id] + tok.encode("<|obs|>x<|act|>")
    assert fmt.observation_ids("y") == tok.encode("<|obs|>y<|act|>")
    sys_fmt = EpisodeFormatter(tok, EpisodeFormatConfig(system_prompt="Be brief.\n", add_bos=False))
    assert tok.decode(sys_fmt.prompt_ids("x")) == "<|obs|>Be brief.\nx<|act|>"


def test_single_turn_episode(tok):
    fmt = EpisodeFormatter(tok)
    traj, observations, actions, _ = _play(fmt, make_env("chain_sum"), 4)
    assert len(traj.nodes) == 1 and traj.total_reward == 1.0
    assert tok.decode(traj.to_token_sequence().token_ids.tolist()) == (
        f"<|obs|>{observations[0]}<|act|>{actions[0]}<|eoa|>"
    )


def test_sft_sequences_mask_only_trained_actions(tok):
    for mode in ["full_history", "window"]:
        fmt = EpisodeFormatter(tok, EpisodeFormatConfig(context_mode=mode, window_size=2))
        env = make_env("hanoi", horizon=5)
        builder = fmt.new_episode("t", env.reset(0))
        acts = []
        for n in range(5):
            a = env.gold_action()
            acts.append(a)
            r = env.step(a)
            builder.add_action(fmt.action_ids(a), reward=r.reward)
            if n < 4:
                builder.add_observation(r.observation)
        mask = [True, False, True, True, False]
        seqs = builder.to_sft_sequences(mask)
        assert len(seqs) == (1 if mode == "full_history" else 3)
        trained = "".join(tok.decode(s.token_ids[s.action_mask].tolist()) for s in seqs)
        assert trained == "".join(acts[n] + "<|eoa|>" for n in range(5) if mask[n])
        for s in seqs:
            assert s.behaviour_logprobs.dtype == torch.float32 and not s.behaviour_logprobs.any()
            assert (s.policy_versions == -1).all() and len(s) == s.token_ids.numel()


def test_errors(tok):
    with pytest.raises(ValueError, match="episode.context_mode"):
        EpisodeFormatConfig(context_mode="sliding")
    with pytest.raises(ValueError, match="episode.window_size"):
        EpisodeFormatConfig(window_size=-1)
    with pytest.raises(ValueError, match="episode.action_end"):
        EpisodeFormatConfig(action_end="")
    fmt = EpisodeFormatter(tok)
    b = fmt.new_episode("t", "obs")
    with pytest.raises(RuntimeError, match="add the action"):
        b.add_observation("o")
    b.add_action([5, 6])
    with pytest.raises(RuntimeError, match="add the observation"):
        b.next_context_ids()
    with pytest.raises(ValueError, match="train_mask"):
        b.to_sft_sequences([True, True])
    with pytest.raises(ValueError, match="observations for"):
        episode_text(["a"], ["x", "y"])
