"""Exact combinatorics of 3-peg Tower of Hanoi states: distances, counts and uniform sampling.

A state of n disks is a tuple ``state[d-1] = peg of disk d`` (disk 1 is the smallest; pegs
0..2); every one of the 3^n tuples is a legal state (disks on a peg are stacked by size).

Distance to a perfect tower ("all disks on peg t"). Walk the disks largest first with a current
goal g (initially t): a disk on g costs nothing and leaves g unchanged; a disk on another peg p
costs 2^(d-1) moves and makes the third peg 3 - p - g the goal of the smaller disks. So the
distance, written in binary, has bit d-1 set exactly when disk d is off its goal, and each set
bit has two choices of peg: **exactly 2^popcount(D) states of n disks lie at distance D from a
given perfect tower (D < 2^n), whatever n** — the disks above D's top bit must sit on the
target. Counting by dynamic programming over disks collapses to this product; sampling is
digit by digit (largest disk first: bit 0 -> on the goal, bit 1 -> one of the two other pegs,
each with probability 1/2), exact and O(n). (Hinz et al., "The Tower of Hanoi — Myths and
Maths", 2nd ed. 2018, ch. 2: the perfect-to-regular distance is this binary number.)

Distance between two arbitrary states a, b (Hinz 1992, "Shortest paths between regular states
of the Tower of Hanoi", Inform. Sci. 63): disks above the largest disk m where a and b differ
never move. Disk m goes from s = a[m-1] to g = b[m-1], r the third peg, either once (the
m-1 smaller disks gather on r: D(a', r) + 1 + D(b', r)) or twice via r (they gather on g, m
goes to r, they move as a tower g -> s, m goes to g: D(a', g) + 1 + (2^(m-1) - 1) + 1 +
D(b', s)), with a', b' the states of the smaller disks and D the perfect-tower distance above;
the optimum is the smaller of the two (never more than two moves of m). Tested against
breadth-first search on every pair of states for n <= 4.

Counting pairs at distance H exactly, for the random-goal mode, enumerates the 3^(m-1)
sub-states once per m (<= 19,683 for n = 10) and counts the matching partners through
cumulative tables (numpy), O(3^(m-1) + 4^(m-1)) per m instead of 9^(m-1); sampling draws
(m, pegs, a', b') with exactly those weights (integers, so the draw is exactly uniform).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import random

import numpy as np

Move = tuple[int, int]  # (from peg index, to peg index), indices 0..2
State = tuple[int, ...]  # state[d-1] = peg index of disk d (disk 1 is the smallest)

PEG_PERMUTATIONS: tuple[tuple[int, ...], ...] = tuple(itertools.permutations(range(3)))


# ---------------------------------------------------------------------- perfect-tower goal
def tower(num_disks: int, peg: int) -> State:
    """All `num_disks` disks on `peg`."""
    return (peg,) * num_disks


def targets(state: State, target: int) -> list[int]:
    """t[d-1]: the goal peg of disk d on the optimal route from `state` to all disks on `target`.

    Largest disk first: t[n-1] = target; t[d-2] = t[d-1] when disk d is on t[d-1], else the third
    peg 3 - state[d-1] - t[d-1] (disk d must move, so the smaller disks gather on the third peg).
    Pegs are 0..2; O(n). Source: the standard recursion, e.g. Hinz et al., "The Tower of Hanoi -
    Myths and Maths" (2013), ch. 2.
    """
    t = [0] * len(state)
    cur = target
    for d in range(len(state), 0, -1):
        t[d - 1] = cur
        if state[d - 1] != cur:
            cur = 3 - state[d - 1] - cur
    return t


def optimal_distance(state: State, target: int) -> int:
    """Minimum number of moves from any legal 3-peg state to all disks on `target`.

    Disk d (largest first) that is not on its current goal costs 2^(d-1) moves: the smaller disks
    must first gather on the third peg; the goal of disk d-1 then becomes that third peg.
    """
    t = targets(state, target)
    return sum(2 ** (d - 1) for d in range(1, len(state) + 1) if state[d - 1] != t[d - 1])


def gold_move(state: State, target: int) -> Move | None:
    """First move of an optimal solution from `state` (any legal state, on or off the optimal
    path) to all disks on `target`; None when already solved.

    It moves the smallest disk not on its goal peg (goals from `targets`): all smaller disks sit
    on their goals, which is the third peg, so the move is legal.
    """
    t = targets(state, target)
    for d in range(1, len(state) + 1):
        if state[d - 1] != t[d - 1]:
            return (state[d - 1], t[d - 1])
    return None


def num_states_at_distance(num_disks: int, distance: int) -> int:
    """Exact number of n-disk states at optimal distance `distance` from one perfect tower.

    2^popcount(distance) for 0 <= distance < 2^n, else 0 (see the module docstring).
    """
    if not 0 <= distance < 2**num_disks:
        return 0
    return 2 ** bin(distance).count("1")


def sample_state_at_distance(
    num_disks: int, distance: int, target: int, rng: random.Random
) -> State:
    """A uniformly random n-disk state at optimal distance exactly `distance` from the tower on
    `target`: largest disk first, bit d-1 of `distance` clear -> disk d on the current goal, set
    -> one of the two other pegs with probability 1/2 each (which makes the third peg the next
    goal). Every state at that distance is one such choice sequence, so the draw is uniform.

    Raises ValueError if distance is outside [0, 2^n - 1]."""
    if not 0 <= distance < 2**num_disks:
        raise ValueError(f"distance {distance} outside [0, 2^{num_disks} - 1]")
    pos = [0] * num_disks
    goal = target
    for d in range(num_disks, 0, -1):
        if (distance >> (d - 1)) & 1:
            p = rng.choice([q for q in range(3) if q != goal])
            pos[d - 1] = p
            goal = 3 - p - goal
        else:
            pos[d - 1] = goal
    return tuple(pos)


def states_at_distance(num_disks: int, distance: int, target: int) -> list[State]:
    """Every n-disk state at optimal distance `distance` from the tower on `target` (the
    2^popcount(distance) choice sequences of `sample_state_at_distance`), sorted."""
    out: list[State] = []

    def rec(d: int, goal: int, pos: list[int]) -> None:
        if d == 0:
            out.append(tuple(reversed(pos)))
            return
        if (distance >> (d - 1)) & 1:
            for p in range(3):
                if p != goal:
                    rec(d - 1, 3 - p - goal, pos + [p])
        else:
            rec(d - 1, goal, pos + [goal])

    if 0 <= distance < 2**num_disks:
        rec(num_disks, target, [])
    return sorted(out)


# ---------------------------------------------------------------------- arbitrary goal
def _split(a: State, b: State) -> int:
    """The largest disk m where a and b differ (0 when a == b)."""
    for m in range(len(a), 0, -1):
        if a[m - 1] != b[m - 1]:
            return m
    return 0


def _routes(a: State, b: State, m: int) -> tuple[int, int]:
    """(moves via one move of disk m, moves via two moves of disk m); see the module docstring."""
    s, g = a[m - 1], b[m - 1]
    r = 3 - s - g
    sa, sb = a[: m - 1], b[: m - 1]
    once = optimal_distance(sa, r) + 1 + optimal_distance(sb, r)
    twice = optimal_distance(sa, g) + 2 ** (m - 1) + 1 + optimal_distance(sb, s)
    return once, twice


def distance_between(a: State, b: State) -> int:
    """Minimum number of moves from state `a` to state `b` (same disk count), O(n)."""
    if len(a) != len(b):
        raise ValueError(f"states of {len(a)} and {len(b)} disks")
    m = _split(a, b)
    return 0 if m == 0 else min(_routes(a, b, m))


def gold_move_to(state: State, goal: State) -> Move | None:
    """First move of an optimal solution from `state` to the arbitrary state `goal`; None when
    equal. Follows the cheaper route of `distance_between` (ties: one move of disk m): first
    gather the smaller disks (gold_move towards the route's peg), then move disk m."""
    m = _split(state, goal)
    if m == 0:
        return None
    once, twice = _routes(state, goal, m)
    s, g = state[m - 1], goal[m - 1]
    via = 3 - s - g if once <= twice else g  # where the smaller disks gather
    dest = g if once <= twice else 3 - s - g  # where disk m goes next
    mv = gold_move(state[: m - 1], via)
    return mv if mv is not None else (s, dest)


def _perfect_distances(num_disks: int) -> np.ndarray:
    """[3^n, 3] int64: D(x, t) for every n-disk state x (index = base-3 digits, disk 1 least
    significant) and every tower peg t."""
    out = np.zeros((3**num_disks, 3), dtype=np.int64)
    for i, x in enumerate(itertools.product(range(3), repeat=num_disks)):
        x = tuple(reversed(x))  # product varies the last digit fastest: make disk 1 fastest
        for t in range(3):
            out[i, t] = optimal_distance(x, t)
    return out


@functools.lru_cache(maxsize=64)
def _sub_tables(k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For k smaller disks with s=0, g=1, r=2: (dist [3^k, 3], T_once, T_twice) where
    T_once[u, v] = #{y: D(y, r) = u and D(y, s) >= v} and T_twice[v, u] = #{y: D(y, s) = v and
    D(y, r) > u}, u, v in [0, 2^k] (index 2^k = "none")."""
    dist = _perfect_distances(k)
    size = 2**k + 1
    hist = np.zeros((size, size), dtype=np.int64)
    np.add.at(hist, (dist[:, 2], dist[:, 0]), 1)  # hist[D(y,r), D(y,s)]
    t_once = np.cumsum(hist[:, ::-1], axis=1)[:, ::-1]  # suffix sums over D(y, s) >= v
    strict = np.zeros_like(hist)
    strict[:-1] = np.cumsum(hist[::-1], axis=0)[::-1][1:]  # #{D(y, r) > u}
    t_twice = strict.T.copy()  # [v, u]
    return dist, t_once, t_twice


@functools.lru_cache(maxsize=256)
def _partner_counts(m: int, distance: int) -> tuple[np.ndarray, list[int]]:
    """For pairs whose largest differing disk is m, moved 0 -> 1: per sub-state x of the m-1
    smaller disks of the start, the number of goal sub-states y with distance exactly
    `distance` ([3^(m-1)] int64), and its cumulative sums (python ints, for exact sampling)."""
    k = m - 1
    dist, t_once, t_twice = _sub_tables(k)
    size = 2**k + 1
    c = 2**k + 1  # the twice-route's fixed cost: 2^(m-1) - 1 tower moves + 2 moves of disk m
    # once = D(x, r) + D(y, r) + 1 == H and twice = D(x, g) + D(y, s) + c >= H
    u = distance - 1 - dist[:, 2]
    v = np.clip(distance - c - dist[:, 1], 0, None)
    ok = (u >= 0) & (u < size - 1) & (v < size)
    counts = np.where(ok, t_once[np.clip(u, 0, size - 1), np.clip(v, 0, size - 1)], 0)
    # twice == H and once > H: #{y: D(y, s) = v2, D(y, r) > H - 1 - D(x, r)}
    v2 = distance - c - dist[:, 1]
    u2 = distance - 1 - dist[:, 2]
    ok2 = (v2 >= 0) & (v2 < size - 1)
    hist_s = np.bincount(dist[:, 0], minlength=size)  # u2 < 0: every y has once > H
    twice = np.where(
        u2 >= 0,
        t_twice[np.clip(v2, 0, size - 1), np.clip(u2, 0, size - 1)],
        hist_s[np.clip(v2, 0, size - 1)],
    )
    counts = counts + np.where(ok2, twice, 0)
    return counts, list(itertools.accumulate(int(x) for x in counts))


def num_pairs_at_distance(num_disks: int, distance: int) -> int:
    """Exact number of ordered pairs (start, goal) of n-disk states at optimal distance
    `distance` (>= 1): sum over the largest differing disk m of 3^(n-m) (the identical larger
    disks) x 6 (pegs of disk m) x the pairs of smaller sub-states at that distance."""
    if distance < 1:
        raise ValueError(f"distance={distance}: must be >= 1")
    total = 0
    for m in range(1, num_disks + 1):
        if distance <= 2**m - 1:  # distances with top differing disk m are < 2^m
            total += 3 ** (num_disks - m) * 6 * _partner_counts(m, distance)[1][-1]
    return total


def sample_pair_at_distance(
    num_disks: int, distance: int, rng: random.Random
) -> tuple[State, State]:
    """A uniformly random ordered pair (start, goal) of n-disk states at optimal distance
    exactly `distance` (exact: integer weights). Raises ValueError if there is none."""
    ms = [m for m in range(1, num_disks + 1) if distance <= 2**m - 1]
    weights = [3 ** (num_disks - m) * 6 * _partner_counts(m, distance)[1][-1] for m in ms]
    total = sum(weights)
    if total == 0:
        raise ValueError(f"no pair of {num_disks}-disk states at distance {distance}")
    pick = rng.randrange(total)
    m = ms[bisect.bisect_right(list(itertools.accumulate(weights)), pick)]
    counts, cum = _partner_counts(m, distance)
    xi = bisect.bisect_right(cum, rng.randrange(cum[-1]))
    k = m - 1
    dist = _sub_tables(k)[0]
    once = dist[xi, 2] + dist[:, 2] + 1
    twice = dist[xi, 1] + dist[:, 0] + 2**k + 1
    ys = np.flatnonzero(np.minimum(once, twice) == distance)
    assert len(ys) == counts[xi], (len(ys), counts[xi])
    yi = int(ys[rng.randrange(len(ys))])
    x = _digits(xi, k)
    y = _digits(yi, k)
    s, g = rng.choice(list(itertools.permutations(range(3), 2)))
    # relabel the canonical pegs (s=0, g=1, r=2) to the drawn ones
    lab = (s, g, 3 - s - g)
    above = tuple(rng.randrange(3) for _ in range(num_disks - m))
    a = tuple(lab[p] for p in x) + (s,) + above
    b = tuple(lab[p] for p in y) + (g,) + above
    return a, b


def _digits(index: int, k: int) -> State:
    """The k-disk state with base-3 index `index` (disk 1 = least significant digit)."""
    out = []
    for _ in range(k):
        index, p = divmod(index, 3)
        out.append(p)
    return tuple(out)


# ---------------------------------------------------------------------- puzzle identity
def puzzle_id(start: State, goal: State) -> str:
    """Exact identity of a puzzle, e.g. '5:01220>22222' (disk count, start pegs, goal pegs;
    disk 1 first). Two episodes with the same id are the same puzzle, letter for letter."""
    return f"{len(start)}:{''.join(map(str, start))}>{''.join(map(str, goal))}"


def puzzle_class(start: State, goal: State) -> str:
    """The puzzle up to renaming the pegs: the smallest `puzzle_id` over the 6 peg
    permutations. A relabelled copy of a training puzzle has the same class."""
    return min(
        puzzle_id(tuple(p[x] for x in start), tuple(p[x] for x in goal)) for p in PEG_PERMUTATIONS
    )


def split_of(key: str, eval_fraction: float) -> str:
    """'eval' or 'train' for a puzzle key by a stable hash (sha256, same in every process):
    the key's hash, as a fraction of 2^64, below `eval_fraction` -> 'eval'."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return "eval" if h / 2**64 < eval_fraction else "train"
