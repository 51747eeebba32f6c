"""Whitening over the global batch: `masked_whiten` with a `BatchReducer` over the shares of
several ranks equals whitening the concatenated batch (float64 loop reference).

The ranks are threads here and the reducer a barrier-synchronised sum (`ThreadGroup`), so the
collective's contract (every rank calls `sum` the same number of times, in the same order) is
exercised as well; the trainer's reducer over gloo ranks is tested in
tests/trainer/test_whiten_dp.py.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from sao_megatron.algorithm import registry
from sao_megatron.algorithm.advantages import LOCAL_BATCH, masked_whiten
from sao_megatron.algorithm.base import AdvantageInputs
from sao_megatron.algorithm.config import AlgorithmConfig, GRPOConfig, SAOConfig
from tests.algorithm.batches import random_batch

TIMEOUT_S = 600.0  # a generous limit on a loaded machine: only a broken contract waits that long


class ThreadGroup:
    """A stand-in for an all-reduce over `size` threads: `member(r).sum(x)` waits for every
    member's `x` of this call and returns their sum (added in rank order, float64)."""

    def __init__(self, size: int) -> None:
        self.size, self.calls = size, [0] * size
        self._slots: list[torch.Tensor | None] = [None] * size
        self._barrier = threading.Barrier(size, timeout=TIMEOUT_S)

    def member(self, rank: int):
        group = self

        class Member:
            def sum(self, x: torch.Tensor) -> torch.Tensor:
                group.calls[rank] += 1
                group._slots[rank] = x
                group._barrier.wait()
                total = sum(group._slots[1:], group._slots[0].clone())
                group._barrier.wait()  # every member has read the slots of this call
                return total

        return Member()

    def run(self, fn, shares: list) -> list:
        """`fn(share, reducer)` on one thread per share; the results in rank order."""
        out: list = [None] * self.size
        errors: list[BaseException] = []

        def target(rank):
            try:
                out[rank] = fn(shares[rank], self.member(rank))
            except BaseException as e:  # reported by the test thread
                errors.append(e)
                self._barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S)
        assert not any(t.is_alive() for t in threads), "a rank is still waiting in sum()"
        if errors:
            raise errors[0]
        return out


def ref_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Plain-loop float64 whitening of the whole batch (population variance, math.fsum)."""
    vals = [float(v) for v in x[mask].tolist()]
    if not vals:
        return torch.zeros_like(x, dtype=torch.float64)
    mean = math.fsum(vals) / len(vals)
    var = math.fsum((v - mean) ** 2 for v in vals) / len(vals)
    return torch.where(mask, (x.double() - mean) / math.sqrt(var + eps), 0.0)


def _split(t: torch.Tensor, bounds: list[int]) -> list[torch.Tensor]:
    return [t[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


@pytest.mark.parametrize(
    "bounds",
    [[0, 6, 12], [0, 1, 12], [0, 3, 7, 12]],
    ids=["halves", "a share of one empty row", "three ranks"],
)
@pytest.mark.parametrize("offset", [0.0, 1e8], ids=["centred", "mean 1e8"])
def test_whitening_the_shares_equals_whitening_the_whole(bounds, offset):
    """Row 0 of `random_batch` has no action token, so the share [0, 1) holds none: that rank
    still takes part in both reductions. With a mean of 1e8 and a std of ~1 the two-pass
    variance stays exact (var = E[x^2] - mean^2 would lose every digit: ulp(1e16) = 2)."""
    bt = random_batch(11)
    x = bt.values + offset
    want = ref_whiten(x, bt.action_mask)
    group = ThreadGroup(len(bounds) - 1)
    shares = list(zip(_split(x, bounds), _split(bt.action_mask, bounds), strict=True))
    got = group.run(lambda s, r: masked_whiten(s[0], s[1], reducer=r), shares)
    atol = 1e-9 if offset == 0 else 1e-6  # float64 sums of ~50 values of 1e8: ulp 1e-6
    torch.testing.assert_close(torch.cat(got), want, rtol=0, atol=atol)
    assert group.calls == [2] * group.size  # count and sum, then the centred squares
    torch.testing.assert_close(masked_whiten(x, bt.action_mask), want, rtol=0, atol=atol)
    if all(m.any() for _, m in shares):  # then a share whitened alone (what each DP rank did
        for (xs, ms), g in zip(shares, got, strict=True):  # before) is not the global result
            assert float((masked_whiten(xs, ms) - g).abs().max()) > 1e-3


def test_a_globally_empty_mask_gives_zeros_on_every_rank():
    bt = random_batch(2)
    mask = torch.zeros_like(bt.action_mask)
    group = ThreadGroup(2)
    shares = [(bt.values[:5], mask[:5]), (bt.values[5:], mask[5:])]
    got = group.run(lambda s, r: masked_whiten(s[0], s[1], reducer=r), shares)
    assert all(not g.any() for g in got)
    assert group.calls == [1, 1]  # both ranks stop after the same (first) reduction


def test_float32_advantages_keep_their_dtype():
    bt = random_batch(4)
    x = bt.values.float()
    out = masked_whiten(x, bt.action_mask, reducer=LOCAL_BATCH)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_whiten(x, bt.action_mask), rtol=0, atol=1e-6)


def _inputs(bt, rows: slice, groups: torch.Tensor | None, reducer) -> AdvantageInputs:
    return AdvantageInputs(
        node_rewards=bt.node_rewards[rows],
        node_index=bt.node_index[rows],
        action_mask=bt.action_mask[rows],
        values=bt.values[rows],
        truncated=bt.truncated[rows],
        bootstrap_values=bt.bootstrap_values[rows],
        group_ids=None if groups is None else groups[rows],
        reducer=reducer,
    )


@pytest.mark.parametrize("name", ["sao", "grpo"])
def test_algorithm_whitens_over_the_reducer(name):
    """`Algorithm.advantages` with whiten_advantages on two shares (GRPO: whole groups on each,
    as `keeps_groups_together` deals them) equals whitening the whole batch's advantages."""
    bt = random_batch(9)
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 4, 4])
    kw = {"grpo": GRPOConfig(group_size=3)} if name == "grpo" else {"sao": SAOConfig(gamma=0.9)}
    raw = registry.build(AlgorithmConfig(name=name, **kw))
    white = registry.build(AlgorithmConfig(name=name, whiten_advantages=True, **kw))
    whole = _inputs(bt, slice(None), groups, LOCAL_BATCH)
    want = ref_whiten(raw.advantages(whole).advantages, bt.action_mask)
    shares = [slice(0, 5), slice(5, 12)]  # a group boundary: groups 0-1 | 2-4
    group = ThreadGroup(2)
    got = group.run(
        lambda rows, r: white.advantages(_inputs(bt, rows, groups, r)).advantages, shares
    )
    torch.testing.assert_close(torch.cat(got), want, rtol=0, atol=1e-9)
    assert group.calls == [2, 2]
    # the unwhitened per-share advantages are the whole batch's (GAE, group statistics: local)
    parts = [raw.advantages(_inputs(bt, rows, groups, LOCAL_BATCH)).advantages for rows in shares]
    torch.testing.assert_close(torch.cat(parts), raw.advantages(whole).advantages)
