"""QKV interleaving per query group and gate/up (fc1) concatenation, against hand layouts."""

import pytest
import torch

from sao_megatron.convert.transforms import merge_gate_up, merge_qkv, split_gate_up, split_qkv


def _labelled(rows: int, tag: float) -> torch.Tensor:
    """[rows, 3] where row i holds (tag, i, i): every row says where it came from."""
    i = torch.arange(rows, dtype=torch.float64)
    return torch.stack([torch.full_like(i, tag), i, i], dim=1)


def test_qkv_is_interleaved_per_query_group():
    heads, groups, d = 6, 2, 2  # 3 query heads per group
    q, k, v = _labelled(heads * d, 0.0), _labelled(groups * d, 1.0), _labelled(groups * d, 2.0)
    fused = merge_qkv(q, k, v, num_query_groups=groups, head_dim=d)
    # Megatron layout: [q heads of group 0 (3*d rows), k_0 (d), v_0 (d), q of group 1, k_1, v_1]
    expected = torch.cat(
        [q[0:6], k[0:2], v[0:2], q[6:12], k[2:4], v[2:4]],
    )
    assert torch.equal(fused, expected)
    back = split_qkv(fused, num_attention_heads=heads, num_query_groups=groups, head_dim=d)
    for got, ref in zip(back, (q, k, v), strict=True):
        assert torch.equal(got, ref)


def test_qkv_bias_and_mha_round_trip():
    torch.manual_seed(0)
    q, k, v = torch.randn(8), torch.randn(8), torch.randn(8)  # 4 heads, 4 groups, d=2
    fused = merge_qkv(q, k, v, num_query_groups=4, head_dim=2)
    assert torch.equal(fused[:6], torch.cat([q[:2], k[:2], v[:2]]))
    back = split_qkv(fused, num_attention_heads=4, num_query_groups=4, head_dim=2)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v), strict=True))


def test_qkv_shape_errors():
    with pytest.raises(ValueError, match="num_query_groups=2, head_dim=4"):
        merge_qkv(
            torch.zeros(16, 3), torch.zeros(4, 3), torch.zeros(4, 3), num_query_groups=2, head_dim=4
        )
    with pytest.raises(ValueError, match="linear_qkv has 10 rows"):
        split_qkv(torch.zeros(10, 3), num_attention_heads=4, num_query_groups=2, head_dim=2)


def test_gate_up_concatenation():
    gate, up = _labelled(4, 0.0), _labelled(4, 1.0)
    fc1 = merge_gate_up(gate, up)
    assert torch.equal(fc1[:4], gate) and torch.equal(fc1[4:], up)
    g, u = split_gate_up(fc1)
    assert torch.equal(g, gate) and torch.equal(u, up)
    with pytest.raises(ValueError, match="differ"):
        merge_gate_up(gate, up[:3])
    with pytest.raises(ValueError, match="must be even"):
        split_gate_up(torch.zeros(5, 2))
