"""Binary reward functions for single-turn answers: exact match and math-verify equivalence.

Rewards are plain callables ``reward(answer: str, gold: str) -> float`` returning 0.0 or 1.0.
reasoning-gym's default scorers give partial credit (gold "7", answer "17" scores 0.5 because
the gold is a substring), so they are not used as binary rewards here.
"""

from __future__ import annotations

import logging
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
    "math_verify": math_verify_reward,
}
