"""Chat-template episodes with the real SmolLM2 tokenizer: the appended token stream equals
apply_chat_template of the whole conversation, earlier tokens never change, the end-of-turn
token stops generation, non-prefix-stable templates are refused (and work in 'rerender')."""

import asyncio
from dataclasses import dataclass

import pytest

from sao_megatron.data.chat_format import ChatFormatConfig, ChatTemplateFormatter
from sao_megatron.data.tokenizer import HFTokenizer

# The 3-turn conversation: (observation, action) pairs.
TURNS = [
    ("What is 12 + 7? Answer with a number.", "19"),
    ("Correct. Now add 5 to it.", "19 + 5 = 24"),
    ("And double that?", "48 \n"),  # trailing whitespace stays as it is
]
NEXT = "Well done."

# Drops the reasoning of earlier assistant turns (like templates of reasoning models): rendering
# one more message rewrites the previous assistant turn, so appending deltas is wrong.
DROP_THINK = (
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1] %}"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ c }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A prefix-stable template with another generation prompt and end-of-turn token (no text after
# it), to exercise the general path: stop ids are [<|endoftext|>, eos].
PLAIN = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|endoftext|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def smollm2_tok_dir(tmp_path_factory):
    """The real SmolLM2 tokenizer (rebuilt from the installed GGUF; no model weights needed)."""
    from sao_megatron.convert.pretrained import find_smollm2_gguf, tokenizer_from_gguf

    try:
        gguf = find_smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.fail(f"{exc} (make install does it)")
    out = tmp_path_factory.mktemp("smollm2_tok")
    tokenizer_from_gguf(gguf).save_pretrained(out)
    return out


def tokenizer(directory, template=None) -> HFTokenizer:
    tok = HFTokenizer(str(directory))
    if template is not None:
        tok.tok.chat_template = template
    return tok


def play(formatter, turns=TURNS, next_obs=NEXT):
    """Record an episode with canonical action ids (what a model emitting the template's
    tokenisation samples); returns (builder, contexts seen before each action)."""
    builder = formatter.new_episode("t0", turns[0][0])
    contexts = []
    for n, (_, action) in enumerate(turns):
        contexts.append(builder.next_context_ids())
        ids = formatter.action_ids(action)
        builder.add_action(ids, [-0.5] * len(ids), [0] * len(ids), reward=float(n))
        following = turns[n + 1][0] if n + 1 < len(turns) else next_obs
        builder.add_observation(following)
    contexts.append(builder.next_context_ids())
    return builder, contexts


def conversation(system, observations, actions):
    msgs = [{"role": "system", "content": system}] if system else []
    for n, obs in enumerate(observations):
        msgs.append({"role": "user", "content": obs})
        if n < len(actions):
            msgs.append({"role": "assistant", "content": actions[n]})
    return msgs


@pytest.mark.parametrize("system", ["You are a careful calculator.", ""])
def test_stream_equals_apply_chat_template(smollm2_tok_dir, system):
    tok = tokenizer(smollm2_tok_dir)
    f = ChatTemplateFormatter(tok, ChatFormatConfig(system_prompt=system))
    assert (f.end_of_turn, f.stop_token_ids) == ("<|im_end|>", [2])  # <|im_end|> is also eos
    builder, contexts = play(f)
    observations = [o for o, _ in TURNS] + [NEXT]
    actions = [a for _, a in TURNS]
    for n, ctx in enumerate(contexts):  # before action n: the template's generation prompt
        msgs = conversation(system, observations[: n + 1], actions[:n])
        expected = tok.tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        assert ctx == list(expected), n
        if n:  # token-in/token-out: the earlier prompt is a prefix, never re-tokenised
            assert ctx[: len(contexts[n - 1])] == contexts[n - 1]
    text = tok.decode(contexts[-1])
    assert text.endswith("<|im_start|>user\nWell done.<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n" + (system or "You are a helpful AI assistant"))
    # each action ends with the stop token and decodes to the env's text
    traj = builder.to_trajectory(terminated=True, truncated=False)
    assert traj.context_mode == "full_history"
    assert [n.action_token_ids[-1] for n in traj.nodes] == [2, 2, 2]
    assert [n.action_text for n in traj.nodes] == actions
    assert [n.reward for n in traj.nodes] == [0.0, 1.0, 2.0]
    # the trained sequence is the template's rendering of the 3-turn conversation (minus the
    # "\n" the template puts after the last <|im_end|>, which the model never samples)
    full = tok.tok.apply_chat_template(conversation(system, observations[:3], actions))
    seq = traj.to_token_sequence()
    assert seq.token_ids.tolist() + tok.encode("\n") == list(full)
    assert tok.decode(seq.token_ids[seq.action_mask].tolist()) == "".join(
        a + "<|im_end|>" for a in actions
    )


def test_sampled_ids_are_kept_as_sampled(smollm2_tok_dir):
    """Token-in/token-out: an action whose text re-tokenises differently in context (leading
    spaces merge with the template's preceding newline) keeps its sampled ids in the stream."""
    tok = tokenizer(smollm2_tok_dir)
    f = ChatTemplateFormatter(tok)
    builder = f.new_episode("t", "Say 48 with two spaces first.")
    sampled = f.action_ids("  48")
    prompt = builder.next_context_ids()
    builder.add_action(sampled)
    builder.add_observation("Thanks.")
    context = builder.next_context_ids()
    assert context[len(prompt) : len(prompt) + len(sampled)] == sampled
    msgs = conversation("", ["Say 48 with two spaces first.", "Thanks."], ["  48"])
    retokenised = tok.tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    assert context != list(retokenised)  # the template's tokenisation of the same text differs
    assert tok.decode(context) == tok.decode(list(retokenised))  # but the text is the same


def test_tool_role_and_other_template(smollm2_tok_dir):
    tok = tokenizer(smollm2_tok_dir, PLAIN)
    f = ChatTemplateFormatter(tok, ChatFormatConfig(observation_role="tool"))
    assert f.end_of_turn == "<|endoftext|>" and f.stop_token_ids == [0, 2]
    builder, contexts = play(f)
    msgs = [
        {"role": "tool" if m["role"] == "user" else m["role"], "content": m["content"]}
        for m in conversation("", [o for o, _ in TURNS] + [NEXT], [a for _, a in TURNS])
    ]
    assert contexts[-1] == list(
        tok.tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    )
    assert tok.decode(contexts[0]).endswith("<|endoftext|><|im_start|>assistant: ")


def test_cut_action_gets_its_end_of_turn(smollm2_tok_dir):
    """An action cut by the token limit (no stop token): the delta supplies <|im_end|>."""
    tok = tokenizer(smollm2_tok_dir)
    f = ChatTemplateFormatter(tok)
    builder = f.new_episode("t", "Count to three.")
    cut = tok.encode("1, 2,")
    assert not f.is_complete_action(cut)
    builder.add_action(cut, [-1.0] * len(cut), [0] * len(cut))
    builder.add_observation("Go on.")
    msgs = conversation("", ["Count to three.", "Go on."], ["1, 2,"])
    assert builder.next_context_ids() == list(
        tok.tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    )


def test_not_prefix_stable_template_is_refused_then_rerendered(smollm2_tok_dir):
    tok = tokenizer(smollm2_tok_dir, DROP_THINK)
    turns = [("Add 2 and 3.", "<think>2+3=5</think>5"), ("Times 2?", "<think>5*2</think>10")]
    f = ChatTemplateFormatter(tok)
    builder = f.new_episode("t", turns[0][0])
    builder.add_action(f.action_ids(turns[0][1]))
    with pytest.raises(ValueError, match=r"not prefix-stable.*episode\.history='rerender'"):
        builder.add_observation(turns[1][0])

    f = ChatTemplateFormatter(tok, ChatFormatConfig(history="rerender"))
    builder, contexts = play(f, turns, "Done.")
    observations, actions = [o for o, _ in turns] + ["Done."], [a for _, a in turns]
    for n, ctx in enumerate(contexts):
        msgs = conversation("", observations[: n + 1], actions[:n])
        assert ctx == list(
            tok.tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        )
    assert "<think>" not in tok.decode(contexts[-1])  # the template dropped both think blocks
    traj = builder.to_trajectory(terminated=True, truncated=False)
    assert traj.context_mode == "window"
    assert [n.context_token_ids for n in traj.nodes] == contexts[:2]
    seqs = builder.to_sft_sequences()
    assert [s.token_ids.tolist() for s in seqs] == [
        contexts[i] + f.action_ids(actions[i]) for i in range(2)
    ]


def test_assistant_rendering_must_match_sampled_text(smollm2_tok_dir):
    """A template that trims assistant content cannot be appended to token by token."""
    trim = tokenizer(smollm2_tok_dir).tok.chat_template.replace(
        "message['content']", "(message['content'] | trim)"
    )
    f = ChatTemplateFormatter(tokenizer(smollm2_tok_dir, trim))
    builder = f.new_episode("t", "Hi")
    builder.add_action(f.action_ids(" hello "))
    with pytest.raises(ValueError, match=r"renders an assistant turn differently.*rerender"):
        builder.add_observation("again")


def test_config_errors(smollm2_tok_dir):
    with pytest.raises(ValueError, match="episode.history='full'"):
        ChatFormatConfig(history="full")
    with pytest.raises(ValueError, match="episode.observation_role='env'"):
        ChatFormatConfig(observation_role="env")
    with pytest.raises(ValueError, match="ChatFormatConfig.tokenizer_path is None"):
        ChatTemplateFormatter(None, ChatFormatConfig())
    with pytest.raises(ValueError, match="has no chat_template"):
        ChatTemplateFormatter(tokenizer(smollm2_tok_dir, ""))
    f = ChatTemplateFormatter(None, ChatFormatConfig(tokenizer_path=str(smollm2_tok_dir)))
    assert f.stop_token_ids == [2]


@dataclass
class _Step:
    observation: str
    reward: float
    done: bool
    truncated: bool = False
    info: dict | None = None


class _ThreeQuestions:
    """A 3-turn environment: asks TURNS' questions, reward 1 per expected answer."""

    name = "three_questions"
    max_steps = 3

    def reset(self, seed: int) -> str:
        self.turn = 0
        return TURNS[0][0]

    def step(self, action: str) -> _Step:
        reward = float(action == TURNS[self.turn][1])
        self.turn += 1
        done = self.turn == len(TURNS)
        return _Step("" if done else TURNS[self.turn][0], reward, done)


def test_drop_in_for_the_rollout_runner(smollm2_tok_dir):
    """run_episode drives the chat formatter exactly like the marker formatter."""
    from sao_megatron.rollout.config import RolloutConfig
    from sao_megatron.rollout.engine import Generation
    from sao_megatron.rollout.runner import run_episode

    tok = tokenizer(smollm2_tok_dir)
    f = ChatTemplateFormatter(tok)
    prompts = []

    async def generate(episode_id, prompt, max_tokens, seed):
        prompts.append(prompt)
        ids = f.action_ids(TURNS[len(prompts) - 1][1])
        return Generation(ids, [-0.1] * len(ids), [3] * len(ids), "stop")

    traj = asyncio.run(
        run_episode(
            env=_ThreeQuestions(),
            seed=0,
            task_id="q",
            formatter=f,
            generate=generate,
            config=RolloutConfig(max_model_len=1024, max_tokens_per_action=16),
        )
    )
    assert traj.terminated and [n.reward for n in traj.nodes] == [1.0, 1.0, 1.0]
    msgs = conversation("", [o for o, _ in TURNS], [a for _, a in TURNS[:2]])
    assert prompts[-1] == list(
        tok.tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    )
