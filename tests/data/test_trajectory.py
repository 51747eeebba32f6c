import math

import pytest
import torch

from sao_megatron.data.trajectory import ActionNode, Trajectory


def _traj():
    return Trajectory(
        task_id="hanoi:1",
        nodes=[
            ActionNode(
                observation_token_ids=[5, 6, 7],
                action_token_ids=[8, 9],
                behaviour_logprobs=[-0.1, -0.2],
                policy_versions=[3, 3],
                reward=0.0,
            ),
            ActionNode(
                observation_token_ids=[10],
                action_token_ids=[11, 12, 13],
                behaviour_logprobs=[-0.3, -0.4, -0.5],
                policy_versions=[3, 4, 4],
                reward=1.0,
            ),
        ],
        terminated=True,
    )


def test_flatten_full_history():
    t = _traj()
    t.validate()
    s = t.to_token_sequence()
    assert s.token_ids.tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert s.action_mask.tolist() == [0, 0, 0, 1, 1, 0, 1, 1, 1]
    assert s.node_index.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert s.policy_versions.tolist() == [-1, -1, -1, 3, 3, -1, 3, 4, 4]
    torch.testing.assert_close(
        s.behaviour_logprobs, torch.tensor([0, 0, 0, -0.1, -0.2, 0, -0.3, -0.4, -0.5])
    )
    assert t.num_action_tokens == 5 and t.total_reward == 1.0
    assert (t.min_policy_version, t.max_policy_version) == (3, 4)


def test_window_sequences():
    t = _traj()
    t.context_mode = "window"
    with pytest.raises(ValueError, match="context_token_ids"):
        t.validate()
    t.nodes[0].context_token_ids = [5, 6, 7]
    t.nodes[1].context_token_ids = [7, 10]
    t.validate()
    seqs = t.to_node_sequences()
    assert [s.token_ids.tolist() for s in seqs] == [[5, 6, 7, 8, 9], [7, 10, 11, 12, 13]]
    assert seqs[1].action_mask.tolist() == [0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="full_history"):
        t.to_token_sequence()


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("behaviour_logprobs", [-0.1], "one log-prob per sampled token"),
        ("behaviour_logprobs", [math.nan, -0.2], "finite"),
        ("policy_versions", [1], "weight version"),
        ("reward", math.inf, "finite"),
        ("action_token_ids", [], "at least one token"),
    ],
)
def test_validate_names_field(field, value, match):
    t = _traj()
    setattr(t.nodes[0], field, value)
    with pytest.raises(ValueError, match=match) as e:
        t.validate()
    assert "nodes[0]" in str(e.value)
