"""A multi-turn tool-calling agent written against the OpenAI chat-completions API.

Nothing here knows about RL: ``run(task, client)`` is ordinary OpenAI-SDK agent code (it would
run unchanged against any OpenAI-compatible server). Trained with sao_megatron, ``client`` is an
``openai.AsyncOpenAI`` pointed at the rollout's gateway, which records every token the model
generates; the returned float is the episode's reward. See docs/AGENTS.md.

The task: evaluate ``(a * b) + c`` with the ``calculator`` tool, then answer ``ANSWER: <n>``.
``demonstrate(task)`` is the gold conversation of a task, for the SFT warm-up before RL.

    environment = AgentEnvironment(run, make_task, name="calculator")
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re

MAX_EXPRESSION_CHARS = 200
MAX_NODES = 64
MAX_ABS_VALUE = 1e15  # any operand or intermediate result
MAX_EXPONENT = 64
MAX_TURNS = 6

SYSTEM_PROMPT = (
    "You are a careful assistant. Use the calculator tool for arithmetic, then reply with "
    "'ANSWER: <number>'."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression: numbers and + - * / ** ( ).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be evaluated (shown to the model as the result)."""


def safe_eval(expression: str) -> int | float:
    """Evaluate an arithmetic expression safely: an AST walk over numbers, ``+ - * / **`` and
    unary ``+ -`` only (no names, calls, attributes, subscripts or other syntax).

    Limits: at most MAX_EXPRESSION_CHARS characters and MAX_NODES AST nodes; every operand and
    intermediate result within +-MAX_ABS_VALUE; exponents within +-MAX_EXPONENT (so ``9**9**9``
    is refused before it is computed). Raises CalculatorError.
    """
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"syntax error: {e.msg}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"expression has more than {MAX_NODES} parts")

    def check(x: int | float) -> int | float:
        if abs(x) > MAX_ABS_VALUE:
            raise CalculatorError(f"value {x:.3g} exceeds {MAX_ABS_VALUE:.0e}")
        return x

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, int | float):
                raise CalculatorError(f"only numbers are allowed, got {node.value!r}")
            return check(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return check(_UNARY[type(node.op)](ev(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise CalculatorError(f"exponent {right} exceeds {MAX_EXPONENT}")
            if isinstance(node.op, ast.Pow) and left == 0 and right < 0:
                raise CalculatorError("zero to a negative power")
            try:
                value = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            except OverflowError:
                raise CalculatorError("overflow") from None
            if isinstance(value, complex):
                raise CalculatorError("complex result")
            return check(value)
        raise CalculatorError(f"{type(node).__name__} is not allowed")

    return ev(tree)


def make_task(seed: int) -> dict:
    """Task of one seed: {"question": str, "answer": int}."""
    rng = random.Random(seed)
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(1, 999)
    return {"question": f"What is ({a} * {b}) + {c}?", "answer": a * b + c}


QUESTION_RE = re.compile(r"What is (.+)\?")


def demonstrate(task: dict) -> dict:
    """The gold conversation of a task (the SFT warm-up's data, docs/AGENTS.md): one calculator
    call with the question's expression, its result, ``ANSWER: <result>``. In the record format
    of OpenAI's chat fine-tuning files; the tool-call id is the one the gateway gives the
    model's first call (``call_0_0``), so the agent's own messages match it exactly."""
    expression = QUESTION_RE.fullmatch(task["question"]).group(1)
    arguments = json.dumps({"expression": expression})
    result = run_tool("calculator", arguments)
    call = {"id": "call_0_0", "type": "function"}
    call["function"] = {"name": "calculator", "arguments": arguments}
    return {
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": task["question"]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": result},
            {"role": "assistant", "content": f"ANSWER: {result}"},
        ],
        "tools": TOOLS,
    }


ANSWER_RE = re.compile(r"ANSWER:\s*(-?\d+(?:\.\d+)?)")
REMINDER = "Give your final answer as 'ANSWER: <number>'."


def score(text: str | None, answer: int) -> float:
    """1.0 if the text holds ``ANSWER: <answer>``, else 0.0."""
    m = ANSWER_RE.search(text or "")
    return 1.0 if m is not None and float(m.group(1)) == answer else 0.0


def run_tool(name: str, arguments: str) -> str:
    """The result text of one tool call (errors are results too: the model sees them)."""
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    try:
        args = json.loads(arguments)
        return str(safe_eval(args["expression"]))
    except (CalculatorError, KeyError, TypeError, ValueError) as e:
        return f"error: {e}"


async def run(task: dict, client) -> float:
    """The agent: ask, execute the calculator calls the model makes, score the final answer.

    A reply with neither a tool call nor ``ANSWER:`` gets one reminder of the answer format
    (`REMINDER`) before it is scored."""
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task["question"]},
    ]
    reminded = False
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=96
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                result = run_tool(call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            continue
        if reminded or ANSWER_RE.search(message.content or ""):
            return score(message.content, task["answer"])
        messages.append({"role": "user", "content": REMINDER})
        reminded = True
    return 0.0
