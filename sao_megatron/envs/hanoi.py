"""Tower of Hanoi as a long-horizon agent environment: exactly H optimal moves remain at reset.

The environment (`HanoiEnv`) and its episode statistics. Its parts live in their own modules,
all re-exported here: the options (`hanoi_config.HanoiConfig`), the puzzles, move rules and
seeded start draws (`hanoi_puzzles`: canonical or random start, tower or random goal, the
train/eval split, heavy-tailed horizons), the text formats (`hanoi_text`: observations
``pegs``/``disks``, the strict ``X->Y`` action, ``action_format: plan``) and the exact
combinatorics (`hanoi_states`: distances, counts, uniform sampling, puzzle ids).

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
from typing import Any

from sao_megatron.envs.base import StepResult, options_config, register_env
from sao_megatron.envs.hanoi_config import HanoiConfig
from sao_megatron.envs.hanoi_puzzles import (  # noqa: F401  (re-exported: the public Hanoi API)
    apply_move,
    draw_puzzle,
    is_legal,
    legal_moves,
    min_disks,
    num_distinct_puzzles,
    optimal_moves,
    state_after_optimal_moves,
    top_disk,
)
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
from sao_megatron.envs.hanoi_text import HanoiText


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
        self.text = HanoiText(self.config)
        self.state: State | None = None
        self.done = True

    def _budget(self, horizon: int) -> int:
        return math.ceil(self.config.max_steps_factor * horizon - 1e-9)

    @staticmethod
    def episode_metrics(infos: list[dict[str, Any]], options: dict[str, Any]) -> dict[str, float]:
        """Evaluation metrics of finished episodes (`sao_megatron.envs.base.episode_metrics`):
        the per-move error rates (`move_error_rates`); `options` change nothing here."""
        return move_error_rates(infos)

    # ------------------------------------------------------------------ episode
    def draw_puzzle(self, seed: int) -> tuple[int, State, State, int | None, int | None]:
        """(H, start, goal, start peg, target peg) of episode `seed` without starting it (the
        pegs are None where the mode has none). Deterministic in `seed`."""
        return draw_puzzle(self.config, seed)

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
        return self.text.first_observation(
            self.num_disks, self.target_peg, self.goal, self._observation()
        )

    def render(self, state: State | None = None) -> str:
        """The pegs of `state` (default: the current one), one line per peg, disks bottom to top
        (e.g. 'A: 5 4 1'); with ``observation: disks`` the peg of each disk, largest first
        (e.g. 'Disks: 5 A 4 A 3 B 2 B 1 A')."""
        state = self.state if state is None else state
        assert state is not None, "call reset() first"
        return self.text.render(state)

    def parse_action(self, action: str) -> Move | None:
        """The move named by `action` in the strict 'X->Y' format, or None if malformed."""
        return self.text.parse_action(action)

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
        """The current state as `hanoi_text.HanoiText.observation` writes it."""
        assert self.state is not None, "call reset() first"
        moves_left = self.max_steps - self.num_steps
        return self.text.observation(self.state, self.target_peg, moves_left)

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
        return self.text.format_move(move)

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
        return self.text.plan(self.state, self.target_peg)

    def _action_text(self, move: Move) -> str:
        """The action for `move`: the move, after the gold plan with ``action_format: plan``."""
        assert self.state is not None
        return self.text.action(self.state, self.target_peg, move)

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
