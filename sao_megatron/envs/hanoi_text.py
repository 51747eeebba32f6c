"""Tower of Hanoi text: the observation and action formats, the gold plan and the task line.

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
"""

from __future__ import annotations

import re

from sao_megatron.envs.hanoi_config import HanoiConfig
from sao_megatron.envs.hanoi_states import Move, State, targets


class HanoiText:
    """The text formats of one `HanoiConfig`: parse and write moves, render states and plans."""

    def __init__(self, config: HanoiConfig) -> None:
        self.config = config
        self.labels = config.peg_labels
        move = rf"([{self.labels}])->([{self.labels}])"
        if config.action_format == "plan":  # any text without "->", then the move
            self._move_re = re.compile(rf"\s*(?:(?:(?!->).)*?\s)?{move}\s*", re.DOTALL)
        else:
            self._move_re = re.compile(rf"\s*{move}\s*")

    def parse_action(self, action: str) -> Move | None:
        """The move named by `action` in the strict 'X->Y' format, or None if malformed."""
        m = self._move_re.fullmatch(action)
        if m is None or m.group(1) == m.group(2):
            return None
        return (self.labels.index(m.group(1)), self.labels.index(m.group(2)))

    def format_move(self, move: Move) -> str:
        """Action text of a move, e.g. (0, 2) -> 'A->C'."""
        return f"{self.labels[move[0]]}->{self.labels[move[1]]}"

    def render(self, state: State) -> str:
        """The pegs of `state`, one line per peg, disks bottom to top (e.g. 'A: 5 4 1'); with
        ``observation: disks`` the peg of each disk, largest first (e.g. 'Disks: 5 A 4 A 3 B 2 B
        1 A')."""
        if self.config.observation == "disks":
            n = len(state)
            return "Disks:" + "".join(f" {d} {self.labels[state[d - 1]]}" for d in range(n, 0, -1))
        lines = []
        for p in range(3):
            disks = [d for d in range(len(state), 0, -1) if state[d - 1] == p]
            lines.append(f"{self.labels[p]}:" + "".join(f" {d}" for d in disks))
        return "\n".join(lines)

    def observation(self, state: State, target_peg: int | None, moves_left: int) -> str:
        """The pegs (with ``observation: disks`` and a tower goal, after the goal peg:
        'Goal C, disks: ...'), plus the remaining budget with `show_moves_left`."""
        text = self.render(state)
        if self.config.observation == "disks" and self.config.goal == "tower":
            assert target_peg is not None
            text = f"Goal {self.labels[target_peg]}, d" + text[1:]
        if self.config.show_moves_left:
            return f"Moves left: {moves_left}\n" + text
        return text

    def plan(self, state: State, target_peg: int | None) -> str:
        """The gold plan of ``action_format: plan`` for `state` (goal: tower): for every disk d
        from the largest down, 'd peg goal' (`hanoi_states.targets`), e.g. '3 B C 2 A A 1 A A'."""
        if self.config.goal != "tower":
            raise ValueError(
                "hanoi.action_format='plan' writes the goals of the route to a tower; with "
                "hanoi.goal='random' use action_format='move'"
            )
        assert target_peg is not None
        t = targets(state, target_peg)
        lab, n = self.labels, len(state)
        return " ".join(f"{d} {lab[state[d - 1]]} {lab[t[d - 1]]}" for d in range(n, 0, -1))

    def action(self, state: State, target_peg: int | None, move: Move) -> str:
        """The action for `move`: the move, after the gold plan with ``action_format: plan``."""
        if self.config.action_format == "plan":
            return f"{self.plan(state, target_peg)} {self.format_move(move)}"
        return self.format_move(move)

    def first_observation(
        self, num_disks: int, target_peg: int | None, goal: State, observation: str
    ) -> str:
        """The task line (``instructions``: full or short), with ``goal: random`` the goal
        position, then `observation` (the start state)."""
        cfg, lab = self.config, self.labels
        if cfg.goal == "random":
            if cfg.instructions == "short":
                head = f"Hanoi {num_disks} disks, reach the goal, one move X->Y per turn."
            else:
                head = (
                    f"Tower of Hanoi: {num_disks} disks on pegs {lab[0]}, {lab[1]}, "
                    f"{lab[2]}. Rearrange them into the goal position. Disks are numbered by size "
                    "(1 is the smallest) and listed bottom to top. Move one top disk per turn; "
                    "never put a disk on a smaller one. Reply with exactly one move, e.g. "
                    f"{lab[0]}->{lab[2]}."
                )
            return f"{head}\nGoal:\n{self.render(goal)}\nNow:\n{observation}"
        assert target_peg is not None
        plan = cfg.action_format == "plan"
        if cfg.instructions == "short":
            return (
                f"Hanoi {num_disks} disks, goal peg {lab[target_peg]}, "
                f"{'plan then ' if plan else ''}one move X->Y per turn.\n" + observation
            )
        return (
            f"Tower of Hanoi: {num_disks} disks on pegs {lab[0]}, {lab[1]}, {lab[2]}. "
            f"Move all disks to peg {lab[target_peg]}. Disks are numbered by size (1 is the "
            "smallest) and listed bottom to top. Move one top disk per turn; never put a disk on "
            f"a smaller one. Reply with {'a plan, then ' if plan else ''}exactly one move, e.g. "
            f"{lab[0]}->{lab[2]}.\n" + observation
        )
