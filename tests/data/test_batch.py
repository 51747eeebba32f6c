import pytest
import torch

from sao_megatron.data.batch import gather_to_streams, pack_trajectories, scatter_from_streams
from sao_megatron.data.trajectory import ActionNode, Trajectory


def _node(obs, act, reward=0.0, version=0):
    return ActionNode(
        observation_token_ids=obs,
        action_token_ids=act,
        behaviour_logprobs=[-0.5] * len(act),
        policy_versions=[version] * len(act),
        reward=reward,
    )


def _trajs():
    a = Trajectory(task_id="a", nodes=[_node([1, 2], [3, 4]), _node([5], [6], reward=1.0)])
    b = Trajectory(
        task_id="b", nodes=[_node([7], [8, 9, 10], reward=0.5, version=2)], truncated=True
    )
    w = Trajectory(
        task_id="w",
        context_mode="window",
        nodes=[_node([1], [2], version=1), _node([3], [4, 5], reward=2.0, version=1)],
    )
    w.nodes[0].context_token_ids = [1]
    w.nodes[1].context_token_ids = [2, 3]
    return [a, b, w]


def test_pack_layout():
    batch = pack_trajectories(_trajs(), pad_token_id=0, max_seq_len=16, pad_to_multiple_of=4)
    assert batch.token_ids.shape == (4, 8)  # 3 rows of len 6/4/2..4 -> padded to 8
    assert batch.token_ids[0].tolist() == [1, 2, 3, 4, 5, 6, 0, 0]
    assert batch.action_mask[0].tolist() == [0, 0, 1, 1, 0, 1, 0, 0]
    assert batch.row_trajectory.tolist() == [0, 1, 2, 2]
    assert batch.token_ids[3].tolist()[:5] == [2, 3, 4, 5, 0]
    assert batch.node_rewards.tolist() == [[0.0, 1.0], [0.5, 0.0], [0.0, 2.0]]
    assert batch.num_nodes.tolist() == [2, 1, 2]
    assert batch.truncated.tolist() == [False, True, False]
    assert batch.num_action_tokens == 3 + 3 + 3
    assert batch.position_ids[1].tolist() == [0, 1, 2, 3, 0, 0, 0, 0]


def test_streams_round_trip():
    batch = pack_trajectories(_trajs(), pad_token_id=0, max_seq_len=16)
    per_token = torch.arange(batch.token_ids.numel(), dtype=torch.float32).view_as(batch.token_ids)
    streams, valid = gather_to_streams(batch, per_token)
    assert valid.sum(1).tolist() == [3, 3, 3]
    # trajectory w: action tokens are row 2 pos 1 then row 3 pos 2,3 (in order)
    t = batch.token_ids.shape[1]
    assert streams[2].tolist() == [2 * t + 1, 3 * t + 2, 3 * t + 3]
    nodes, _ = gather_to_streams(batch, batch.node_index)
    assert nodes.tolist() == [[0, 0, 1], [0, 0, 0], [0, 1, 1]]
    back = scatter_from_streams(batch, streams)
    assert torch.equal(back[batch.action_mask], per_token[batch.action_mask])
    assert back[~batch.action_mask].abs().sum() == 0


def test_pack_errors():
    trajs = _trajs()
    with pytest.raises(ValueError, match="max_seq_len"):
        pack_trajectories(trajs, pad_token_id=0, max_seq_len=3)
    trajs[1].temperature = 0.7
    with pytest.raises(ValueError, match="temperature"):
        pack_trajectories(trajs, pad_token_id=0, max_seq_len=16)
    bad = Trajectory(task_id="x", nodes=[_node([], [1, 2])])
    with pytest.raises(ValueError, match="prompt token"):
        pack_trajectories([bad], pad_token_id=0, max_seq_len=16)


def test_pack_carries_top_p_and_top_k_and_rejects_mixed_ones():
    """Issue 19.2: the trainer must score at the engine's top_p/top_k, so the batch carries
    them like the temperature."""
    trajs = _trajs()
    for t in trajs:
        t.top_p, t.top_k = 0.7, 20
    b = pack_trajectories(trajs, pad_token_id=0, max_seq_len=64)
    assert (b.temperature, b.top_p, b.top_k) == (1.0, 0.7, 20)
    assert pack_trajectories(_trajs(), pad_token_id=0, max_seq_len=64).top_p == 1.0
    trajs[1].top_p = 0.9
    with pytest.raises(ValueError, match=r"top_p \[0.7, 0.9\].*rollout.top_p"):
        pack_trajectories(trajs, pad_token_id=0, max_seq_len=64)
    trajs[1].top_p, trajs[1].top_k = 0.7, 5
    with pytest.raises(ValueError, match="top_k"):
        pack_trajectories(trajs, pad_token_id=0, max_seq_len=64)


def test_trajectory_validates_top_p_and_top_k():
    t = _trajs()[0]
    t.top_p = 0.0
    with pytest.raises(ValueError, match=r"Trajectory.top_p=0.0"):
        t.validate()
    t.top_p, t.top_k = 1.0, -1
    with pytest.raises(ValueError, match=r"Trajectory.top_k=-1"):
        t.validate()


def test_cut_action_is_not_bootstrapped():
    """A last action cut at its token budget ends the episode with nothing to bootstrap:
    `truncated` (the GAE bootstrap flag) is False and `cut_action` True; a budget truncation
    still bootstraps."""
    cut = Trajectory(task_id="c", nodes=[_node([1], [2, 3])], truncated=True)
    cut.nodes[-1].truncated = True
    cut.validate()
    trajs = [*_trajs(), cut]
    batch = pack_trajectories(trajs, pad_token_id=0, max_seq_len=16)
    assert batch.truncated.tolist() == [False, True, False, False]
    assert batch.cut_action.tolist() == [False, False, False, True]
    assert batch.truncated.dtype == batch.cut_action.dtype == torch.bool

    from sao_megatron.trainer.metrics import episode_metrics

    m = episode_metrics(batch)
    assert m["episode/truncated_fraction"] == 0.5  # b (budget) and c (cut)
    assert m["episode/cut_action_fraction"] == 0.25
