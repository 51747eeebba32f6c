"""Single-turn reasoning tasks from reasoning-gym as 1-step environments with binary rewards.

`reset(seed)` generates the task with reasoning-gym's procedural generator (offline,
deterministic: the same seed and difficulty give the same question); the observation is the
question plus an instruction on the answer format. `step(answer)` ends the episode with reward
1.0 or 0.0 from an exact-match, last-number or math-verify reward
(`sao_megatron.envs.rewards`), never from reasoning-gym's partial-credit scorers.

Registered names: "chain_sum", "basic_arithmetic" (presets) and "reasoning_gym" (any dataset
reasoning-gym registers, via `dataset=`). Difficulty knobs are the reasoning-gym config fields
of that dataset, e.g. ``make_env("chain_sum", difficulty={"min_terms": 2, "max_digits": 2})``.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, ClassVar

from sao_megatron.envs.base import StepResult, options_config, register_env
from sao_megatron.envs.options import did_you_mean
from sao_megatron.envs.rewards import REWARDS

DEFAULT_INSTRUCTIONS = {
    "exact_match": "Reply with only the final answer.",
    "last_number": "Reply with only the final answer.",
    "math_verify": "Put the final answer in \\boxed{}.",
}


_IMPORT_LOCK = threading.Lock()


def _reasoning_gym() -> ModuleType:
    """The ``reasoning_gym`` package, imported on first use under a lock.

    ``import reasoning_gym`` registers its datasets as a side effect of importing every dataset
    module. Rollout workers build environments from several threads at once; a second thread
    importing ``reasoning_gym.factory`` while the first is still inside ``import reasoning_gym``
    saw an empty ``DATASETS`` ("'chain_sum': not a reasoning-gym dataset", seen in a real
    job: the rollout's worker threads were building environments while the evaluation did).
    Every use goes through here, so the whole package is imported by one thread while the
    others wait. Not at module import: it pulls in matplotlib (through cellpylib), 1.3-2.6 s of
    every process that imports `sao_megatron.envs` (each trainer rank, each CLI), most of which
    never build a reasoning-gym task.
    """
    with _IMPORT_LOCK:
        import reasoning_gym
        import reasoning_gym.factory  # noqa: F401  (DATASETS, filled by the line above)
    return reasoning_gym


def _datasets() -> dict[str, Any]:
    """reasoning-gym's dataset registry (name -> dataset class), every dataset registered."""
    return _reasoning_gym().factory.DATASETS


@dataclass(kw_only=True)
class ReasoningGymConfig:
    """Options of a single-turn reasoning-gym task.

    Fields:
        dataset: reasoning-gym dataset name, e.g. "chain_sum", "basic_arithmetic".
        difficulty: reasoning-gym config fields of that dataset (its difficulty knobs), e.g.
            {"min_terms": 2, "max_terms": 4, "min_digits": 1, "max_digits": 2}. "seed" and
            "size" are not allowed (the episode seed picks the task).
        reward: "exact_match" (answer == gold after whitespace normalisation), "last_number"
            (the last number in the answer == the gold number: for models that answer in a
            sentence) or "math_verify" (mathematical equivalence; the answer needs $...$ or
            \\boxed{}).
        instruction: text appended to the question (on its own line); None picks the default for
            the reward ("Reply with only the final answer." / "Put the final answer in \\boxed{}.").
    """

    CONFIG_SECTION: ClassVar[str] = "reasoning_gym"  # messages: reasoning_gym.<field>
    FIXED_HINTS: ClassVar[dict[str, str]] = {
        "dataset": "use the 'reasoning_gym' environment to pick a dataset"
    }

    dataset: str = "chain_sum"
    difficulty: dict[str, Any] = field(default_factory=dict)
    reward: str = "exact_match"
    instruction: str | None = None

    def __post_init__(self) -> None:
        DATASETS = _datasets()  # noqa: N806  (reasoning-gym's name)
        if self.dataset not in DATASETS:
            raise ValueError(
                f"reasoning_gym.dataset={self.dataset!r}: not a reasoning-gym dataset; "
                f"{did_you_mean(self.dataset, DATASETS)}datasets: {sorted(DATASETS)}"
            )
        if self.reward not in REWARDS:
            raise ValueError(f"reasoning_gym.reward={self.reward!r}: use one of {sorted(REWARDS)}")
        self.difficulty = dict(self.difficulty)
        cfg_cls = DATASETS[self.dataset][1]
        knobs = {f.name for f in dataclasses.fields(cfg_cls)} - {"seed", "size"}
        for key in self.difficulty:
            if key not in knobs:
                raise ValueError(
                    f"reasoning_gym.difficulty.{key}: unknown difficulty knob of reasoning-gym "
                    f"dataset {self.dataset!r}; {did_you_mean(key, knobs)}knobs: {sorted(knobs)}"
                )
        try:
            cfg = cfg_cls(seed=0, size=1, **self.difficulty)
            if hasattr(cfg, "validate"):
                cfg.validate()
        except (AssertionError, ValueError, TypeError) as e:
            raise ValueError(
                f"reasoning_gym.difficulty={self.difficulty!r} rejected by reasoning-gym's "
                f"{cfg_cls.__name__}: {e}"
            ) from e


class ReasoningGymEnv:
    """A reasoning-gym dataset as a 1-step environment (max_steps = 1).

    The action is the whole answer text. step() scores it, returns done=True and
    info {"success", "gold", "error"?}; calling step() again before reset() raises RuntimeError.
    """

    max_steps = 1

    def __init__(self, config: ReasoningGymConfig | None = None, **options: Any) -> None:
        if config is not None and options:
            raise TypeError("ReasoningGymEnv: pass a ReasoningGymConfig or options, not both")
        self.config = config or options_config("reasoning_gym", options)
        self.name = self.config.dataset
        self._reward_fn = REWARDS[self.config.reward]
        instruction = self.config.instruction
        self._instruction = (
            DEFAULT_INSTRUCTIONS[self.config.reward] if instruction is None else instruction
        )
        self.entry: dict[str, Any] | None = None
        self.done = True

    def reset(self, seed: int) -> str:
        """Generate the task for `seed`; returns the question and the answer instruction."""
        ds = _reasoning_gym().create_dataset(
            self.config.dataset, seed=int(seed), size=1, **self.config.difficulty
        )
        self.entry = ds[0]
        self.seed = seed
        self.done = False
        q = self.entry["question"]
        return f"{q}\n{self._instruction}" if self._instruction else q

    @property
    def gold(self) -> str:
        """The reasoning-gym gold answer of the current task."""
        if self.entry is None:
            raise RuntimeError("call reset() first")
        return str(self.entry["answer"])

    def gold_action(self) -> str:
        """The gold answer as an action: bare for exact match, \\boxed{} for math-verify."""
        if self.done:
            raise RuntimeError(f"{self.name}.gold_action(): no episode in progress")
        return f"\\boxed{{{self.gold}}}" if self.config.reward == "math_verify" else self.gold

    def step(self, action: str) -> StepResult:
        """Score the answer; the episode always ends. Never raises on bad text."""
        if self.done:
            raise RuntimeError(f"{self.name}.step() on a finished episode: call reset() first")
        self.done = True
        try:
            reward = float(self._reward_fn(action, self.gold))
            info: dict[str, Any] = {"success": reward == 1.0, "gold": self.gold}
        except Exception as e:  # a reward bug must not kill a rollout worker; report it
            reward, info = 0.0, {"success": False, "gold": self.gold, "error": repr(e)}
        return StepResult(observation="", reward=reward, done=True, info=info)


@register_env("reasoning_gym", options=ReasoningGymConfig)
def make_reasoning_gym(**options: Any) -> ReasoningGymEnv:
    """Any reasoning-gym dataset: options are ReasoningGymConfig fields (`dataset` picks it)."""
    return ReasoningGymEnv(options_config("reasoning_gym", options))


@register_env("chain_sum", options=ReasoningGymConfig, fixed={"dataset": "chain_sum"})
def make_chain_sum(**options: Any) -> ReasoningGymEnv:
    """reasoning-gym `chain_sum` (sums/differences of integers); options as ReasoningGymConfig
    without `dataset`."""
    return ReasoningGymEnv(options_config("chain_sum", options))


@register_env("basic_arithmetic", options=ReasoningGymConfig, fixed={"dataset": "basic_arithmetic"})
def make_basic_arithmetic(**options: Any) -> ReasoningGymEnv:
    """reasoning-gym `basic_arithmetic` (+-*/ with parentheses); options as ReasoningGymConfig
    without `dataset`."""
    return ReasoningGymEnv(options_config("basic_arithmetic", options))
