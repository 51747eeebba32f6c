"""Binary reward functions for single-turn answers: exact match, last number, math-verify.

Rewards are plain callables ``reward(answer: str, gold: str) -> float`` returning 0.0 or 1.0.
reasoning-gym's default scorers give partial credit (gold "7", answer "17" scores 0.5 because
the gold is a substring), so they are not used as binary rewards here.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable

RewardFn = Callable[[str, str], float]


def normalize_whitespace(text: str) -> str:
    """Strip the ends and collapse every run of whitespace (spaces, tabs, newlines) to one space."""
    return " ".join(text.split())


def exact_match_reward(answer: str, gold: str) -> float:
    """1.0 iff the answer equals the gold after `normalize_whitespace`, else 0.0.

    No substring credit: gold "7" with answer "17" or "7 7" scores 0.0. Non-string answers
    score 0.0.
    """
    if not isinstance(answer, str):
        return 0.0
    return 1.0 if normalize_whitespace(answer) == normalize_whitespace(gold) else 0.0


# A signed decimal number: "-4", "84", "3.5", "1,234" (thousands separators). The sign must touch
# the digits, so the "-" of "5 - 9" is an operator, not part of "9".
_NUMBER = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number written in `text` (see `_NUMBER`), as a float; None if there is none.

    Examples: "The final answer is 6." -> 6.0; "58 + 26 = 84." -> 84.0; "5 - 9 = -4" -> -4.0;
    "\\boxed{1,234}" -> 1234.0; "no digits" -> None.
    """
    if not isinstance(text, str):
        return None
    found = _NUMBER.findall(text)
    if not found:
        return None
    return float(found[-1].replace(",", ""))


def last_number_reward(answer: str, gold: str) -> float:
    """1.0 iff the last number in the answer equals the gold number, else 0.0.

    For small instruct models that answer in a sentence ("The final answer to the arithmetic
    problem is 84.") where exact match scores every correct reply 0. Equality is up to float
    rounding (`math.isclose`, rel 1e-9, abs 1e-9). A gold that is not a number scores by
    `exact_match_reward`. No partial credit: "17" for gold "7" scores 0.0, "7 + 1 = 8" for gold
    "7" scores 0.0 (the last number is 8).
    """
    gold_value = last_number(gold) if _NUMBER.fullmatch(gold.strip()) else None
    if gold_value is None:
        return exact_match_reward(answer, gold)
    value = last_number(answer)
    if value is None:
        return 0.0
    return 1.0 if math.isclose(value, gold_value, rel_tol=1e-9, abs_tol=1e-9) else 0.0


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify logs a warning on *every* call made with timeouts disabled; we disable them on
    purpose in worker threads (its signal-based timeout only works in the main thread)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_FILTER_INSTALLED = False


def _install_filter() -> None:
    global _FILTER_INSTALLED
    if not _FILTER_INSTALLED:
        for name in ("math_verify", "math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_DropTimeoutDisabledWarning())
        _FILTER_INSTALLED = True


def math_verify_reward(answer: str, gold: str, timeout_seconds: int = 5) -> float:
    """1.0 iff math-verify finds the answer mathematically equal to the gold, else 0.0.

    The answer must mark its final result as LaTeX: ``$...$`` or ``\\boxed{...}`` (math-verify's
    LaTeX extraction; a bare "0.5" is also accepted by its expression extraction). The gold may be
    plain ("0.5") or LaTeX. Example: gold "0.5", answer "$\\frac{1}{2}$" -> 1.0.
    math-verify's timeouts use SIGALRM, which only works in the main thread, so from any other
    thread (rollout workers) parsing and verification run with timeouts disabled
    (`parsing_timeout=None`, `timeout_seconds=None`). Errors inside math-verify score 0.0.
    """
    from math_verify import parse, verify

    if not isinstance(answer, str) or not answer.strip():
        return 0.0
    in_main = threading.current_thread() is threading.main_thread()
    timeout = timeout_seconds if in_main else None
    if timeout is None:
        _install_filter()
    gold_parsed = parse(
        gold if "$" in gold or "\\" in gold else f"${gold}$", parsing_timeout=timeout
    )
    answer_parsed = parse(answer, parsing_timeout=timeout)
    if not gold_parsed or not answer_parsed:
        return 0.0
    return 1.0 if verify(gold_parsed, answer_parsed, timeout_seconds=timeout) else 0.0


REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match_reward,
    "last_number": last_number_reward,
    "math_verify": math_verify_reward,
}
