"""A chat template for the from-scratch sentencepiece tokenizer: chat messages in the episode
marker layout, so agents (the OpenAI-compatible gateway) and ``episode.format=chat_template``
work with the tiny models trained from scratch.

The trained tokenizer (`sao_megatron.data.tokenizer.train_sentencepiece`) has no chat template;
it has the episode markers ``<|obs|>``, ``<|act|>``, ``<|eoa|>`` as single tokens. The least
surprising template for it is the marker format of `sao_megatron.data.episode` with the role
named after ``<|obs|>``::

    <|obs|>system\\n{system}<|obs|>user\\n{question}<|act|>{assistant reply}<|eoa|>
    <|obs|>tool\\n{result}<|act|>...          (one line: nothing between <|eoa|> and <|obs|>)

* every non-assistant message (system, user, tool) is ``<|obs|>{role}\\n{content}``;
* an assistant message is ``<|act|>{content}<|eoa|>``; ``<|eoa|>`` ends the turn (the stop
  token), nothing follows it;
* the generation prompt is ``<|act|>``.

No bos is added (the marker format's ``<s>`` is a control symbol that text cannot spell).
The template is prefix-stable (each message renders on its own), so the gateway's
token-in/token-out append works; it does not mention ``tools``, so the gateway puts
`TOOL_PROMPT` and the tools' schemas into the system message, as it does for SmolLM2.

`MarkerChatTokenizer` wraps a `SentencePieceTokenizer` with the subset of the transformers
tokenizer API that `ChatTemplateFormatter` and the gateway use (``apply_chat_template``,
``encode``/``decode``, special-token lookups); `build_formatter` applies it when a job with a
sentencepiece tokenizer selects ``episode.format=chat_template``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from sao_megatron.data.tokenizer import EPISODE_MARKERS, SentencePieceTokenizer

MARKER_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "<|act|>{{ message['content'] }}<|eoa|>"
    "{%- else -%}"
    "<|obs|>{{ message['role'] }}\n{{ message['content'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|act|>{%- endif -%}"
)


@lru_cache(maxsize=4)
def _compiled(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # the environment transformers renders chat templates with
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template)


def render_marker_chat(
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    template: str = MARKER_CHAT_TEMPLATE,
    **kwargs: Any,
) -> str:
    """The template's text of `messages` (no tokenizer needed: the tokenizer's own corpus is
    rendered with it before the tokenizer exists)."""
    return _compiled(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **kwargs
    )


class MarkerChatTokenizer:
    """A `SentencePieceTokenizer` with `MARKER_CHAT_TEMPLATE`, behind the transformers API
    subset the chat formatter and the gateway call.

    Special ids: pad, bos, eos, unk and the episode markers (user-defined symbols, matched in
    text by ``encode`` and decoded back to themselves). Raises ValueError if the tokenizer lacks
    a marker.
    """

    kind = "sentencepiece"

    def __init__(self, sp: SentencePieceTokenizer, template: str = MARKER_CHAT_TEMPLATE) -> None:
        self.sp = sp
        self.chat_template = template
        self.name_or_path = "sentencepiece (episode-marker chat template)"
        missing = [m for m in EPISODE_MARKERS if sp.token_to_id(m) is None]
        if missing:
            raise ValueError(
                f"the sentencepiece tokenizer lacks the episode markers {missing}: the marker "
                "chat template needs them (keep them in tokenizer.user_defined_symbols)"
            )
        self._marker_ids = {m: int(sp.token_to_id(m)) for m in EPISODE_MARKERS}
        self.eos_token_id = sp.eos_id
        self.bos_token_id = sp.bos_id
        self.pad_token_id = sp.pad_id
        self.vocab_size = sp.vocab_size
        control = [sp.pad_id, sp.bos_id, sp.eos_id, sp.sp.unk_id()]
        self.all_special_ids = sorted(
            {int(i) for i in control if i is not None} | set(self._marker_ids.values())
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ):
        """As transformers': the rendered text (``tokenize=False``) or its token ids."""
        text = render_marker_chat(
            messages, add_generation_prompt=add_generation_prompt, template=self.chat_template
        )
        return self.encode(text) if tokenize else text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; markers in it are single tokens; nothing is added."""
        return self.sp.encode(text)

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        """Text of `ids` (markers decode to themselves; sentencepiece drops control ids)."""
        return self.sp.decode(ids)

    def convert_tokens_to_ids(self, token: str) -> int:
        i = self.sp.token_to_id(token)
        if i is None:
            raise ValueError(f"{token!r} is not one token of the sentencepiece tokenizer")
        return int(i)

    def convert_ids_to_tokens(self, i: int) -> str:
        return self.sp.id_to_piece(int(i))
