"""Exact Hanoi combinatorics (`hanoi_states`) against breadth-first search on every state."""

import collections
import itertools
import random
from collections import deque

import pytest

from sao_megatron.envs import hanoi_states as hs


def _neighbours(s):
    """Every state one legal move away (reference move generator, independent of hanoi.py)."""
    out = []
    for a, b in itertools.permutations(range(3), 2):
        on_a = [i for i, p in enumerate(s) if p == a]
        on_b = [i for i, p in enumerate(s) if p == b]
        if on_a and (not on_b or on_a[0] < on_b[0]):
            t = list(s)
            t[on_a[0]] = b
            out.append(tuple(t))
    return out


def _bfs(src):
    dist = {src: 0}
    queue = deque([src])
    while queue:
        s = queue.popleft()
        for t in _neighbours(s):
            if t not in dist:
                dist[t] = dist[s] + 1
                queue.append(t)
    return dist


def _states(n):
    return list(itertools.product(range(3), repeat=n))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_distance_between_and_gold_move_to_match_bfs_on_every_pair(n):
    pair_hist = collections.Counter()
    for a in _states(n):
        dist = _bfs(a)
        assert len(dist) == 3**n
        for b in _states(n):
            assert hs.distance_between(a, b) == dist[b] == hs.distance_between(b, a)
            mv = hs.gold_move_to(b, a)  # towards a: dist[] is the distance to a
            if a == b:
                assert mv is None
                continue
            pair_hist[dist[b]] += 1
            t = list(b)
            t[min(i for i, p in enumerate(b) if p == mv[0])] = mv[1]
            assert tuple(t) in _neighbours(b) and dist[tuple(t)] == dist[b] - 1
    for d, count in pair_hist.items():
        assert hs.num_pairs_at_distance(n, d) == count
    assert hs.num_pairs_at_distance(n, 2**n) == 0  # the diameter is 2^n - 1
    assert sum(pair_hist.values()) == 9**n - 3**n


def test_distance_between_on_five_disks_from_a_few_sources():
    rng = random.Random(0)
    for _ in range(6):
        a = tuple(rng.randrange(3) for _ in range(5))
        dist = _bfs(a)
        for b, d in dist.items():
            assert hs.distance_between(a, b) == d


@pytest.mark.parametrize("n", [1, 3, 6])
def test_states_per_distance_from_a_tower_are_two_to_the_popcount(n):
    for target in range(3):
        dist = _bfs((target,) * n)
        by_d = collections.defaultdict(set)
        for s, d in dist.items():
            by_d[d].add(s)
            assert hs.optimal_distance(s, target) == d
        assert set(by_d) == set(range(2**n))
        for d, states in by_d.items():
            assert len(states) == hs.num_states_at_distance(n, d) == 2 ** bin(d).count("1")
            assert hs.states_at_distance(n, d, target) == sorted(states)
    assert hs.num_states_at_distance(n, 2**n) == 0


def test_sample_state_at_distance_is_uniform_and_exact():
    n, d, target = 4, 11, 1  # 11 = 0b1011: 8 states
    rng = random.Random(5)
    draws = collections.Counter(hs.sample_state_at_distance(n, d, target, rng) for _ in range(8000))
    assert sorted(draws) == hs.states_at_distance(n, d, target)
    assert all(800 <= c <= 1200 for c in draws.values()), draws  # 1000 +- 7 sd
    for _ in range(200):  # large n, H = 500: still exact
        s = hs.sample_state_at_distance(10, 500, 2, rng)
        assert hs.optimal_distance(s, 2) == 500
    with pytest.raises(ValueError, match="outside"):
        hs.sample_state_at_distance(3, 8, 0, rng)


@pytest.mark.parametrize("n, d, count", [(3, 5, 126), (3, 2, 96), (4, 3, 408)])
def test_sample_pair_at_distance_is_uniform_over_all_pairs(n, d, count):
    """(3, 5): the top disk always differs; (3, 2), (4, 3): several largest differing disks."""
    pairs = {(a, b) for a in _states(n) for b in _states(n) if hs.distance_between(a, b) == d}
    assert len(pairs) == hs.num_pairs_at_distance(n, d) == count
    rng = random.Random(1)
    draws = collections.Counter(hs.sample_pair_at_distance(n, d, rng) for _ in range(count * 100))
    assert set(draws) == pairs
    assert all(50 <= c <= 150 for c in draws.values()), min(draws.values())  # 100 +- 5 sd
    chi2 = sum((c - 100) ** 2 / 100 for c in draws.values())
    assert chi2 < count + 6 * (2 * count) ** 0.5  # count - 1 degrees of freedom: mean + 6 sd


@pytest.mark.parametrize("n, d", [(6, 50), (7, 50), (9, 500), (10, 500), (10, 1)])
def test_sample_pair_at_distance_is_exact_for_the_config_sizes(n, d):
    rng = random.Random(n * 1000 + d)
    for _ in range(30):
        a, b = hs.sample_pair_at_distance(n, d, rng)
        assert len(a) == len(b) == n and hs.distance_between(a, b) == d


def test_puzzle_classes_have_six_members():
    members = collections.defaultdict(set)
    for a in _states(3):
        for b in _states(3):
            if a != b:
                members[hs.puzzle_class(a, b)].add(hs.puzzle_id(a, b))
    assert all(len(m) == 6 for m in members.values())
    assert len(members) == (27 * 27 - 27) // 6


def test_split_is_stable_and_close_to_the_fraction():
    keys = [f"k{i}" for i in range(4000)]
    sides = [hs.split_of(k, 0.25) for k in keys]
    assert 0.22 < sides.count("eval") / len(keys) < 0.28
    assert sides == [hs.split_of(k, 0.25) for k in keys]  # deterministic (sha256, not hash())
    assert hs.split_of("3:000>222", 0.5) == hs.split_of("3:000>222", 0.5)
