"""Tower of Hanoi puzzles: the move rules, the standard solution and the seeded start draws.

For horizon H a puzzle has n disks with 2^n - 1 >= H (the smallest such n plus a seeded
0..`extra_disks`) and a start state at optimal distance exactly H from the goal:

* ``start: canonical`` (default), ``goal: tower``: random start/target pegs and the state after
  k = 2^n - 1 - H moves of the standard optimal solution (on the optimal path). One puzzle per
  (n, start peg, target peg): 6 per disk count.
* ``start: random``, ``goal: tower``: a uniformly random legal state at distance exactly H from
  all disks on a random target peg (`hanoi_states.sample_state_at_distance`). There are exactly
  3 * 2^popcount(H) such puzzles per disk count (H = 50: 24; H = 500: 192), so this removes the
  "on the optimal path" restriction but cannot give many unseen puzzles.
* ``start: random``, ``goal: random``: a uniformly random *pair* (start, goal) of legal states
  at distance exactly H (`hanoi_states.sample_pair_at_distance`); the goal position is shown in
  the first observation. H = 50 with 6-7 disks: 53,568 puzzles; H = 500 with 9-10: 3,747,648.

``split: train | eval`` keeps only puzzles whose peg-relabelling class (`puzzle_class`) hashes to
that side (`eval_fraction` of the classes are "eval"), so held-out puzzles are disjoint from
training ones by construction, not only "in practice"; ``split: all`` (default) keeps every one.
``horizon_distribution: lognormal | pareto`` draws H per episode (median `horizon`, capped at
`max_horizon`): heavy-tailed episode lengths.

Moving from an empty peg or a larger disk onto a smaller one is *illegal* (`is_legal`).
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING

from sao_megatron.envs.hanoi_states import (
    Move,
    State,
    num_pairs_at_distance,
    num_states_at_distance,
    puzzle_class,
    puzzle_id,
    sample_pair_at_distance,
    sample_state_at_distance,
    split_of,
    tower,
)
from sao_megatron.envs.heavy_tail import sample_heavy_tailed

if TYPE_CHECKING:
    from sao_megatron.envs.hanoi_config import HanoiConfig

_MAX_SPLIT_TRIES = 10_000


def min_disks(horizon: int) -> int:
    """Smallest n with 2^n - 1 >= horizon."""
    return max(1, math.ceil(math.log2(horizon + 1)))


def state_after_optimal_moves(num_disks: int, k: int, src: int, dst: int) -> State:
    """Disk positions after the first k moves of the optimal solution moving n disks src -> dst.

    The optimal solution of n disks is: n-1 disks src -> aux (2^(n-1) - 1 moves), disk n
    src -> dst (1 move), n-1 disks aux -> dst. So after k moves disk n is still on src iff
    k < 2^(n-1); recurse on n-1 with the remaining k. O(n). Raises ValueError if k is out of range.
    """
    if not 0 <= k <= 2**num_disks - 1:
        raise ValueError(f"k={k} outside [0, 2^{num_disks} - 1]")
    pos = [0] * num_disks
    aux = 3 - src - dst
    for d in range(num_disks, 0, -1):
        half = 2 ** (d - 1)
        if k < half:
            pos[d - 1] = src
            src, dst, aux = src, aux, dst
        else:
            pos[d - 1] = dst
            k -= half
            src, dst, aux = aux, dst, src
    return tuple(pos)


def optimal_moves(num_disks: int, src: int, dst: int) -> list[Move]:
    """The standard optimal move list (2^n - 1 moves) for n disks from src to dst."""
    out: list[Move] = []

    def rec(n: int, s: int, t: int, a: int) -> None:
        if n == 0:
            return
        rec(n - 1, s, a, t)
        out.append((s, t))
        rec(n - 1, a, t, s)

    rec(num_disks, src, dst, 3 - src - dst)
    return out


def top_disk(state: State, peg: int) -> int | None:
    """Smallest disk on `peg` (the one on top), or None for an empty peg."""
    for d, p in enumerate(state, start=1):
        if p == peg:
            return d
    return None


def is_legal(state: State, move: Move) -> bool:
    """A move is legal if its source peg is non-empty and the disk is smaller than the top of
    the destination peg (or the destination is empty)."""
    src, dst = move
    if src == dst:
        return False
    d = top_disk(state, src)
    if d is None:
        return False
    top = top_disk(state, dst)
    return top is None or d < top


def apply_move(state: State, move: Move) -> State:
    """State after a legal move (asserted)."""
    assert is_legal(state, move), (state, move)
    d = top_disk(state, move[0])
    assert d is not None
    new = list(state)
    new[d - 1] = move[1]
    return tuple(new)


def legal_moves(state: State) -> list[Move]:
    """All legal moves, in a fixed order."""
    return [(s, t) for s in range(3) for t in range(3) if s != t and is_legal(state, (s, t))]


# ---------------------------------------------------------------------- seeded puzzles
def draw_puzzle(config: HanoiConfig, seed: int) -> tuple[int, State, State, int | None, int | None]:
    """(H, start, goal, start peg, target peg) of episode `seed` under `config` (the pegs are
    None where the mode has none). Deterministic in `seed`."""
    horizon = config.horizon
    if config.horizon_distribution != "fixed":
        cap = config.largest_horizon
        h_rng = random.Random(f"hanoi-horizon:{seed}")
        x = sample_heavy_tailed(
            h_rng, config.horizon_distribution, config.horizon, config.horizon_shape, cap
        )
        horizon = max(1, min(round(x), cap))
    rng = random.Random(f"hanoi:{seed}")
    for _ in range(_MAX_SPLIT_TRIES):
        n = min_disks(horizon) + rng.randint(0, config.extra_disks)
        src: int | None = None
        dst: int | None = None
        if config.start == "canonical":
            src, dst = rng.sample(range(3), 2)
            start = state_after_optimal_moves(n, 2**n - 1 - horizon, src, dst)
            goal = tower(n, dst)
        elif config.goal == "tower":
            dst = rng.randrange(3)
            start = sample_state_at_distance(n, horizon, dst, rng)
            goal = tower(n, dst)
        else:
            start, goal = sample_pair_at_distance(n, horizon, rng)
        if config.split == "all" or split_of(puzzle_class(start, goal), config.eval_fraction) == (
            config.split
        ):
            return horizon, start, goal, src, dst
    raise ValueError(
        f"hanoi.split={config.split!r}: no puzzle of horizon {horizon} in {_MAX_SPLIT_TRIES} "
        f"draws falls on that side (eval_fraction={config.eval_fraction}); this mode has too "
        "few puzzle classes to split (see num_distinct_puzzles): use start='random', "
        "goal='random'"
    )


def num_distinct_puzzles(config: HanoiConfig) -> dict[str, int]:
    """Exact numbers of distinct start puzzles (start, goal) a config can produce with
    split='all': {"puzzles": ..., "classes": ...} (classes: up to renaming the pegs; every class
    of a puzzle with H >= 1 has exactly 6 members, see tests). Needs a fixed horizon."""
    if config.horizon_distribution != "fixed":
        raise ValueError("num_distinct_puzzles: needs hanoi.horizon_distribution='fixed'")
    h = config.horizon
    disks = range(min_disks(h), min_disks(h) + config.extra_disks + 1)
    if config.start == "canonical":
        ids, classes = set(), set()
        for n in disks:
            for src in range(3):
                for dst in range(3):
                    if src != dst:
                        s, g = state_after_optimal_moves(n, 2**n - 1 - h, src, dst), tower(n, dst)
                        ids.add(puzzle_id(s, g))
                        classes.add(puzzle_class(s, g))
        return {"puzzles": len(ids), "classes": len(classes)}
    if config.goal == "tower":
        total = sum(3 * num_states_at_distance(n, h) for n in disks)
    else:
        total = sum(num_pairs_at_distance(n, h) for n in disks)
    return {"puzzles": total, "classes": total // 6}
