"""Warm-up data: gold (or noisy-gold) demonstrations for any configured environment, the
tokenizer-training corpus built from them, and their supervised token sequences.

Everything is deterministic by seed: episode seeds and noise draws come from string-seeded
`random.Random` instances, never from global RNG state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from sao_megatron.data.episode import EpisodeFormatConfig, EpisodeFormatter, episode_text
from sao_megatron.data.tokenizer import SentencePieceTokenizer, TokenizerConfig, train_sentencepiece
from sao_megatron.data.trajectory import TokenSequence
from sao_megatron.envs.base import Environment, EnvSpec, SupportsGoldAction, task_id


@dataclass(kw_only=True)
class DemonstrationConfig:
    """Which demonstrations to generate.

    Fields:
        envs: environments to draw from (each an EnvSpec: name + options); default: chain_sum
            and hanoi (H=50).
        num_episodes: episodes per environment (>= 1).
        seed: base seed; episode seeds derive from it, the env index and the episode index.
        noise_epsilon: probability of a deliberate legal-but-wrong action per step for
            environments with `noisy_gold_action` (Hanoi); others always act gold. In [0, 1).
        train_on_noise: also put the wrong actions under the loss (default False: they are
            context only, the model learns the recovery that follows them).
        opening_episodes: extra episodes per environment of which only the first
            `opening_turns` moves are played and kept (>= 0, default 0). A long episode gives
            one row whose context is the prompt alone (window contexts), so a long-horizon
            warm-up sees its first move once in H rows; these episodes oversample it.
        opening_turns: moves kept of each opening episode (>= 1, default 1).
    """

    envs: list[EnvSpec] = field(
        default_factory=lambda: [EnvSpec(name="chain_sum"), EnvSpec(name="hanoi")]
    )
    num_episodes: int = 100
    seed: int = 0
    noise_epsilon: float = 0.0
    train_on_noise: bool = False
    opening_episodes: int = 0
    opening_turns: int = 1

    def __post_init__(self) -> None:
        self.envs = [e if isinstance(e, EnvSpec) else EnvSpec(**e) for e in self.envs]
        if not self.envs:
            raise ValueError("demonstrations.envs is empty: list at least one environment")
        if not (isinstance(self.num_episodes, int) and self.num_episodes >= 1):
            raise ValueError(f"demonstrations.num_episodes={self.num_episodes!r}: must be >= 1")
        if not (0.0 <= self.noise_epsilon < 1.0):
            raise ValueError(
                f"demonstrations.noise_epsilon={self.noise_epsilon}: must be in [0, 1)"
            )
        if not (isinstance(self.opening_episodes, int) and self.opening_episodes >= 0):
            raise ValueError(
                f"demonstrations.opening_episodes={self.opening_episodes!r}: must be an int >= 0"
            )
        if not (isinstance(self.opening_turns, int) and self.opening_turns >= 1):
            raise ValueError(
                f"demonstrations.opening_turns={self.opening_turns!r}: must be an int >= 1"
            )


@dataclass(kw_only=True)
class Demonstration:
    """One demonstrated episode as text.

    observations[n] is shown before actions[n] (observations[0] is reset()'s text);
    is_gold[n] says whether action n was the expert's choice; rewards[n] follows action n.
    """

    task_id: str
    env_name: str
    seed: int
    observations: list[str]
    actions: list[str]
    is_gold: list[bool]
    rewards: list[float]
    terminated: bool
    truncated: bool
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def total_reward(self) -> float:
        return float(sum(self.rewards))

    def text(self, config: EpisodeFormatConfig | None = None) -> str:
        """The full episode text exactly as the agent sees it (episode format, bos omitted)."""
        return episode_text(self.observations, self.actions, config)

    def to_sft_sequences(
        self, formatter: EpisodeFormatter, train_on_noise: bool = False
    ) -> list[TokenSequence]:
        """Token sequences with an action mask for supervised warm-up (see
        `EpisodeBuilder.to_sft_sequences`): one sequence in full-history mode, one per trained
        node in window mode."""
        builder = formatter.new_episode(self.task_id, self.observations[0])
        for n, action in enumerate(self.actions):
            builder.add_action(formatter.action_ids(action), reward=self.rewards[n])
            if n + 1 < len(self.observations):
                builder.add_observation(self.observations[n + 1])
        mask = [g or train_on_noise for g in self.is_gold]
        return builder.to_sft_sequences(mask)


def run_demonstration(
    env: Environment,
    seed: int,
    *,
    noise_epsilon: float = 0.0,
    episode_task_id: str | None = None,
    max_turns: int | None = None,
) -> Demonstration:
    """Play one episode of `env` with its gold policy (noisy-gold if noise_epsilon > 0 and the
    env has `noisy_gold_action(rng, epsilon)`), for at most `max_turns` moves (None: until the
    episode ends; a cut episode is `truncated`). Raises TypeError if the env has no gold
    policy."""
    if not isinstance(env, SupportsGoldAction):
        raise TypeError(
            f"environment {env.name!r} has no gold_action(): it cannot produce demonstrations"
        )
    noisy = noise_epsilon > 0 and hasattr(env, "noisy_gold_action")
    rng = random.Random(f"noise:{env.name}:{seed}")
    observations = [env.reset(seed)]
    actions: list[str] = []
    is_gold: list[bool] = []
    rewards: list[float] = []
    result = None
    turns = env.max_steps if max_turns is None else min(env.max_steps, max_turns)
    for _ in range(turns):
        if noisy:
            action, gold = env.noisy_gold_action(rng, noise_epsilon)  # type: ignore[attr-defined]
        else:
            action, gold = env.gold_action(), True
        result = env.step(action)
        actions.append(action)
        is_gold.append(gold)
        rewards.append(result.reward)
        if result.done or result.truncated or len(actions) == max_turns:
            break
        observations.append(result.observation)
    assert result is not None, "max_steps >= 1"
    return Demonstration(
        task_id=episode_task_id or task_id(env.name, seed),
        env_name=env.name,
        seed=seed,
        observations=observations,
        actions=actions,
        is_gold=is_gold,
        rewards=rewards,
        terminated=result.done,
        truncated=result.truncated or not result.done,
        info=dict(result.info),
    )


@runtime_checkable
class SupportsDemonstration(Protocol):
    """An environment that renders its own gold episodes (agents run through the gateway,
    `sao_megatron.rollout.gateway.AgentEnvironment`): ``demonstration(seed, episode_task_id)``
    returns an object with this module's `Demonstration` methods ``text(format_config)`` (the
    tokenizer corpus) and ``to_sft_sequences(formatter, train_on_noise)`` (the SFT data)."""

    def demonstration(self, seed: int, episode_task_id: str | None = None) -> Any: ...


def episode_seeds(base_seed: int, env_index: int, num_episodes: int) -> list[int]:
    """Deterministic, distinct-in-practice episode seeds for one environment of a config."""
    rng = random.Random(f"demo:{base_seed}:{env_index}")
    return [rng.randrange(2**31) for _ in range(num_episodes)]


def opening_seeds(base_seed: int, env_index: int, num_episodes: int) -> list[int]:
    """Seeds of the opening episodes of one environment (a stream of their own, so adding
    openings leaves the full demonstrations unchanged)."""
    rng = random.Random(f"demo-opening:{base_seed}:{env_index}")
    return [rng.randrange(2**31) for _ in range(num_episodes)]


def generate_demonstrations(config: DemonstrationConfig) -> list[Demonstration]:
    """`config.num_episodes` demonstrations per environment, in config order (deterministic),
    each environment's `config.opening_episodes` openings (its first `opening_turns` moves)
    after its full episodes.

    Environments with a gold policy (`SupportsGoldAction`) are played by it; agents
    (`SupportsDemonstration`) give their gold conversations (`AgentDemonstration`s, which have
    the same ``text``/``to_sft_sequences`` methods) and take no openings."""
    out = []
    for j, spec in enumerate(config.envs):
        env = spec.build()
        for s in episode_seeds(config.seed, j, config.num_episodes):
            if isinstance(env, SupportsDemonstration):  # an agent: its gold conversation
                out.append(env.demonstration(s, episode_task_id=task_id(spec.name, s)))
                continue
            out.append(
                run_demonstration(
                    env,
                    s,
                    noise_epsilon=config.noise_epsilon,
                    episode_task_id=task_id(spec.name, s),
                )
            )
        if config.opening_episodes and isinstance(env, SupportsDemonstration):
            raise ValueError(
                f"demonstrations.opening_episodes={config.opening_episodes}: environment "
                f"{spec.name!r} is an agent (gold conversations only); set it to 0"
            )
        for s in opening_seeds(config.seed, j, config.opening_episodes):
            out.append(
                run_demonstration(
                    env,
                    s,
                    noise_epsilon=config.noise_epsilon,
                    episode_task_id=task_id(spec.name, s),
                    max_turns=config.opening_turns,
                )
            )
    return out


def demonstration_sequences(
    config: DemonstrationConfig, formatter: EpisodeFormatter
) -> list[TokenSequence]:
    """All supervised sequences of `generate_demonstrations(config)` for `formatter`."""
    seqs: list[TokenSequence] = []
    for demo in generate_demonstrations(config):
        seqs += demo.to_sft_sequences(formatter, train_on_noise=config.train_on_noise)
    return seqs


def corpus_lines(
    config: DemonstrationConfig, format_config: EpisodeFormatConfig | None = None
) -> list[str]:
    """Tokenizer training corpus: every line of every demonstration's episode text."""
    lines: list[str] = []
    for demo in generate_demonstrations(config):
        lines += demo.text(format_config).split("\n")
    return lines


def train_tokenizer_for_envs(
    demo_config: DemonstrationConfig,
    tokenizer_config: TokenizerConfig,
    format_config: EpisodeFormatConfig | None = None,
) -> SentencePieceTokenizer:
    """Train the sentencepiece tokenizer on the demonstrations' episode texts."""
    return train_sentencepiece(corpus_lines(demo_config, format_config), tokenizer_config)
