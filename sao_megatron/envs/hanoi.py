"""Tower of Hanoi as a long-horizon agent environment: exactly H optimal moves remain at reset.

Start state. For horizon H the environment picks n disks with 2^n - 1 >= H (the smallest such n
plus a seeded 0..`extra_disks`), random start/target pegs, and starts from the state reached after
k = 2^n - 1 - H moves of the standard optimal solution. That state lies on the optimal path, so
exactly H optimal moves remain (the optimal distance from any 3-peg state is computed below).

Action format (strict). One move per step, written ``X->Y`` with X and Y two different peg labels
(default ``A``, ``B``, ``C``), e.g. ``A->C``. Leading/trailing whitespace is ignored; anything else
(empty text, garbage, several moves or a whole solution, lower-case labels) is *malformed*.
Moving from an empty peg or a larger disk onto a smaller one is *illegal*.

Observation. The pegs, one line each, disks listed bottom to top::

    A: 5 4 1
    B: 3 2
    C:

The first observation also states the task and the action format. Later observations are the
pegs only (not the history).

Rewards. `success_reward` (1.0) when the target peg holds all disks within `max_steps`
(= ceil(`max_steps_factor` * H)); a malformed or illegal action gives `invalid_action_reward`
(0.0) and ends the episode (or, with `invalid_action_ends_episode=False`, leaves the state
unchanged and the episode continues); running out of steps truncates with reward 0. With the
defaults, reward 1 <=> reasoning-gym's `tower_of_hanoi` scorer gives 1.0 to the full move list
(the k prefix moves + the agent's moves), see `reasoning_gym_entry` / `reasoning_gym_answer`.

Dense reward (``reward_mode="progress"``): every legal move earns
``success_reward * (d_before - d_after) / H`` with d the optimal distance to the goal, so an
optimal move earns 1/H, a move away from the goal costs 1/H and the rewards of an episode sum to
the fraction of the initial distance removed (1 when solved). Malformed/illegal moves get
`invalid_action_reward` as above. Every step's info carries ``distance_to_goal``, ``progress``
(= 1 - distance/H) and ``success`` in both modes.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Any

from sao_megatron.envs.base import StepResult, config_from_options, register_env

Move = tuple[int, int]  # (from peg index, to peg index), indices 0..2
State = tuple[int, ...]  # state[d-1] = peg index of disk d (disk 1 is the smallest)


@dataclass(kw_only=True)
class HanoiConfig:
    """Options of the Tower of Hanoi environment.

    Fields:
        horizon: H, the number of optimal moves that remain at reset (>= 1).
        extra_disks: seeded 0..extra_disks disks added to the minimal n with 2^n - 1 >= H, so
            episodes of the same H differ in disk count (>= 0).
        max_disks: upper bound on n (2^n - 1 >= H must still be reachable); guards memory/time.
        max_steps_factor: step budget = ceil(max_steps_factor * H) (>= 1.0).
        success_reward: reward when solved within the budget.
        invalid_action_reward: reward for a malformed or illegal move.
        invalid_action_ends_episode: True: a malformed/illegal move ends the episode. False: it is
            a no-op that costs a step (reward `invalid_action_reward`) and the episode continues.
        peg_labels: three distinct single upper-case letters naming the pegs in text.
        reward_mode: "success" (sparse: `success_reward` on solving) or "progress" (dense: each
            legal move earns success_reward * (distance before - distance after) / H).
        instructions: "full" (the rules in words, ~70 tokens) or "short" (one terse line, for
            long-horizon runs where the first observation is in every windowed prompt).
    """

    horizon: int = 50
    extra_disks: int = 1
    max_disks: int = 20
    max_steps_factor: float = 1.0
    success_reward: float = 1.0
    invalid_action_reward: float = 0.0
    invalid_action_ends_episode: bool = True
    peg_labels: str = "ABC"
    reward_mode: str = "success"
    instructions: str = "full"

    def __post_init__(self) -> None:
        if not (isinstance(self.horizon, int) and self.horizon >= 1):
            raise ValueError(f"hanoi.horizon={self.horizon!r}: must be an integer >= 1")
        if not (isinstance(self.extra_disks, int) and self.extra_disks >= 0):
            raise ValueError(f"hanoi.extra_disks={self.extra_disks!r}: must be an integer >= 0")
        if min_disks(self.horizon) + self.extra_disks > self.max_disks:
            raise ValueError(
                f"hanoi.max_disks={self.max_disks}: horizon {self.horizon} needs "
                f"{min_disks(self.horizon)} disks plus extra_disks={self.extra_disks}; raise "
                "max_disks or lower horizon/extra_disks"
            )
        if not (self.max_steps_factor >= 1.0):
            raise ValueError(
                f"hanoi.max_steps_factor={self.max_steps_factor}: must be >= 1.0 (a budget below H "
                "makes the task unsolvable)"
            )
        if self.reward_mode not in ("success", "progress"):
            raise ValueError(f"hanoi.reward_mode={self.reward_mode!r}: use 'success' or 'progress'")
        if self.instructions not in ("full", "short"):
            raise ValueError(f"hanoi.instructions={self.instructions!r}: use 'full' or 'short'")
        labels = self.peg_labels
        if not (
            len(labels) == 3 and len(set(labels)) == 3 and labels.isalpha() and labels.isupper()
        ):
            raise ValueError(
                f"hanoi.peg_labels={labels!r}: give three distinct upper-case letters, e.g. 'ABC'"
            )


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


def _targets(state: State, target: int) -> list[int]:
    """t[d-1]: where disk d must go next on the optimal route (largest disk first)."""
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
    t = _targets(state, target)
    return sum(2 ** (d - 1) for d in range(1, len(state) + 1) if state[d - 1] != t[d - 1])


def gold_move(state: State, target: int) -> Move | None:
    """First move of an optimal solution from `state` (any legal state, on or off the optimal
    path) to all disks on `target`; None when already solved.

    It moves the smallest disk not on its goal peg (goals from `_targets`): all smaller disks sit
    on their goals, which is the third peg, so the move is legal.
    """
    t = _targets(state, target)
    for d in range(1, len(state) + 1):
        if state[d - 1] != t[d - 1]:
            return (state[d - 1], t[d - 1])
    return None


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


@register_env("hanoi")
class HanoiEnv:
    """Tower of Hanoi with exactly `horizon` optimal moves remaining; see the module docstring.

    Build with `make_env("hanoi", horizon=200)` or `HanoiEnv(HanoiConfig(...))`.
    """

    name = "hanoi"

    def __init__(self, config: HanoiConfig | None = None, **options: Any) -> None:
        if config is not None and options:
            raise TypeError("HanoiEnv: pass either a HanoiConfig or keyword options, not both")
        self.config = config or config_from_options(HanoiConfig, options, "hanoi")
        self.max_steps = math.ceil(self.config.max_steps_factor * self.config.horizon - 1e-9)
        self._labels = self.config.peg_labels
        self._move_re = re.compile(rf"\s*([{self._labels}])->([{self._labels}])\s*")
        self.state: State | None = None
        self.done = True

    # ------------------------------------------------------------------ episode
    def reset(self, seed: int) -> str:
        """Start the episode for `seed`; returns the instructions plus the pegs."""
        rng = random.Random(f"hanoi:{seed}")
        cfg = self.config
        self.seed = seed
        self.num_disks = min_disks(cfg.horizon) + rng.randint(0, cfg.extra_disks)
        self.start_peg, self.target_peg = rng.sample(range(3), 2)
        self.num_prefix_moves = 2**self.num_disks - 1 - cfg.horizon
        self.state = state_after_optimal_moves(
            self.num_disks, self.num_prefix_moves, self.start_peg, self.target_peg
        )
        self.moves: list[Move] = []
        self.distance = cfg.horizon  # the start state lies on the optimal path
        self.num_steps = 0
        self.done = False
        lab = self._labels
        if cfg.instructions == "short":
            return (
                f"Hanoi {self.num_disks} disks, goal peg {lab[self.target_peg]}, "
                f"one move X->Y per turn.\n" + self.render()
            )
        return (
            f"Tower of Hanoi: {self.num_disks} disks on pegs {lab[0]}, {lab[1]}, {lab[2]}. "
            f"Move all disks to peg {lab[self.target_peg]}. Disks are numbered by size (1 is the "
            "smallest) and listed bottom to top. Move one top disk per turn; never put a disk on "
            f"a smaller one. Reply with exactly one move, e.g. {lab[0]}->{lab[2]}.\n"
            + self.render()
        )

    def render(self) -> str:
        """The pegs, one line per peg, disks bottom to top (e.g. 'A: 5 4 1')."""
        assert self.state is not None, "call reset() first"
        lines = []
        for p in range(3):
            disks = [d for d in range(self.num_disks, 0, -1) if self.state[d - 1] == p]
            lines.append(f"{self._labels[p]}:" + "".join(f" {d}" for d in disks))
        return "\n".join(lines)

    def parse_action(self, action: str) -> Move | None:
        """The move named by `action` in the strict 'X->Y' format, or None if malformed."""
        m = self._move_re.fullmatch(action)
        if m is None or m.group(1) == m.group(2):
            return None
        return (self._labels.index(m.group(1)), self._labels.index(m.group(2)))

    def step(self, action: str) -> StepResult:
        """Apply one move. Never raises on bad text; raises RuntimeError if the episode is over."""
        if self.done or self.state is None:
            raise RuntimeError("HanoiEnv.step() called on a finished episode: call reset() first")
        cfg = self.config
        self.num_steps += 1
        move = self.parse_action(action) if isinstance(action, str) else None
        error = None
        if move is None:
            error = "malformed"
        elif not is_legal(self.state, move):
            error = "illegal"
        if error is not None:
            info = {"success": False, "error": error, "num_steps": self.num_steps}
            info |= self._distance_info(self.distance)
            reward = cfg.invalid_action_reward
            if cfg.invalid_action_ends_episode:
                self.done = True
                return StepResult(observation="", reward=reward, done=True, info=info)
            if self.num_steps >= self.max_steps:
                self.done = True
                return StepResult(
                    observation="", reward=reward, done=False, truncated=True, info=info
                )
            return StepResult(observation=self.render(), reward=reward, done=False, info=info)
        self.state = apply_move(self.state, move)
        self.moves.append(move)
        before, self.distance = self.distance, optimal_distance(self.state, self.target_peg)
        solved = self.distance == 0
        info = {"success": solved, "num_steps": self.num_steps} | self._distance_info(self.distance)
        if cfg.reward_mode == "progress":
            reward = cfg.success_reward * (before - self.distance) / cfg.horizon
        else:
            reward = cfg.success_reward if solved else 0.0
        if solved:
            self.done = True
            return StepResult(observation="", reward=reward, done=True, info=info)
        if self.num_steps >= self.max_steps:
            self.done = True
            return StepResult(observation="", reward=reward, done=False, truncated=True, info=info)
        return StepResult(observation=self.render(), reward=reward, done=False, info=info)

    def _distance_info(self, distance: int) -> dict[str, float]:
        return {"distance_to_goal": distance, "progress": 1.0 - distance / self.config.horizon}

    # ------------------------------------------------------------------ experts and checks
    def format_move(self, move: Move) -> str:
        """Action text of a move, e.g. (0, 2) -> 'A->C'."""
        return f"{self._labels[move[0]]}->{self._labels[move[1]]}"

    def gold_action(self) -> str:
        """The first move of an optimal solution from the current state (on or off path)."""
        if self.done or self.state is None:
            raise RuntimeError("HanoiEnv.gold_action(): no episode in progress")
        move = gold_move(self.state, self.target_peg)
        assert move is not None, "unsolved state has a gold move"
        return self.format_move(move)

    def noisy_gold_action(self, rng: random.Random, epsilon: float) -> tuple[str, bool]:
        """With probability `epsilon` a legal move that is not the gold move, else the gold move.

        Returns (action text, is_gold). After a wrong move, later calls recover along the optimal
        route from the new state (gold_move works from any state).
        """
        if self.done or self.state is None:
            raise RuntimeError("HanoiEnv.noisy_gold_action(): no episode in progress")
        gold = gold_move(self.state, self.target_peg)
        if rng.random() < epsilon:
            wrong = [m for m in legal_moves(self.state) if m != gold]
            return self.format_move(rng.choice(wrong)), False
        assert gold is not None
        return self.format_move(gold), True

    def remaining_optimal_moves(self) -> int:
        """Optimal distance from the current state to the goal."""
        assert self.state is not None, "call reset() first"
        return optimal_distance(self.state, self.target_peg)

    def reasoning_gym_entry(self) -> dict[str, Any]:
        """A reasoning-gym `tower_of_hanoi` entry for this episode's full puzzle (pegs 1..3)."""
        return {
            "metadata": {
                "num_disks": self.num_disks,
                "num_pegs": 3,
                "start_peg": self.start_peg + 1,
                "target_peg": self.target_peg + 1,
                "solution_length": 2**self.num_disks - 1,
            }
        }

    def reasoning_gym_answer(self, moves: list[Move] | None = None) -> str:
        """The k prefix moves plus `moves` (default: the agent's legal moves so far) in
        reasoning-gym's format 'Move disk X from Peg Y to Peg Z', one per line."""
        full = optimal_moves(self.num_disks, self.start_peg, self.target_peg)
        full = full[: self.num_prefix_moves] + list(self.moves if moves is None else moves)
        state = tuple([self.start_peg] * self.num_disks)
        lines = []
        for mv in full:
            disk = top_disk(state, mv[0])
            lines.append(f"Move disk {disk} from Peg {mv[0] + 1} to Peg {mv[1] + 1}")
            if not is_legal(state, mv):
                break  # the scorer rejects the answer at this line anyway
            state = apply_move(state, mv)
        return "\n".join(lines)
