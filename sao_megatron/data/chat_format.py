"""Chat-template episodes: observations and actions rendered as chat messages with the model's
own chat template (system / user or tool / assistant), token-in/token-out.

A drop-in alternative to :class:`sao_megatron.data.episode.EpisodeFormatter` for pretrained
instruct models (the marker format stays for the from-scratch path): same methods
(``new_episode``, ``action_text``, ``action_ids``, ``is_complete_action``, ``stop_token_ids``,
``prompt_ids``, ``observation_ids``, ``context_ids``, ``episode_text``) and the same
:class:`~sao_megatron.data.episode.EpisodeBuilder` protocol, so the rollout runner, the
evaluation and the demonstrations use it unchanged.

Messages of an episode::

    [system: system_prompt]            (omitted when ""; the template may add its default)
    user|tool: observation_0
    assistant: action_0
    user|tool: observation_1
    ...

Token layout with ``history="append"`` (the default, full history, one sequence per episode):

* prompt (node 0) = ``encode(render(messages[:obs_0], add_generation_prompt=True))``.
* action n = the sampled ids; the template's assistant end-of-turn token (``<|im_end|>`` for
  ChatML templates such as SmolLM2's) is the stop token, so the action ends with it.
* observation n >= 1 = ``encode(delta)``, where ``delta`` is the text the template adds after
  that end-of-turn token to render the next message and the next generation prompt (for ChatML:
  ``"\\n<|im_start|>user\\n{obs}<|im_end|>\\n<|im_start|>assistant\\n"``). Only this delta is
  tokenised; earlier tokens are never re-tokenised.

Then ``prompt + act_0 + obs_1 + act_1 + ...`` is ``apply_chat_template`` of the whole
conversation (``tests/data/test_chat_format.py`` checks it with the real SmolLM2 tokenizer),
provided the sampled ids of each action are the tokenisation of its text (true for the
template's own tokenisation; a model can sample a non-canonical one, which stays as sampled).

Prefix stability. Appending deltas is only right when rendering the conversation with one more
message extends the previous rendering. Templates that rewrite history (for instance ones that
drop the reasoning blocks of earlier assistant turns) are not; every append is checked against
a full rendering (a string comparison), and a mismatch raises a ``ValueError`` naming
``episode.history='rerender'``. In that mode each turn's prompt is the template's rendering of
the whole conversation so far, re-tokenised, and each node is trained on its own prompt
(``Trajectory.context_mode == "window"``, one sequence per node: more tokens, exact prompts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sao_megatron.data.episode import EpisodeBuilder, EpisodeFormatConfig, EpisodeFormatter
from sao_megatron.data.marker_chat import MarkerChatTokenizer
from sao_megatron.data.tokenizer import SentencePieceTokenizer

HISTORY_MODES = ("append", "rerender")
OBSERVATION_ROLES = ("user", "tool")
_PROBE = "\x00sao-probe\x00"


@dataclass(kw_only=True)
class ChatFormatConfig:
    """How episodes are rendered with a chat template.

    Fields:
        format: ``"chat_template"`` (the tag a job config selects this formatter with).
        tokenizer_path: HF folder whose tokenizer (and ``chat_template``) renders the episodes;
            the model's own folder. None: use the tokenizer object passed to the formatter.
        system_prompt: content of a leading system message ("" for none: the template may then
            insert its default system prompt, as SmolLM2's does).
        observation_role: chat role of the environment's messages, ``"user"`` or ``"tool"``.
        history: ``"append"`` (token-in/token-out, needs a prefix-stable template) or
            ``"rerender"`` (each prompt rendered whole; for templates that rewrite history).
    """

    format: str = "chat_template"
    tokenizer_path: str | None = None
    system_prompt: str = ""
    observation_role: str = "user"
    history: str = "append"

    def __post_init__(self) -> None:
        if self.format != "chat_template":
            raise ValueError(
                f"episode.format={self.format!r}: ChatFormatConfig needs 'chat_template'"
            )
        if self.observation_role not in OBSERVATION_ROLES:
            raise ValueError(
                f"episode.observation_role={self.observation_role!r}: use one of "
                f"{OBSERVATION_ROLES}"
            )
        if self.history not in HISTORY_MODES:
            raise ValueError(f"episode.history={self.history!r}: use one of {HISTORY_MODES}")

    @property
    def context_mode(self) -> str:
        """The `Trajectory` context mode this history mode produces."""
        return "full_history" if self.history == "append" else "window"


class ChatTemplateFormatter:
    """Episodes as chat messages rendered by ``tokenizer``'s chat template (see module docstring).

    Args:
        tokenizer: a :class:`sao_megatron.data.tokenizer.HFTokenizer` or a transformers
            tokenizer with a ``chat_template``; None loads ``config.tokenizer_path``.
        config: the format; default ``ChatFormatConfig()``.

    Attributes:
        stop_token_ids: [the assistant end-of-turn id] plus eos if different; pass them to the
            engine (``rollout.stop_token_ids`` are added by the manager as for the marker format).
        stop_strings: [end-of-turn text].
        end_of_turn: the end-of-turn text (e.g. ``"<|im_end|>"``).

    Raises:
        ValueError: no chat template, or the template does not end assistant turns with one
            special token (nothing to stop on); names the field to change.
    """

    def __init__(self, tokenizer: Any = None, config: ChatFormatConfig | None = None) -> None:
        self.config = config or ChatFormatConfig()
        if tokenizer is None:
            if not self.config.tokenizer_path:
                raise ValueError(
                    "ChatFormatConfig.tokenizer_path is None and no tokenizer was given: set it to "
                    "the model's HF folder (e.g. .cache/models/SmolLM2-135M-Instruct)"
                )
            from sao_megatron.data.tokenizer import HFTokenizer

            tokenizer = HFTokenizer(self.config.tokenizer_path)
        self.tokenizer = tokenizer
        self.hf = getattr(tokenizer, "tok", tokenizer)  # the transformers tokenizer
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(
                f"tokenizer {getattr(self.hf, 'name_or_path', '')!r} has no chat_template: use "
                "episode.format='markers' (the EpisodeFormatter) or a tokenizer with a template"
            )
        self.end_of_turn, self._after_turn = self._assistant_turn_end()
        self.end_of_turn_id = int(self.hf.convert_tokens_to_ids(self.end_of_turn))
        eos = self.hf.eos_token_id
        self.stop_token_ids: list[int] = [self.end_of_turn_id] + (
            [int(eos)] if eos is not None and eos != self.end_of_turn_id else []
        )
        self.stop_strings: list[str] = [self.end_of_turn]

    # ------------------------------------------------------------------ rendering
    def render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        """The template's text for ``messages`` (with the assistant generation prompt or not)."""
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text: special tokens in it are parsed, nothing is added."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def messages(self, observations: list[str], actions: list[str]) -> list[dict[str, str]]:
        """Chat messages of an episode: observations[n] precedes actions[n]."""
        if len(observations) not in (len(actions), len(actions) + 1):
            raise ValueError(f"{len(observations)} observations for {len(actions)} actions")
        system = self.config.system_prompt
        out = [{"role": "system", "content": system}] if system else []
        for n, obs in enumerate(observations):
            out.append({"role": self.config.observation_role, "content": obs})
            if n < len(actions):
                out.append({"role": "assistant", "content": actions[n]})
        return out

    def _assistant_turn_end(self) -> tuple[str, str]:
        """(end-of-turn special token text, the template's text after it) of assistant turns."""
        user = [{"role": self.config.observation_role, "content": "x"}]
        text = self.render(
            [*user, {"role": "assistant", "content": _PROBE}], generation_prompt=False
        )
        tail = text[text.rindex(_PROBE) + len(_PROBE) :]
        ids = self.encode(tail)
        special = set(self.hf.all_special_ids)
        if not ids or ids[0] not in special:
            raise ValueError(
                f"the chat template ends assistant turns with {tail!r}, which does not start with "
                "one special token: nothing to stop generation on; use episode.format='markers'"
            )
        first = self.hf.convert_ids_to_tokens(ids[0])
        if not tail.startswith(first):
            raise ValueError(f"cannot locate the end-of-turn token {first!r} in {tail!r}")
        return first, tail[len(first) :]

    # ------------------------------------------------------------------ EpisodeFormatter API
    def prompt_ids(self, first_observation: str) -> list[int]:
        """Node 0's tokens: the rendered system + first observation + generation prompt."""
        return self.encode(
            self.render(self.messages([first_observation], []), generation_prompt=True)
        )

    def observation_delta(
        self, observations: list[str], actions: list[str], *, action_complete: bool = True
    ) -> str:
        """Text appended after ``actions[-1]``'s sampled tokens to show ``observations[-1]``.

        ``observations`` has one more entry than ``actions`` (the new observation last).

        Raises:
            ValueError: the template is not prefix-stable here (names ``episode.history``).
        """
        before = self.render(self.messages(observations[:-1], actions), generation_prompt=False)
        after = self.render(self.messages(observations, actions), generation_prompt=True)
        prompt = self.render(self.messages(observations[:-1], actions[:-1]), generation_prompt=True)
        sampled = prompt + actions[-1] + self.end_of_turn + self._after_turn
        if before != sampled:
            raise ValueError(
                "the chat template renders an assistant turn differently from its generation "
                f"prompt + the sampled text + {self.end_of_turn!r} (rendered tail "
                f"{before[-60:]!r}, sampled tail {sampled[-60:]!r}): appending tokens would not "
                "match it. Set episode.history='rerender' (each prompt rendered whole)"
            )
        if not after.startswith(before):
            raise ValueError(
                "the chat template is not prefix-stable: rendering one more message changes the "
                f"earlier text (it starts {after[: len(before)][-60:]!r}, expected "
                f"{before[-60:]!r}), e.g. it drops earlier reasoning blocks. Set "
                "episode.history='rerender' (each prompt rendered whole, one sequence per node)"
            )
        lead = self._after_turn if action_complete else self.end_of_turn + self._after_turn
        return lead + after[len(before) :]

    def observation_ids(self, observation: str, history: tuple[list[str], list[str]] | None = None):
        """Tokens of a later observation's delta. ``history`` = (observations so far, actions so
        far); without it the delta is rendered after a one-turn stand-in conversation, which is
        right for templates that render each message independently of the others (ChatML)."""
        observations, actions = history or (["x"], ["x"])
        return self.encode(self.observation_delta([*observations, observation], actions))

    def action_ids(self, action: str) -> list[int]:
        """Tokens of an action text plus the end-of-turn token, as the policy should emit them
        (demonstrations; RL actions are the sampled ids, never re-tokenised)."""
        return self.encode(action) + [self.end_of_turn_id]

    def action_text(self, action_ids: list[int]) -> str:
        """Decoded action without its trailing stop token: the text passed to ``env.step``."""
        ids = list(action_ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return self.hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def is_complete_action(self, action_ids: list[int]) -> bool:
        """True if the action ended on a stop token (False: cut by the engine's token limit)."""
        return bool(action_ids) and action_ids[-1] in self.stop_token_ids

    def context_ids(
        self, observation_ids: list[list[int]], action_ids: list[list[int]]
    ) -> list[int]:
        """Full-history prompt: observation_ids[0..n] interleaved with action_ids[0..n-1]."""
        n = len(action_ids)
        if len(observation_ids) != n + 1:
            raise ValueError(
                f"need {n + 1} observations before action {n}, got {len(observation_ids)}"
            )
        out = list(observation_ids[0])
        for j in range(n):
            out += action_ids[j] + observation_ids[j + 1]
        return out

    def episode_text(self, observations: list[str], actions: list[str]) -> str:
        """The template's text of an episode (generation prompt when an action is due)."""
        due = len(observations) > len(actions)
        return self.render(self.messages(observations, actions), generation_prompt=due)

    def new_episode(self, task_id: str, first_observation: str) -> ChatEpisodeBuilder:
        """Start recording an episode whose reset() returned ``first_observation``."""
        return ChatEpisodeBuilder(self, task_id, first_observation)


class ChatEpisodeBuilder(EpisodeBuilder):
    """:class:`EpisodeBuilder` for chat episodes: observation deltas rendered with the whole
    conversation's texts (``append``), or every prompt rendered whole (``rerender``).
    ``to_trajectory`` / ``to_sft_sequences`` are the base class's: ``window`` context mode (one
    sequence per node) in ``rerender`` history, one sequence per episode in ``append``."""

    formatter: ChatTemplateFormatter

    def next_context_ids(self) -> list[int]:
        """Prompt ids for the next action: the appended stream, or a fresh rendering."""
        if self.formatter.config.history == "append":
            return super().next_context_ids()
        if len(self.observation_ids) != len(self.action_ids) + 1:
            raise RuntimeError("next_context_ids(): add the observation of the last step first")
        texts = [self.formatter.action_text(a) for a in self.action_ids]
        return self.formatter.encode(
            self.formatter.render(
                self.formatter.messages(self.observations, texts), generation_prompt=True
            )
        )

    def add_observation(self, observation: str) -> None:
        """Record the observation after the last action: its delta tokens are appended."""
        if len(self.observation_ids) != len(self.action_ids):
            raise RuntimeError("add_observation(): add the action of this step first")
        f = self.formatter
        texts = [f.action_text(a) for a in self.action_ids]
        if f.config.history == "append":
            complete = f.is_complete_action(self.action_ids[-1])
            delta = f.observation_delta(
                [*self.observations, observation], texts, action_complete=complete
            )
        else:  # informational: the text the new message adds (prompts are rendered whole)
            before = f.render(f.messages(self.observations, texts), generation_prompt=False)
            after = f.render(
                f.messages([*self.observations, observation], texts), generation_prompt=True
            )
            delta = after[len(before) :] if after.startswith(before) else after
        self.observations.append(observation)
        self.observation_ids.append(f.encode(delta))


def build_formatter(tokenizer: Any, config: EpisodeFormatConfig):
    """The episode formatter a job's ``episode`` section selects: the marker `EpisodeFormatter`
    (``episode.format=markers``) or a `ChatTemplateFormatter` over the job's tokenizer
    (``episode.format=chat_template``; raises ValueError if the tokenizer has no chat template).

    A sentencepiece tokenizer (the from-scratch path, no chat template of its own) gets the
    episode-marker chat template (`sao_megatron.data.marker_chat.MARKER_CHAT_TEMPLATE`).
    """
    if config.format == "markers":
        return EpisodeFormatter(tokenizer, config)
    if isinstance(tokenizer, SentencePieceTokenizer):
        tokenizer = MarkerChatTokenizer(tokenizer)
    chat = ChatFormatConfig(
        system_prompt=config.system_prompt,
        observation_role=config.observation_role,
        history=config.history,
    )
    return ChatTemplateFormatter(tokenizer, chat)
