"""A one-file environment: find a secret number in 1..high, told "higher" or "lower" each turn.

    sao-train examples/configs/quickstart.yaml --import examples/envs/guess_number.py \
        'tasks.train=[{name: guess_number, options: {high: 16}}]'
"""

import random
from dataclasses import dataclass
from typing import ClassVar

from sao_megatron.envs import StepResult, options_config, register_env


@dataclass(kw_only=True)
class GuessNumberOptions:
    """Options of guess_number (checked when the job config loads).

    Fields:
        high: the secret is in 1..high (>= 2).
        max_turns: guesses per episode; running out truncates the episode.
    """

    CONFIG_SECTION: ClassVar[str] = "guess_number"  # errors then name tasks.train[i].options.x
    high: int = 16
    max_turns: int = 6

    def __post_init__(self) -> None:
        if self.high < 2:
            raise ValueError(f"guess_number.high={self.high}: must be >= 2")


@register_env("guess_number", options=GuessNumberOptions)
class GuessNumber:
    name = "guess_number"

    def __init__(self, **options) -> None:
        self.options = options_config("guess_number", options)  # the config-load check, again
        self.max_steps = self.options.max_turns

    def reset(self, seed: int) -> str:
        self.secret = random.Random(seed).randint(1, self.options.high)  # same seed, same game
        self.low, self.high = 1, self.options.high
        return f"Find my number from 1 to {self.high}. Reply with one number."

    def step(self, action: str) -> StepResult:
        text = action.strip() if isinstance(action, str) else ""
        if not text.isdigit():  # never raise on bad text: end the episode, say why
            return StepResult(observation="", reward=0.0, done=True, info={"error": "malformed"})
        guess = int(text)
        if guess == self.secret:
            return StepResult(observation="", reward=1.0, done=True, info={"success": True})
        if guess < self.secret:
            self.low = max(self.low, guess + 1)
        else:
            self.high = min(self.high, guess - 1)
        hint = "higher" if guess < self.secret else "lower"
        return StepResult(observation=f"{guess}: {hint}.", reward=0.0, done=False)

    def gold_action(self) -> str:  # optional: bisection, for demonstrations and `show`
        return str((self.low + self.high) // 2)
