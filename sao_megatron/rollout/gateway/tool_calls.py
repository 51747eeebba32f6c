"""The tool-call convention of the gateway: ``<tool_call>{json}</tool_call>`` blocks in the
assistant's text <-> OpenAI ``tool_calls`` (the Hermes/Qwen format; SmolLM2's template has none).

A block counts when its body is a JSON object with a string ``name`` and an object
``arguments``; it becomes a ``tool_calls`` entry and is removed from ``content``. A malformed
block stays in the text. `TOOL_PROMPT` tells a model whose template does not render ``tools``
how to call them (the gateway appends it to the system message).
"""

from __future__ import annotations

import json
import re

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

TOOL_PROMPT = (
    "You can call tools. To call one, reply with exactly\n"
    "<tool_call>\n"
    '{{"name": <tool name>, "arguments": <JSON object of arguments>}}\n'
    "</tool_call>\n"
    "and wait for its result. Available tools (JSON schemas):\n{tools}"
)


def parse_tool_calls(text: str, id_prefix: str = "call") -> tuple[str, list[dict]]:
    """Split assistant text into (content without the tool-call blocks, OpenAI ``tool_calls``).

    A block counts when its body is a JSON object with ``name`` (str) and ``arguments`` (an
    object, or a string holding one); otherwise it stays in the content. ``tool_calls[k]`` is
    ``{"id": f"{id_prefix}_{k}", "type": "function", "function": {"name", "arguments": JSON
    string}}``.
    """
    calls: list[dict] = []

    def take(m: re.Match) -> str:
        try:
            obj = json.loads(m.group(1))
            args = obj["arguments"]
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(obj["name"], str) or not isinstance(args, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return m.group(0)
        calls.append(
            {
                "id": f"{id_prefix}_{len(calls)}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(args)},
            }
        )
        return ""

    content = TOOL_CALL_RE.sub(take, text)
    return (content.strip() if calls else content), calls


def tool_call_text(calls: list[dict]) -> str:
    """The convention's text of OpenAI ``tool_calls`` (to render agent-supplied assistant turns
    of a first request)."""
    out = []
    for c in calls:
        f = c.get("function", c)
        args = f.get("arguments", {})
        args = json.loads(args) if isinstance(args, str) else args
        out.append(
            f"<tool_call>\n{json.dumps({'name': f['name'], 'arguments': args})}\n</tool_call>"
        )
    return "\n".join(out)
