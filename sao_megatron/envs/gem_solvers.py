"""Gold solvers for GEM games (gem-llm 0.1.0): the next action of an expert from a game's state.

Each solver takes the unwrapped GEM game object after `reset` (and any steps) and returns the
action text in the format that game parses (a ``\\boxed{...}`` answer). A solver uses only what
the game's feedback has revealed to the player so far (it reads GEM's attributes of the guesses
already made and recomputes their feedback), so its play is a policy a model can learn from the
observations:

* GuessTheNumber: bisection. From the valid guesses so far and their higher/lower hints, the
  secret lies in [lo, hi]; guess (lo + hi) // 2 and say the interval first
  ("Between 1 and 10. \\boxed{5}"). Worst case floor(log2(range)) + 1 guesses: 4 for 1..10
  (the easy variant's 4 turns), 6 for 1..50 (the hard variant's 7).
* Mastermind: a consistent guess. The first code (in lexicographic order) that would have
  received exactly the observed black/white pegs for every earlier guess. 30 codes for the easy
  variant (2 of 6 digits), 1680 for the hard one (4 of 8). With its reasoning
  (`mastermind_reasoned`), it first lists the codes still consistent ("Left: 23 25 26.
  \\boxed{2 3}"), or counts them when there are more than `LIST_AT_MOST`.
* Tower of Hanoi: the first move of the optimal route to all disks on tower C from the current
  position (`sao_megatron.envs.hanoi_states.gold_move`), e.g. ``\\boxed{A C}``.

`SOLVERS` maps GEM's entry point (``module:Class``) to its solver; the GEM adapter
(`sao_megatron.envs.gem`) offers ``gold_action()`` exactly for those games. `REASONED_SOLVERS`
holds the solvers that write their reasoning before the answer (``gem.solver_reasoning``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from sao_megatron.envs.hanoi_states import gold_move

PEGS = "ABC"


def guess_the_number(game: Any) -> str:
    """Bisection over the interval the hints so far leave (GEM's ``GuessTheNumberEnv``)."""
    secret = game.game_number
    guesses = [g for g in game.previous_guesses if game.min_number <= g <= game.max_number]
    lo = max([game.min_number] + [g + 1 for g in guesses if g < secret])
    hi = min([game.max_number] + [g - 1 for g in guesses if g > secret])
    return f"Between {lo} and {hi}. \\boxed{{{(lo + hi) // 2}}}"


def pegs(guess: Sequence[int], code: Sequence[int]) -> tuple[int, int]:
    """Mastermind feedback (black, white) of `guess` against `code`, as GEM scores it: black =
    right digit in the right place; white = right digit in the wrong place, each code digit
    matched at most once."""
    black = sum(g == c for g, c in zip(guess, code, strict=True))
    rest_g = [g for g, c in zip(guess, code, strict=True) if g != c]
    rest_c = [c for g, c in zip(guess, code, strict=True) if g != c]
    white = 0
    for g in rest_g:
        if g in rest_c:
            rest_c.remove(g)
            white += 1
    return black, white


def consistent_codes(
    code_length: int, num_numbers: int, duplicates: bool, history: dict[tuple[int, ...], tuple]
) -> list[tuple[int, ...]]:
    """Every code that gives each earlier guess its observed (black, white), lexicographic."""
    digits = range(1, num_numbers + 1)
    codes = (
        itertools.product(digits, repeat=code_length)
        if duplicates
        else itertools.permutations(digits, code_length)
    )
    return [c for c in codes if all(pegs(g, c) == fb for g, fb in history.items())]


#: Mastermind's reasoned solver lists the consistent codes up to this many, else counts them
LIST_AT_MOST = 12


def _mastermind_candidates(game: Any) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """(codes consistent with all feedback so far, the first of them not yet guessed)."""
    history = {tuple(g): pegs(g, game.game_code) for g in game.previous_guesses}
    candidates = consistent_codes(
        game.code_length, game.num_numbers, bool(game.duplicate_numbers), history
    )
    guess = next(c for c in candidates if c not in history)  # the secret is always a candidate
    return candidates, guess


def _boxed_code(code: Sequence[int]) -> str:
    return "\\boxed{" + " ".join(map(str, code)) + "}"


def mastermind(game: Any) -> str:
    """The first code consistent with all feedback so far (GEM's ``MastermindEnv``)."""
    return _boxed_code(_mastermind_candidates(game)[1])


def mastermind_reasoned(game: Any) -> str:
    """`mastermind`'s guess after the codes still consistent with the pegs, each written as its
    digits run together ("Left: 23 25 26. \\boxed{2 3}"), or their count when there are more
    than `LIST_AT_MOST` ("Left: 30 codes. \\boxed{1 2}")."""
    candidates, guess = _mastermind_candidates(game)
    if len(candidates) > LIST_AT_MOST:
        left = f"{len(candidates)} codes"
    else:
        left = " ".join("".join(map(str, c)) for c in candidates)
    return f"Left: {left}. {_boxed_code(guess)}"


def tower_of_hanoi(game: Any) -> str:
    """The first optimal move towards all disks on tower C (GEM's ``TowerofHanoiEnv``)."""
    state = [0] * game.num_disks
    for peg, label in enumerate(PEGS):
        for disk in game.board[label]:
            state[disk - 1] = peg
    move = gold_move(tuple(state), PEGS.index("C"))
    if move is None:
        raise RuntimeError("tower_of_hanoi solver: the puzzle is already solved")
    return f"\\boxed{{{PEGS[move[0]]} {PEGS[move[1]]}}}"


#: GEM entry point ("module:Class") -> solver
SOLVERS: dict[str, Callable[[Any], str]] = {
    "gem.envs.game_env.guess_the_number:GuessTheNumberEnv": guess_the_number,
    "gem.envs.game_env.mastermind:MastermindEnv": mastermind,
    "gem.envs.game_env.tower_of_hanoi:TowerofHanoiEnv": tower_of_hanoi,
}

#: GEM entry point -> its solver that writes its reasoning first (GuessTheNumber's always does)
REASONED_SOLVERS: dict[str, Callable[[Any], str]] = {
    "gem.envs.game_env.guess_the_number:GuessTheNumberEnv": guess_the_number,
    "gem.envs.game_env.mastermind:MastermindEnv": mastermind_reasoned,
}
