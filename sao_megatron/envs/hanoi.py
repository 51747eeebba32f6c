"""Tower of Hanoi as a long-horizon agent environment: exactly H optimal moves remain at reset.

Puzzles. For horizon H the environment picks n disks with 2^n - 1 >= H (the smallest such n plus
a seeded 0..`extra_disks`) and a start state at optimal distance exactly H from the goal:

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

Action format (strict). One move per step, written ``X->Y`` with X and Y two different peg labels
(default ``A``, ``B``, ``C``), e.g. ``A->C``. Leading/trailing whitespace is ignored; anything else
(empty text, garbage, several moves or a whole solution, lower-case labels) is *malformed*
(with ``action_format: plan``: text without ``->`` may come before the move, see below).
Moving from an empty peg or a larger disk onto a smaller one is *illegal*.

Observation. The pegs, one line each, disks listed bottom to top::

    A: 5 4 1
    B: 3 2
    C:

or, with ``observation: disks``, the peg of every disk, largest first (the same state), after
the goal peg when the goal is a tower::

    Goal C, disks: 5 A 4 A 3 B 2 B 1 A

The goal peg is in every observation, next to the disks, because the plan below starts with it:
with the goal only in the task line, 200 demonstrations taught the 4-layer quickstart model to
copy it from the previous turn's plan instead, and its first move (no previous plan) failed
96-99% of the time (teacher-forced, 8 held-out puzzles).

Reasoning before the move (``action_format: plan``). The agent may write any text without
``->`` before its move, e.g. a plan; only the final ``X->Y`` is acted on. The gold action
(`gold_action`, the demonstrations) then writes, for every disk from the largest down, the disk,
its peg and its goal peg on the optimal route, and the move: for the state above and target C::

    5 A C 4 A B 3 B C 2 B A 1 A C A->C

The goal of the largest disk is the target peg; a disk's goal is the goal of the disk above it in
the list when that disk sits on its own goal, else the third peg (`hanoi_states.targets`); the
move takes the smallest disk not on its goal there. Each goal is a function of the two tokens
before it, so a small model can follow the recursion a token at a time (a one-token answer
needs the whole recursion in one forward pass), and the mismatched disks of the plan give the
remaining optimal distance (sum of 2^(d-1)), which a critic can read.

The first observation also states the task, the action format (and, with ``goal: random``, the
goal position). Later observations are the pegs only (not the history).

Rewards. `success_reward` (1.0) when the goal is reached within `max_steps`
(= ceil(`max_steps_factor` * H)); a malformed or illegal action gives `invalid_action_reward`
(0.0) and ends the episode (or, with `invalid_action_ends_episode=False`, leaves the state
unchanged and the episode continues); running out of steps truncates with reward 0 (or, with
``budget_end: terminate``, ends the episode as terminated: the budget is a rule of the task, so
the failed episode's value is 0 and GAE must not bootstrap from the critic). With the
defaults, reward 1 <=> reasoning-gym's `tower_of_hanoi` scorer gives 1.0 to the full move list
(the k prefix moves + the agent's moves), see `reasoning_gym_entry` / `reasoning_gym_answer`
(canonical start only).

Dense reward (``reward_mode="progress"``): every legal move earns
``success_reward * (d_before - d_after) / H`` with d the optimal distance to the goal, so an
optimal move earns 1/H, a move away from the goal costs 1/H and the rewards of an episode sum to
the fraction of the initial distance removed (1 when solved). Malformed/illegal moves get
`invalid_action_reward` as above.

Step info (both modes): ``distance_to_goal``, ``progress`` (= 1 - distance/H), ``success``,
``move`` (this step: "optimal" = the distance fell by one, "non_optimal" = legal but the distance
did not fall, "illegal", "malformed"), the episode's running counts ``num_optimal_moves``,
``num_non_optimal_moves``, ``num_illegal_moves``, ``num_malformed_actions`` (the last step's info
holds the episode totals), ``horizon`` (this episode's H) and ``puzzle_id``
(`hanoi_states.puzzle_id`, to check evaluation puzzles against training ones).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from sao_megatron.envs.base import StepResult, options_config, register_env
from sao_megatron.envs.hanoi_states import (  # noqa: F401  (re-exported: the public Hanoi API)
    Move,
    State,
    distance_between,
    gold_move,
    gold_move_to,
    num_pairs_at_distance,
    num_states_at_distance,
    optimal_distance,
    puzzle_class,
    puzzle_id,
    sample_pair_at_distance,
    sample_state_at_distance,
    split_of,
    states_at_distance,
    targets,
    tower,
)
from sao_megatron.envs.heavy_tail import HEAVY_TAILED, sample_heavy_tailed

_MAX_SPLIT_TRIES = 10_000


@dataclass(kw_only=True)
class HanoiConfig:
    """Options of the Tower of Hanoi environment.

    Fields:
        horizon: H, the number of optimal moves that remain at reset (>= 1); the median H when
            `horizon_distribution` is not "fixed".
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
        start: "canonical" (a state on the standard optimal path) or "random" (a uniformly
            random state at distance exactly H); see the module docstring.
        goal: "tower" (all disks on one peg) or "random" (an arbitrary position at distance
            exactly H from the start, shown in the first observation; needs start="random").
        split: "all", "train" or "eval": keep only puzzles whose class hashes to that side.
        eval_fraction: share of puzzle classes on the "eval" side, in (0, 1).
        horizon_distribution: "fixed", "lognormal" (median `horizon`, sigma `horizon_shape`) or
            "pareto" (median `horizon`, tail index `horizon_shape`): H drawn per episode.
        horizon_shape: the lognormal sigma or the Pareto alpha (> 0).
        max_horizon: cap on a drawn H (>= horizon); default 10 * horizon.
        budget_end: "truncate" (running out of steps is a truncation: GAE bootstraps from V) or
            "terminate" (it is a terminal failure with value 0: the budget is part of the task).
        show_moves_left: add "Moves left: k" (the remaining step budget) to every observation,
            so a critic that sees only a window of the episode can tell a lost position.
        observation: "pegs" (one line per peg, disks bottom to top) or "disks" (the peg of
            every disk, largest first, on one line); see the module docstring.
        action_format: "move" (exactly ``X->Y``) or "plan" (free text without ``->`` before
            the move; the gold action writes each disk's peg and goal first).
    """

    CONFIG_SECTION: ClassVar[str] = "hanoi"  # messages say hanoi.<field> (see envs.options)

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
    start: str = "canonical"
    goal: str = "tower"
    split: str = "all"
    eval_fraction: float = 0.5
    horizon_distribution: str = "fixed"
    horizon_shape: float = 1.0
    max_horizon: int | None = None
    budget_end: str = "truncate"
    show_moves_left: bool = False
    observation: str = "pegs"
    action_format: str = "move"

    def __post_init__(self) -> None:
        if not (isinstance(self.horizon, int) and self.horizon >= 1):
            raise ValueError(f"hanoi.horizon={self.horizon!r}: must be an integer >= 1")
        if not (isinstance(self.extra_disks, int) and self.extra_disks >= 0):
            raise ValueError(f"hanoi.extra_disks={self.extra_disks!r}: must be an integer >= 0")
        if self.horizon_distribution not in ("fixed", *HEAVY_TAILED):
            raise ValueError(
                f"hanoi.horizon_distribution={self.horizon_distribution!r}: use 'fixed', "
                "'lognormal' or 'pareto'"
            )
        if not (self.horizon_shape > 0):
            raise ValueError(f"hanoi.horizon_shape={self.horizon_shape}: must be > 0")
        if self.max_horizon is not None and not (
            isinstance(self.max_horizon, int) and self.max_horizon >= self.horizon
        ):
            raise ValueError(
                f"hanoi.max_horizon={self.max_horizon!r}: must be an integer >= hanoi.horizon "
                f"({self.horizon}), or null for the default"
            )
        if min_disks(self.largest_horizon) + self.extra_disks > self.max_disks:
            raise ValueError(
                f"hanoi.max_disks={self.max_disks}: horizon {self.largest_horizon} needs "
                f"{min_disks(self.largest_horizon)} disks plus extra_disks={self.extra_disks}; "
                "raise max_disks or lower horizon/max_horizon/extra_disks"
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
        if self.budget_end not in ("truncate", "terminate"):
            raise ValueError(f"hanoi.budget_end={self.budget_end!r}: use 'truncate' or 'terminate'")
        if self.observation not in ("pegs", "disks"):
            raise ValueError(f"hanoi.observation={self.observation!r}: use 'pegs' or 'disks'")
        if self.action_format not in ("move", "plan"):
            raise ValueError(f"hanoi.action_format={self.action_format!r}: use 'move' or 'plan'")
        if self.start not in ("canonical", "random"):
            raise ValueError(f"hanoi.start={self.start!r}: use 'canonical' or 'random'")
        if self.goal not in ("tower", "random"):
            raise ValueError(f"hanoi.goal={self.goal!r}: use 'tower' or 'random'")
        if self.goal == "random" and self.start != "random":
            raise ValueError("hanoi.goal='random' needs hanoi.start='random'")
        if self.split not in ("all", "train", "eval"):
            raise ValueError(f"hanoi.split={self.split!r}: use 'all', 'train' or 'eval'")
        if not (0.0 < self.eval_fraction < 1.0):
            raise ValueError(f"hanoi.eval_fraction={self.eval_fraction}: must be in (0, 1)")
        labels = self.peg_labels
        if not (
            len(labels) == 3 and len(set(labels)) == 3 and labels.isalpha() and labels.isupper()
        ):
            raise ValueError(
                f"hanoi.peg_labels={labels!r}: give three distinct upper-case letters, e.g. 'ABC'"
            )

    @property
    def largest_horizon(self) -> int:
        """The largest H an episode can have: `horizon` when fixed, else `max_horizon`
        (default 10 * horizon)."""
        if self.horizon_distribution == "fixed":
            return self.horizon
        return self.max_horizon if self.max_horizon is not None else 10 * self.horizon


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


@register_env("hanoi", options=HanoiConfig)
class HanoiEnv:
    """Tower of Hanoi with exactly `horizon` optimal moves remaining; see the module docstring.

    Build with `make_env("hanoi", horizon=200)` or `HanoiEnv(HanoiConfig(...))`.
    """

    name = "hanoi"

    def __init__(self, config: HanoiConfig | None = None, **options: Any) -> None:
        if config is not None and options:
            raise TypeError("HanoiEnv: pass either a HanoiConfig or keyword options, not both")
        self.config = config or options_config("hanoi", options)
        self.horizon = self.config.horizon
        self.max_steps = self._budget(self.config.largest_horizon)  # the largest; reset sets it
        self._labels = self.config.peg_labels
        move = rf"([{self._labels}])->([{self._labels}])"
        if self.config.action_format == "plan":  # any text without "->", then the move
            self._move_re = re.compile(rf"\s*(?:(?:(?!->).)*?\s)?{move}\s*", re.DOTALL)
        else:
            self._move_re = re.compile(rf"\s*{move}\s*")
        self.state: State | None = None
        self.done = True

    def _budget(self, horizon: int) -> int:
        return math.ceil(self.config.max_steps_factor * horizon - 1e-9)

    # ------------------------------------------------------------------ episode
    def draw_puzzle(self, seed: int) -> tuple[int, State, State, int | None, int | None]:
        """(H, start, goal, start peg, target peg) of episode `seed` without starting it (the
        pegs are None where the mode has none). Deterministic in `seed`."""
        cfg = self.config
        horizon = cfg.horizon
        if cfg.horizon_distribution != "fixed":
            cap = cfg.largest_horizon
            h_rng = random.Random(f"hanoi-horizon:{seed}")
            x = sample_heavy_tailed(
                h_rng, cfg.horizon_distribution, cfg.horizon, cfg.horizon_shape, cap
            )
            horizon = max(1, min(round(x), cap))
        rng = random.Random(f"hanoi:{seed}")
        for _ in range(_MAX_SPLIT_TRIES):
            n = min_disks(horizon) + rng.randint(0, cfg.extra_disks)
            src: int | None = None
            dst: int | None = None
            if cfg.start == "canonical":
                src, dst = rng.sample(range(3), 2)
                start = state_after_optimal_moves(n, 2**n - 1 - horizon, src, dst)
                goal = tower(n, dst)
            elif cfg.goal == "tower":
                dst = rng.randrange(3)
                start = sample_state_at_distance(n, horizon, dst, rng)
                goal = tower(n, dst)
            else:
                start, goal = sample_pair_at_distance(n, horizon, rng)
            if cfg.split == "all" or split_of(puzzle_class(start, goal), cfg.eval_fraction) == (
                cfg.split
            ):
                return horizon, start, goal, src, dst
        raise ValueError(
            f"hanoi.split={cfg.split!r}: no puzzle of horizon {horizon} in {_MAX_SPLIT_TRIES} "
            f"draws falls on that side (eval_fraction={cfg.eval_fraction}); this mode has too "
            "few puzzle classes to split (see num_distinct_puzzles): use start='random', "
            "goal='random'"
        )

    def reset(self, seed: int) -> str:
        """Start the episode for `seed`; returns the instructions plus the pegs."""
        cfg = self.config
        self.seed = seed
        self.horizon, self.state, self.goal, self.start_peg, self.target_peg = self.draw_puzzle(
            seed
        )
        self.num_disks = len(self.state)
        self.max_steps = self._budget(self.horizon)
        self.num_prefix_moves = (
            2**self.num_disks - 1 - self.horizon if cfg.start == "canonical" else None
        )
        self.puzzle_id = puzzle_id(self.state, self.goal)
        self.moves: list[Move] = []
        self.distance = self.remaining_optimal_moves()
        assert self.distance == self.horizon, (self.distance, self.horizon)
        self.num_steps = 0
        self.counts = dict.fromkeys(_COUNT_KEYS.values(), 0)
        self.done = False
        lab = self._labels
        if cfg.goal == "random":
            if cfg.instructions == "short":
                head = f"Hanoi {self.num_disks} disks, reach the goal, one move X->Y per turn."
            else:
                head = (
                    f"Tower of Hanoi: {self.num_disks} disks on pegs {lab[0]}, {lab[1]}, "
                    f"{lab[2]}. Rearrange them into the goal position. Disks are numbered by size "
                    "(1 is the smallest) and listed bottom to top. Move one top disk per turn; "
                    "never put a disk on a smaller one. Reply with exactly one move, e.g. "
                    f"{lab[0]}->{lab[2]}."
                )
            return f"{head}\nGoal:\n{self.render(self.goal)}\nNow:\n{self._observation()}"
        plan = cfg.action_format == "plan"
        if cfg.instructions == "short":
            return (
                f"Hanoi {self.num_disks} disks, goal peg {lab[self.target_peg]}, "
                f"{'plan then ' if plan else ''}one move X->Y per turn.\n" + self._observation()
            )
        return (
            f"Tower of Hanoi: {self.num_disks} disks on pegs {lab[0]}, {lab[1]}, {lab[2]}. "
            f"Move all disks to peg {lab[self.target_peg]}. Disks are numbered by size (1 is the "
            "smallest) and listed bottom to top. Move one top disk per turn; never put a disk on "
            f"a smaller one. Reply with {'a plan, then ' if plan else ''}exactly one move, e.g. "
            f"{lab[0]}->{lab[2]}.\n" + self._observation()
        )

    def render(self, state: State | None = None) -> str:
        """The pegs of `state` (default: the current one), one line per peg, disks bottom to top
        (e.g. 'A: 5 4 1'); with ``observation: disks`` the peg of each disk, largest first
        (e.g. 'Disks: 5 A 4 A 3 B 2 B 1 A')."""
        state = self.state if state is None else state
        assert state is not None, "call reset() first"
        if self.config.observation == "disks":
            n = len(state)
            return "Disks:" + "".join(f" {d} {self._labels[state[d - 1]]}" for d in range(n, 0, -1))
        lines = []
        for p in range(3):
            disks = [d for d in range(len(state), 0, -1) if state[d - 1] == p]
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
            info = {"success": False, "error": error} | self._step_info(error)
            reward = cfg.invalid_action_reward
            if cfg.invalid_action_ends_episode:
                self.done = True
                return StepResult(observation="", reward=reward, done=True, info=info)
            if self.num_steps >= self.max_steps:
                return self._out_of_budget(reward, info)
            return StepResult(observation=self._observation(), reward=reward, done=False, info=info)
        self.state = apply_move(self.state, move)
        self.moves.append(move)
        before, self.distance = self.distance, self.remaining_optimal_moves()
        solved = self.distance == 0
        kind = "optimal" if self.distance < before else "non_optimal"
        info = {"success": solved} | self._step_info(kind)
        if cfg.reward_mode == "progress":
            reward = cfg.success_reward * (before - self.distance) / self.horizon
        else:
            reward = cfg.success_reward if solved else 0.0
        if solved:
            self.done = True
            return StepResult(observation="", reward=reward, done=True, info=info)
        if self.num_steps >= self.max_steps:
            return self._out_of_budget(reward, info)
        return StepResult(observation=self._observation(), reward=reward, done=False, info=info)

    def _out_of_budget(self, reward: float, info: dict[str, Any]) -> StepResult:
        """The step budget is spent without solving: truncated or terminated (`budget_end`)."""
        self.done = True
        end = self.config.budget_end == "terminate"
        return StepResult(observation="", reward=reward, done=end, truncated=not end, info=info)

    def _observation(self) -> str:
        """The pegs (with ``observation: disks`` and a tower goal, after the goal peg:
        'Goal C, disks: ...'), plus the remaining budget with `show_moves_left`."""
        state = self.render()
        if self.config.observation == "disks" and self.config.goal == "tower":
            state = f"Goal {self._labels[self.target_peg]}, d" + state[1:]
        if self.config.show_moves_left:
            return f"Moves left: {self.max_steps - self.num_steps}\n" + state
        return state

    def _step_info(self, kind: str) -> dict[str, Any]:
        """Facts of this step: its kind, the running counts, distance/progress and identity."""
        self.counts[_COUNT_KEYS[kind]] += 1
        return {
            "move": kind,
            "num_steps": self.num_steps,
            **self.counts,
            "distance_to_goal": self.distance,
            "progress": 1.0 - self.distance / self.horizon,
            "horizon": self.horizon,
            "puzzle_id": self.puzzle_id,
        }

    # ------------------------------------------------------------------ experts and checks
    def format_move(self, move: Move) -> str:
        """Action text of a move, e.g. (0, 2) -> 'A->C'."""
        return f"{self._labels[move[0]]}->{self._labels[move[1]]}"

    def _gold(self) -> Move | None:
        assert self.state is not None
        if self.config.goal == "tower":
            return gold_move(self.state, self.target_peg)
        return gold_move_to(self.state, self.goal)

    def plan_text(self) -> str:
        """The gold plan of ``action_format: plan`` for the current state (goal: tower): for
        every disk d from the largest down, 'd peg goal' (`hanoi_states.targets`), e.g.
        '3 B C 2 A A 1 A A'."""
        assert self.state is not None, "call reset() first"
        if self.config.goal != "tower":
            raise ValueError(
                "hanoi.action_format='plan' writes the goals of the route to a tower; with "
                "hanoi.goal='random' use action_format='move'"
            )
        t = targets(self.state, self.target_peg)
        lab, n = self._labels, len(self.state)
        return " ".join(f"{d} {lab[self.state[d - 1]]} {lab[t[d - 1]]}" for d in range(n, 0, -1))

    def _action_text(self, move: Move) -> str:
        """The action for `move`: the move, after the gold plan with ``action_format: plan``."""
        if self.config.action_format == "plan":
            return f"{self.plan_text()} {self.format_move(move)}"
        return self.format_move(move)

    def gold_action(self) -> str:
        """The first move of an optimal solution from the current state (on or off path),
        after the gold plan with ``action_format: plan``."""
        if self.done or self.state is None:
            raise RuntimeError("HanoiEnv.gold_action(): no episode in progress")
        move = self._gold()
        assert move is not None, "unsolved state has a gold move"
        return self._action_text(move)

    def noisy_gold_action(self, rng: random.Random, epsilon: float) -> tuple[str, bool]:
        """With probability `epsilon` a legal move that is not the gold move, else the gold move.

        Returns (action text, is_gold); with ``action_format: plan`` a wrong move follows the
        right plan (the plan is context, the move is the error). After a wrong move, later calls
        recover along the optimal route from the new state (the gold solver works from any
        state).
        """
        if self.done or self.state is None:
            raise RuntimeError("HanoiEnv.noisy_gold_action(): no episode in progress")
        gold = self._gold()
        if rng.random() < epsilon:
            wrong = [m for m in legal_moves(self.state) if m != gold]
            return self._action_text(rng.choice(wrong)), False
        assert gold is not None
        return self._action_text(gold), True

    def remaining_optimal_moves(self) -> int:
        """Optimal distance from the current state to the goal."""
        assert self.state is not None, "call reset() first"
        if self.config.goal == "tower":
            return optimal_distance(self.state, self.target_peg)
        return distance_between(self.state, self.goal)

    def _check_canonical(self, what: str) -> None:
        if self.config.start != "canonical":
            raise ValueError(
                f"HanoiEnv.{what}() needs hanoi.start='canonical' (reasoning-gym puzzles start "
                f"from a full tower); this env has start={self.config.start!r}"
            )

    def reasoning_gym_entry(self) -> dict[str, Any]:
        """A reasoning-gym `tower_of_hanoi` entry for this episode's full puzzle (pegs 1..3)."""
        self._check_canonical("reasoning_gym_entry")
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
        self._check_canonical("reasoning_gym_answer")
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


_COUNT_KEYS = {
    "optimal": "num_optimal_moves",
    "non_optimal": "num_non_optimal_moves",
    "illegal": "num_illegal_moves",
    "malformed": "num_malformed_actions",
}


# ---------------------------------------------------------------------- puzzle counts, overlap
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


def puzzle_overlap(
    train: dict[str, Any] | HanoiConfig,
    train_seeds: list[int],
    held_out: dict[str, Any] | HanoiConfig,
    held_out_seeds: list[int],
) -> dict[str, float]:
    """How many held-out puzzles were also training puzzles.

    `train` / `held_out`: the two environments' options (or configs); the seeds are the episode
    seeds each stream uses. Returns counts of distinct puzzles on each side and of the held-out
    episodes whose puzzle id (exact) or class (up to peg renaming) occurs in training, with the
    fractions of held-out episodes they make up.
    """

    def ids(cfg: dict[str, Any] | HanoiConfig, seeds: list[int]) -> list[tuple[str, str]]:
        env = HanoiEnv(cfg) if isinstance(cfg, HanoiConfig) else HanoiEnv(**cfg)
        out = []
        for s in seeds:
            _, start, goal, _, _ = env.draw_puzzle(s)
            out.append((puzzle_id(start, goal), puzzle_class(start, goal)))
        return out

    tr, ho = ids(train, train_seeds), ids(held_out, held_out_seeds)
    tr_ids, tr_classes = {i for i, _ in tr}, {c for _, c in tr}
    seen_id = sum(i in tr_ids for i, _ in ho)
    seen_class = sum(c in tr_classes for _, c in ho)
    n = max(len(ho), 1)
    return {
        "train_puzzles": float(len(tr_ids)),
        "held_out_puzzles": float(len({i for i, _ in ho})),
        "held_out_episodes": float(len(ho)),
        "held_out_episodes_seen_exact": float(seen_id),
        "held_out_episodes_seen_class": float(seen_class),
        "fraction_seen_exact": seen_id / n,
        "fraction_seen_class": seen_class / n,
    }


def move_error_rates(infos: list[dict[str, Any]]) -> dict[str, float]:
    """Per-move error rates pooled over episodes, from each episode's final step info.

    Returns {} when no info carries the move counts (not a Hanoi episode), else
    ``illegal_move_rate`` = (illegal + malformed) / moves played, ``non_optimal_move_rate`` =
    legal non-optimal / moves played, ``malformed_action_rate`` = malformed / moves played and
    ``num_moves`` (moves played = every step, bad ones included). Pooling (total errors / total
    moves) is the maximum-likelihood per-move hazard when errors are independent per move; with
    ``invalid_action_ends_episode`` each episode has at most one illegal/malformed step, so the
    rate is 1 / (mean moves before the first error).
    """
    rows = [i for i in infos if "num_optimal_moves" in i]
    if not rows:
        return {}
    moves = sum(int(i["num_steps"]) for i in rows)
    bad = sum(int(i["num_illegal_moves"]) + int(i["num_malformed_actions"]) for i in rows)
    return {
        "illegal_move_rate": bad / max(moves, 1),
        "non_optimal_move_rate": sum(int(i["num_non_optimal_moves"]) for i in rows) / max(moves, 1),
        "malformed_action_rate": sum(int(i["num_malformed_actions"]) for i in rows) / max(moves, 1),
        "num_moves": float(moves),
    }
