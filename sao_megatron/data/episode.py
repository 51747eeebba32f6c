"""Episode text format: how prompt, observations and actions become token ids (the contract
between environments, the rollout engine, demonstrations and the trainer).

Text layout of one episode (markers are single tokens of our sentencepiece tokenizer)::

    <s><|obs|>{system_prompt}{observation_0}<|act|>{action_0}<|eoa|><|obs|>{observation_1}<|act|>{action_1}<|eoa|>...

* prompt (node 0 observation tokens) = [bos] + encode("<|obs|>" + system_prompt + obs_0 + "<|act|>")
* observation n >= 1 = encode("<|obs|>" + obs_n + "<|act|>"); tokenised on its own and appended
  (token-in/token-out: never re-tokenise the concatenated text).
* action n = the token ids the engine sampled, ending with the stop token ``<|eoa|>``
  (`stop_token_ids`; the engine also stops on eos). The text passed to `env.step` is the decoded
  action without the stop marker (`action_text`).
* context_mode "full_history": node n is sampled with the whole prefix obs_0 act_0 ... obs_n.
  context_mode "window": node n is sampled with prompt + the last K (action_j, observation_j+1)
  pairs + nothing else, i.e. ``obs_0 act_{n-K} obs_{n-K+1} ... act_{n-1} obs_n``; with K >= n it
  equals the full history. Use it for long horizons (Hanoi H=500: ~15k tokens in full history).

An `EpisodeBuilder` records one episode and returns a `Trajectory` (RL) or `TokenSequence`s with an
action mask for supervised warm-up data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sao_megatron.data.tokenizer import Tokenizer
from sao_megatron.data.trajectory import ActionNode, TokenSequence, Trajectory


@dataclass(kw_only=True)
class EpisodeFormatConfig:
    """How episodes are rendered to text/tokens.

    Fields:
        system_prompt: text put verbatim before the first observation ("" for none).
        observation_start: marker opening each observation.
        action_start: marker closing each observation; the policy generates right after it.
        action_end: stop marker ending each action (must be one token for `stop_token_ids`;
            otherwise the engine has to stop on `stop_strings`).
        add_bos: prepend the tokenizer's bos id to the prompt.
        context_mode: "full_history" or "window".
        window_size: K, the number of (action, next observation) pairs kept after the prompt in
            "window" mode (>= 0; ignored in "full_history" mode).
        format: "markers" (this module's `EpisodeFormatter`, the from-scratch path) or
            "chat_template" (`sao_megatron.data.chat_format.ChatTemplateFormatter`: the chat
            template of the job's tokenizer, `tokenizer.kind=hf`, or for the from-scratch
            sentencepiece tokenizer the episode-marker chat template of
            `sao_megatron.data.marker_chat`; the marker fields above are then unused). Agents
            (the OpenAI-compatible gateway) need it.
        observation_role: chat format only: role of the environment's messages, "user" or
            "tool".
        history: chat format only: "append" (token-in/token-out, the template must be
            prefix-stable) or "rerender" (each prompt rendered whole, window context).
    """

    system_prompt: str = ""
    observation_start: str = "<|obs|>"
    action_start: str = "<|act|>"
    action_end: str = "<|eoa|>"
    add_bos: bool = True
    context_mode: str = "full_history"
    window_size: int = 8
    format: str = "markers"
    observation_role: str = "user"
    history: str = "append"

    def __post_init__(self) -> None:
        if self.format not in ("markers", "chat_template"):
            raise ValueError(f"episode.format={self.format!r}: use 'markers' or 'chat_template'")
        if self.context_mode not in ("full_history", "window"):
            raise ValueError(
                f"episode.context_mode={self.context_mode!r}: use 'full_history' or 'window'"
            )
        if not (isinstance(self.window_size, int) and self.window_size >= 0):
            raise ValueError(f"episode.window_size={self.window_size!r}: must be an int >= 0")
        if not self.action_end:
            raise ValueError("episode.action_end is empty: actions need a stop marker")


def episode_text(
    observations: list[str], actions: list[str], config: EpisodeFormatConfig | None = None
) -> str:
    """The full-history text of an episode (bos omitted): exactly what the agent sees.

    observations[n] precedes actions[n]; len(observations) is len(actions) or one more.
    Raises ValueError otherwise.
    """
    c = config or EpisodeFormatConfig()
    if len(observations) not in (len(actions), len(actions) + 1):
        raise ValueError(f"{len(observations)} observations for {len(actions)} actions")
    parts = []
    for n, obs in enumerate(observations):
        system = c.system_prompt if n == 0 else ""
        parts.append(f"{c.observation_start}{system}{obs}{c.action_start}")
        if n < len(actions):
            parts.append(actions[n] + c.action_end)
    return "".join(parts)


class EpisodeFormatter:
    """Turns episode text into token ids with one tokenizer and one `EpisodeFormatConfig`.

    Attributes:
        stop_token_ids: token ids that end an action: [id of action_end] (if it is one token)
            plus eos (if the tokenizer has one). Pass them to the engine as stop_token_ids.
        stop_strings: [action_end], for engines/tokenizers where the marker is several tokens.
    """

    def __init__(self, tokenizer: Tokenizer, config: EpisodeFormatConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.config = config or EpisodeFormatConfig()
        self.action_end_id = tokenizer.token_to_id(self.config.action_end)
        stops = [self.action_end_id, tokenizer.eos_id]
        self.stop_token_ids: list[int] = [i for i in stops if i is not None]
        self.stop_strings: list[str] = [self.config.action_end]
        if self.config.add_bos and tokenizer.bos_id is None:
            raise ValueError("episode.add_bos=True but the tokenizer has no bos token; set False")

    # ---------------------------------------------------------------- text
    def prompt_text(self, first_observation: str) -> str:
        """'<|obs|>' + system_prompt + first observation + '<|act|>' (bos not included)."""
        c = self.config
        return f"{c.observation_start}{c.system_prompt}{first_observation}{c.action_start}"

    def observation_text(self, observation: str) -> str:
        """'<|obs|>' + observation + '<|act|>' for observations after the first."""
        return f"{self.config.observation_start}{observation}{self.config.action_start}"

    def episode_text(self, observations: list[str], actions: list[str]) -> str:
        """The full-history text of an episode (bos omitted); see module-level `episode_text`."""
        return episode_text(observations, actions, self.config)

    # ---------------------------------------------------------------- tokens
    def prompt_ids(self, first_observation: str) -> list[int]:
        """[bos] + tokens of the prompt (node 0's observation_token_ids)."""
        bos = [self.tokenizer.bos_id] if self.config.add_bos else []
        return bos + self.tokenizer.encode(self.prompt_text(first_observation))  # type: ignore[list-item]

    def observation_ids(self, observation: str) -> list[int]:
        """Tokens of a later observation (node n >= 1's observation_token_ids)."""
        return self.tokenizer.encode(self.observation_text(observation))

    def action_ids(self, action: str) -> list[int]:
        """Tokens of an action text plus the stop marker, as the policy should emit them (used for
        demonstrations; RL actions are the sampled ids, never re-tokenised)."""
        if self.action_end_id is not None:
            return self.tokenizer.encode(action) + [self.action_end_id]
        return self.tokenizer.encode(action + self.config.action_end)

    def action_text(self, action_ids: list[int]) -> str:
        """Decoded action without its stop marker: the text to pass to `env.step`."""
        text = self.tokenizer.decode(action_ids)
        end = self.config.action_end
        return text[: -len(end)] if text.endswith(end) else text

    def is_complete_action(self, action_ids: list[int]) -> bool:
        """True if the action ended on a stop token (False: cut by the engine's token limit)."""
        if action_ids and action_ids[-1] in self.stop_token_ids:
            return True
        return self.tokenizer.decode(action_ids).endswith(self.config.action_end)

    def context_ids(
        self, observation_ids: list[list[int]], action_ids: list[list[int]]
    ) -> list[int]:
        """The prompt for the next action: `observation_ids[0..n]` (prompt first) interleaved with
        `action_ids[0..n-1]`, where n = len(action_ids); windowed per `config.context_mode`."""
        n = len(action_ids)
        if len(observation_ids) != n + 1:
            raise ValueError(
                f"need {n + 1} observations before action {n}, got {len(observation_ids)}"
            )
        first = (
            0 if self.config.context_mode == "full_history" else max(0, n - self.config.window_size)
        )
        out = list(observation_ids[0])
        for j in range(first, n):
            out += action_ids[j]
            out += observation_ids[j + 1]
        return out

    def new_episode(self, task_id: str, first_observation: str) -> EpisodeBuilder:
        """Start recording an episode whose reset() returned `first_observation`."""
        return EpisodeBuilder(self, task_id, first_observation)


class EpisodeBuilder:
    """Records one episode step by step and produces its `Trajectory` / SFT sequences.

    Usage (rollout)::

        builder = formatter.new_episode(task_id, env.reset(seed))
        while True:
            ids, logprobs, versions = engine.generate(builder.next_context_ids(),
                                                      stop_token_ids=formatter.stop_token_ids)
            result = env.step(formatter.action_text(ids))
            builder.add_action(ids, logprobs, versions, result.reward)
            if result.done or result.truncated:
                break
            builder.add_observation(result.observation)
        trajectory = builder.to_trajectory(terminated=result.done, truncated=result.truncated)
    """

    def __init__(self, formatter: EpisodeFormatter, task_id: str, first_observation: str) -> None:
        self.formatter = formatter
        self.task_id = task_id
        self.observations: list[str] = [first_observation]
        self.observation_ids: list[list[int]] = [formatter.prompt_ids(first_observation)]
        self.action_ids: list[list[int]] = []
        self.behaviour_logprobs: list[list[float]] = []
        self.policy_versions: list[list[int]] = []
        self.rewards: list[float] = []
        self.contexts: list[list[int]] = []

    def next_context_ids(self) -> list[int]:
        """Prompt token ids for the next action (full history or window)."""
        if len(self.observation_ids) != len(self.action_ids) + 1:
            raise RuntimeError("next_context_ids(): add the observation of the last step first")
        return self.formatter.context_ids(self.observation_ids, self.action_ids)

    def add_action(
        self,
        action_ids: list[int],
        behaviour_logprobs: list[float] | None = None,
        policy_versions: list[int] | None = None,
        reward: float = 0.0,
    ) -> None:
        """Record the sampled action tokens (stop token included), their behaviour log-probs
        (nats) and engine weight versions, and the reward env.step returned for it.
        Demonstrations may omit log-probs/versions (stored as 0.0 / -1)."""
        ctx = self.next_context_ids()
        n = len(action_ids)
        self.contexts.append(ctx)
        self.action_ids.append(list(action_ids))
        self.behaviour_logprobs.append(list(behaviour_logprobs or [0.0] * n))
        self.policy_versions.append(list(policy_versions or [-1] * n))
        self.rewards.append(float(reward))

    def add_observation(self, observation: str) -> None:
        """Record the observation returned after the last action (before the next one)."""
        if len(self.observation_ids) != len(self.action_ids):
            raise RuntimeError("add_observation(): add the action of this step first")
        self.observations.append(observation)
        self.observation_ids.append(self.formatter.observation_ids(observation))

    def to_trajectory(self, *, terminated: bool, truncated: bool, **fields) -> Trajectory:
        """The episode as a `Trajectory` (context_mode from the format config). Extra keyword
        fields (temperature, top_p, group_index, info) are passed to Trajectory."""
        window = self.formatter.config.context_mode == "window"
        nodes = [
            ActionNode(
                observation_token_ids=self.observation_ids[n],
                action_token_ids=self.action_ids[n],
                behaviour_logprobs=self.behaviour_logprobs[n],
                policy_versions=self.policy_versions[n],
                reward=self.rewards[n],
                context_token_ids=self.contexts[n] if window else None,
                action_text=self.formatter.action_text(self.action_ids[n]),
            )
            for n in range(len(self.action_ids))
        ]
        return Trajectory(
            task_id=self.task_id,
            nodes=nodes,
            terminated=terminated,
            truncated=truncated,
            context_mode="window" if window else "full_history",
            **fields,
        )

    def to_sft_sequences(self, train_mask: list[bool] | None = None) -> list[TokenSequence]:
        """Supervised sequences: one (full history) or one per trained node (window).

        action_mask is True on the tokens of actions with train_mask[n] True (default: all), so
        e.g. the deliberate mistakes of a noisy-gold demonstrator stay context only.
        behaviour_logprobs are 0.0 and policy_versions -1 everywhere (not RL data).
        token_ids: [T] int64, action_mask: [T] bool, node_index: [T] int64.
        """
        num = len(self.action_ids)
        mask = [True] * num if train_mask is None else list(train_mask)
        if len(mask) != num:
            raise ValueError(f"train_mask has {len(mask)} entries for {num} actions")
        window = self.formatter.config.context_mode == "window"
        if not window:
            ids: list[int] = []
            amask: list[bool] = []
            node: list[int] = []
            for n in range(num):
                o, a = self.observation_ids[n], self.action_ids[n]
                ids += o + a
                amask += [False] * len(o) + [mask[n]] * len(a)
                node += [n] * (len(o) + len(a))
            return [_sequence(ids, amask, node)]
        out = []
        for n in range(num):
            if mask[n]:
                ctx, a = self.contexts[n], self.action_ids[n]
                out.append(
                    _sequence(
                        ctx + a, [False] * len(ctx) + [True] * len(a), [n] * (len(ctx) + len(a))
                    )
                )
        return out


def build_trajectory(
    formatter: EpisodeFormatter,
    task_id: str,
    observations: list[str],
    action_token_ids: list[list[int]],
    behaviour_logprobs: list[list[float]],
    policy_versions: list[list[int]],
    rewards: list[float],
    *,
    terminated: bool,
    truncated: bool,
    **fields,
) -> Trajectory:
    """A `Trajectory` from a finished episode's lists (same as replaying it in an EpisodeBuilder).

    observations[n] was shown before action n (observations[0] = reset()'s text); len is the
    number of actions (the final observation after the last action is not part of it). Extra
    keyword fields go to `Trajectory` (temperature, top_p, group_index, info).
    Raises ValueError on length mismatches.
    """
    num = len(action_token_ids)
    lens = (len(observations), len(behaviour_logprobs), len(policy_versions), len(rewards))
    if any(k != num for k in lens):
        raise ValueError(
            f"build_trajectory: {num} actions but (observations, behaviour_logprobs, "
            f"policy_versions, rewards) have lengths {lens}"
        )
    builder = formatter.new_episode(task_id, observations[0])
    for n in range(num):
        if n:
            builder.add_observation(observations[n])
        builder.add_action(
            action_token_ids[n], behaviour_logprobs[n], policy_versions[n], rewards[n]
        )
    return builder.to_trajectory(terminated=terminated, truncated=truncated, **fields)


def _sequence(ids: list[int], mask: list[bool], node: list[int]) -> TokenSequence:
    t = len(ids)
    return TokenSequence(
        token_ids=torch.tensor(ids, dtype=torch.long),
        action_mask=torch.tensor(mask, dtype=torch.bool),
        node_index=torch.tensor(node, dtype=torch.long),
        behaviour_logprobs=torch.zeros(t, dtype=torch.float32),
        policy_versions=torch.full((t,), -1, dtype=torch.long),
    )
