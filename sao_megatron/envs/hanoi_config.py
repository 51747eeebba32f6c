"""The options of the Tower of Hanoi environment (`HanoiConfig`), checked at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from sao_megatron.envs.hanoi_puzzles import min_disks
from sao_megatron.envs.heavy_tail import HEAVY_TAILED


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
            random state at distance exactly H); see `envs/hanoi_puzzles.py`.
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
            every disk, largest first, on one line); see `envs/hanoi_text.py`.
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
