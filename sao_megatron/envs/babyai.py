"""BabyAI (minigrid) levels as text environments, with BabyAI's expert bot as the gold policy.

Observation: the agent's 7x7 egocentric view rendered as a short text, e.g.::

    Mission: go to the purple box
    You see: purple box 2 forward 1 left; grey key 3 forward 2 right
    In front of you: nothing
    You carry: nothing

Positions are relative to the agent (forward = cells ahead, left/right = cells sideways). Walls
are only mentioned when directly in front. The first observation also lists the actions.

Action format (strict): exactly one of ``left``, ``right``, ``forward``, ``pickup``, ``drop``,
``toggle``, ``done`` (surrounding whitespace ignored). Anything else is malformed: reward
`invalid_action_reward` (0.0) and the episode ends (configurable, as in Hanoi).

Reward: `success_reward` (1.0) when the mission is accomplished (binary); with
``binary_reward=False`` minigrid's own 1 - 0.9 * steps / max_steps. The step budget is the level's
`max_steps` (minigrid truncates there; set at reset, it depends on the generated room).

Needs the optional `minigrid` package (offline, no downloads); this module registers "babyai"
only when it imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from sao_megatron.envs.base import StepResult, options_config, register_env
from sao_megatron.envs.options import did_you_mean

ACTION_NAMES = ["left", "right", "forward", "pickup", "drop", "toggle", "done"]
_VIEW = 7  # minigrid's default agent view size; the agent sits at (3, 6) facing "up"


@dataclass(kw_only=True)
class BabyAIConfig:
    """Options of the BabyAI environment.

    Fields:
        level: a registered gymnasium id of a BabyAI level, e.g. "BabyAI-GoToLocal-v0".
        binary_reward: True: `success_reward` on success; False: minigrid's time-discounted reward.
        success_reward: reward for an accomplished mission (binary mode).
        invalid_action_reward: reward for a malformed action.
        invalid_action_ends_episode: True ends the episode on a malformed action; False makes it
            a no-op step.
    """

    CONFIG_SECTION: ClassVar[str] = "babyai"  # messages say babyai.<field> (see envs.options)

    level: str = "BabyAI-GoToLocal-v0"
    binary_reward: bool = True
    success_reward: float = 1.0
    invalid_action_reward: float = 0.0
    invalid_action_ends_episode: bool = True

    def __post_init__(self) -> None:
        import gymnasium as gym
        import minigrid  # noqa: F401  (importing registers the BabyAI levels with gymnasium)

        if self.level not in gym.registry or not self.level.startswith("BabyAI-"):
            levels = [k for k in gym.registry if k.startswith("BabyAI-")]
            raise ValueError(
                f"babyai.level={self.level!r}: not a registered BabyAI level; "
                f"{did_you_mean(self.level, levels)}e.g. 'BabyAI-GoToLocal-v0', "
                f"'BabyAI-PickupLoc-v0' ({len(levels)} levels: gymnasium ids 'BabyAI-*')"
            )


def describe_view(image: Any, carrying: Any = None) -> str:
    """Text of a minigrid egocentric view `image` ([7, 7, 3] int: object, colour, state per cell,
    indexed [x, y], agent at (3, 6) looking towards y = 0)."""
    from minigrid.core.constants import IDX_TO_COLOR, IDX_TO_OBJECT

    states = {0: "open", 1: "closed", 2: "locked"}
    seen = []
    ax, ay = _VIEW // 2, _VIEW - 1
    for x in range(_VIEW):
        for y in range(_VIEW):
            obj = IDX_TO_OBJECT[int(image[x, y, 0])]
            if obj in ("unseen", "empty", "floor", "wall", "agent") or (x, y) == (ax, ay):
                continue
            fwd, side = ay - y, x - ax
            name = f"{IDX_TO_COLOR[int(image[x, y, 1])]} {obj}"
            if obj == "door":
                name += f" ({states[int(image[x, y, 2])]})"
            where = [f"{fwd} forward"] if fwd else []
            if side:
                where.append(f"{abs(side)} {'right' if side > 0 else 'left'}")
            seen.append((abs(fwd) + abs(side), fwd, side, f"{name} {' '.join(where) or 'here'}"))
    seen.sort()
    front = IDX_TO_OBJECT[int(image[ax, ay - 1, 0])]
    if front in ("empty", "floor", "unseen"):
        front_text = "nothing"
    else:
        front_text = f"{IDX_TO_COLOR[int(image[ax, ay - 1, 1])]} {front}"
    carry = f"{carrying.color} {carrying.type}" if carrying is not None else "nothing"
    return (
        f"You see: {'; '.join(s[-1] for s in seen) or 'nothing'}\n"
        f"In front of you: {front_text}\nYou carry: {carry}"
    )


@register_env("babyai", options=BabyAIConfig)
class BabyAIEnv:
    """A BabyAI level with text observations/actions; gold actions from minigrid's BabyAIBot."""

    name = "babyai"

    def __init__(self, config: BabyAIConfig | None = None, **options: Any) -> None:
        import gymnasium as gym

        if config is not None and options:
            raise TypeError("BabyAIEnv: pass either a BabyAIConfig or keyword options, not both")
        self.config = config or options_config("babyai", options)
        self._env = gym.make(self.config.level)
        self.max_steps = int(self._env.unwrapped.max_steps)  # refreshed by reset (level-dependent)
        self.done = True
        self._bot = None

    def _observe(self, obs: dict[str, Any]) -> str:
        self._mission = obs["mission"]
        view = describe_view(obs["image"], self._env.unwrapped.carrying)
        return f"Mission: {self._mission}\n{view}"

    def reset(self, seed: int) -> str:
        """Start the level with `seed`; returns instructions, the mission and the view."""
        obs, _ = self._env.reset(seed=int(seed))
        self.max_steps = int(self._env.unwrapped.max_steps)
        self.seed = seed
        self.done = False
        self.num_steps = 0
        self._bot = None
        self._bot_steps = -1
        self._last_action: int | None = None
        return (
            "You are an agent in a grid world. Reply with exactly one action per turn: "
            + ", ".join(ACTION_NAMES)
            + ".\n"
            + self._observe(obs)
        )

    def step(self, action: str) -> StepResult:
        """Apply one action. Never raises on bad text; RuntimeError once the episode is over."""
        if self.done:
            raise RuntimeError("BabyAIEnv.step() called on a finished episode: call reset() first")
        cfg = self.config
        self.num_steps += 1
        name = action.strip() if isinstance(action, str) else None
        if name not in ACTION_NAMES:
            info = {"success": False, "error": "malformed", "num_steps": self.num_steps}
            if cfg.invalid_action_ends_episode or self.num_steps >= self.max_steps:
                self.done = True
                truncated = not cfg.invalid_action_ends_episode
                return StepResult(
                    observation="",
                    reward=cfg.invalid_action_reward,
                    done=not truncated,
                    truncated=truncated,
                    info=info,
                )
            return StepResult(
                observation=self._observe(self._env.unwrapped.gen_obs()),
                reward=cfg.invalid_action_reward,
                done=False,
                info=info,
            )
        idx = ACTION_NAMES.index(name)
        self._last_action = idx
        obs, reward, terminated, truncated, _ = self._env.step(idx)
        success = bool(terminated and reward > 0)
        if cfg.binary_reward:
            reward = cfg.success_reward if success else 0.0
        self.done = bool(terminated or truncated)
        info = {"success": success, "num_steps": self.num_steps}
        text = "" if self.done else self._observe(obs)
        return StepResult(
            observation=text,
            reward=float(reward),
            done=bool(terminated),
            truncated=bool(truncated and not terminated),
            info=info,
        )

    def gold_action(self) -> str:
        """BabyAIBot's action for the current state. The bot keeps a plan, so it is consulted
        at most once per step; if steps were taken without consulting it, it is rebuilt from the
        current state."""
        from minigrid.utils.baby_ai_bot import BabyAIBot

        if self.done:
            raise RuntimeError("BabyAIEnv.gold_action(): no episode in progress")
        if self._bot is None or self._bot_steps != self.num_steps - 1:
            if self._bot is not None and self._bot_steps == self.num_steps:
                return ACTION_NAMES[self._bot_choice]
            self._bot = BabyAIBot(self._env.unwrapped)
            self._bot_choice = int(self._bot.replan())
        else:
            self._bot_choice = int(self._bot.replan(self._last_action))
        self._bot_steps = self.num_steps
        return ACTION_NAMES[self._bot_choice]
