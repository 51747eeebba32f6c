"""OpenAI chat ``logprobs`` of a gateway reply: the recorded behaviour log-probs, per token.

``logprobs=true`` on ``/v1/chat/completions`` returns ``{"content": [{"token", "logprob",
"bytes", "top_logprobs": []}, ...], "refusal": None}``: one entry per sampled token, stop token
included, with exactly the log-prob recorded on the trajectory's `ActionNode` (the engine's
log-prob of the distribution it sampled from: ``rollout.temperature`` / ``top_p``, not the
agent's). ``token`` is the token decoded alone (a character split across tokens decodes to
U+FFFD, as in vLLM); ``bytes`` are its exact bytes (byte-level BPE tokens map back to their raw
bytes), so the joined bytes of a reply are its UTF-8 text. The engine returns only the sampled
token's log-prob, so ``top_logprobs > 0`` is refused.
"""

from __future__ import annotations

from typing import Any

from sao_megatron.rollout.gateway.rendering import RequestError


def requested_logprobs(body: dict) -> bool:
    """True if the request asks for ``logprobs``. Raises RequestError naming the parameter
    when ``logprobs`` is not a boolean or ``top_logprobs`` is not 0 / absent."""
    want = body.get("logprobs")
    if want is not None and not isinstance(want, bool):
        raise RequestError(f"logprobs={want!r}: must be true or false")
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
        raise RequestError(f"top_logprobs={top!r}: must be a non-negative integer")
    if top:
        raise RequestError(
            f"top_logprobs={top} is not supported by the RL gateway: the engine returns only "
            "the sampled token's log-prob; omit top_logprobs (or send 0) and use logprobs=true"
        )
    return bool(want)


def chat_logprobs(hf: Any, token_ids: list[int], logprobs: list[float]) -> dict:
    """The choice's ``logprobs`` object for sampled `token_ids` with their `logprobs`.

    hf: the transformers tokenizer (`ChatTemplateFormatter.hf`)."""
    to_bytes = _token_bytes(hf)
    content = []
    for i, lp in zip(token_ids, logprobs, strict=True):
        token = hf.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        raw = to_bytes(i, token)
        content.append({"token": token, "logprob": lp, "bytes": list(raw), "top_logprobs": []})
    return {"content": content, "refusal": None}


def _token_bytes(hf: Any):
    """(token id, decoded text) -> the token's bytes: the raw bytes of a byte-level BPE token,
    else (added tokens, sentencepiece) the UTF-8 of its decoded text."""
    backend = getattr(hf, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    added = set(getattr(hf, "added_tokens_decoder", {}) or {})
    if type(decoder).__name__ != "ByteLevel":
        return lambda i, token: token.encode("utf-8")
    inverse = {c: b for b, c in _bytes_to_unicode().items()}

    def to_bytes(i: int, token: str) -> bytes:
        piece = hf.convert_ids_to_tokens(i)
        if i in added or not all(c in inverse for c in piece):
            return token.encode("utf-8")
        return bytes(inverse[c] for c in piece)

    return to_bytes


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table of byte-level BPE vocabularies."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    keep |= set(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table
