"""GEM environments (gem-llm 0.1.0) through the `gem` adapter, unmodified: options checked when
the config loads, GEM's step mapped to our episode end / truncation / success, reproducible and
isolated RNG, episodes rendered by both chat templates (SmolLM2's and the marker one) and the
marker format token-in/token-out through the runner, solver demonstrations, the example
configs."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path

import numpy as np
import pytest

from sao_megatron.configs import load_config
from sao_megatron.data.chat_format import build_formatter
from sao_megatron.data.demonstrations import (
    DemonstrationConfig,
    demonstration_sequences,
    generate_demonstrations,
    run_demonstration,
    train_tokenizer_for_envs,
)
from sao_megatron.data.episode import EpisodeFormatConfig
from sao_megatron.data.tokenizer import HFTokenizer, TokenizerConfig
from sao_megatron.envs import EnvSpec, SupportsGoldAction, make_env
from sao_megatron.envs.gem import SolvedGemEnv
from sao_megatron.envs.gem_solvers import consistent_codes, pegs
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import Generation
from sao_megatron.rollout.runner import run_episode
from sao_megatron.trainer.evaluate import eval_seeds
from sao_megatron.trainer.job import JobConfig, TasksConfig
from sao_megatron.trainer.run_state import TaskStream

ROOT = Path(__file__).resolve().parents[2]
GUESS = "game:GuessTheNumber-v0-easy"
MASTERMIND = "game:Mastermind-v0-easy"
HANOI = "game:TowerofHanoi-v0-easy"


def scripted(formatter, policy, calls=None):
    """A stand-in engine: each action is `policy()`'s text tokenised as the model would emit it
    (stop token included), cut at max_tokens like vLLM; prompts are appended to `calls`."""

    async def generate(episode_id, prompt, max_tokens, seed):
        if calls is not None:
            calls.append(list(prompt))
        ids = formatter.action_ids(policy())
        reason = "stop"
        if len(ids) > max_tokens:
            ids, reason = ids[:max_tokens], "length"
        return Generation(ids, [-0.5] * len(ids), [0] * len(ids), reason)

    return generate


def play(env, formatter, seed, policy=None, calls=None, **rollout):
    """One episode through the runner; `policy` defaults to the env's solver."""
    cfg = RolloutConfig(**{"max_model_len": 4096, "max_tokens_per_action": 48, **rollout})
    gen = scripted(formatter, policy or env.gold_action, calls)
    return asyncio.run(
        run_episode(
            env=env, seed=seed, task_id=f"gem:{seed}", formatter=formatter, generate=gen, config=cfg
        )
    )


# ------------------------------------------------------------------ options at config load
def test_unknown_gem_id_fails_when_the_config_loads_with_close_matches():
    with pytest.raises(ValueError) as info:
        load_config(
            JobConfig,
            ROOT / "examples/configs/gem_guess_the_number.yaml",
            ["tasks.train=[{name: gem, options: {env_id: 'game:GuessTheNumber-v0-esay'}}]"],
        )
    assert str(info.value).startswith(
        "tasks.train[0].options.env_id='game:GuessTheNumber-v0-esay': not a GEM environment id; "
        "did you mean 'game:GuessTheNumber-v0-easy' or 'game:GuessTheNumber-v0-hard' or "
        "'game:GuessTheNumber-v0-random'?"
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"env_id": "game:Wordle-v0-easy"},
            "gem.env_id='game:Wordle-v0-easy': this GEM environment downloads the nltk 'words' "
            "corpus (nltk.download) when built, which an offline job cannot;",
        ),
        (
            {"env_id": "math:GSM8K"},
            "gem.env_id='math:GSM8K': this GEM environment loads the Hugging Face dataset "
            "'axon-rl/GSM-8k' at run time,",
        ),
        (
            {"env_id": "game:Crosswords-v0-easy"},
            "gem.env_id='game:Crosswords-v0-easy': GEM's class "
            "gem.envs.game_env.crosswords:CrosswordsEnv cannot be imported (ModuleNotFoundError: "
            "No module named 'pandas')",
        ),
        (
            {"env_id": "game:FifteenPuzzle-v0-random"},
            "gem.env_id='game:FifteenPuzzle-v0-random': GEM cannot build and reset this "
            "environment (kwargs {}): TypeError: unsupported operand",
        ),
        (
            {"env_id": GUESS, "kwargs": {"max_numbr": 20}},
            "gem.kwargs.max_numbr: not a parameter of GEM's GuessTheNumberEnv (GEM would ignore "
            "it silently); did you mean 'max_number'",
        ),
        ({"env_id": GUESS, "max_turns": 0}, "gem.max_turns=0: must be >= 1 (or null)"),
        ({}, "gem.env_id: required option of environment 'gem' is missing"),
        ({"env_id": GUESS, "max_turn": 3}, "gem.max_turn: unknown option of environment 'gem'"),
        (
            {"env_id": HANOI, "solver_reasoning": True},
            "gem.solver_reasoning=true: 'game:TowerofHanoi-v0-easy' has no solver that writes its "
            "reasoning (games with one: ['gem.envs.game_env.guess_the_number:GuessTheNumberEnv', "
            "'gem.envs.game_env.mastermind:MastermindEnv']); set it false",
        ),
    ],
)
def test_bad_options_name_the_field_and_the_fix(options, message):
    with pytest.raises(ValueError) as info:
        make_env("gem", **options)
    assert str(info.value).startswith(message), str(info.value)


def test_example_configs_load():
    for name, env_id in [
        ("gem_guess_the_number", GUESS),
        ("gem_mastermind", MASTERMIND),
    ]:
        job = load_config(JobConfig, ROOT / f"examples/configs/{name}.yaml")
        assert [(e.name, e.options["env_id"]) for e in job.tasks.train] == [("gem", env_id)]
        assert job.algorithm.name == "sao" and job.episode.format == "chat_template"
        assert [e.options["env_id"] for e in job.demonstrations.envs] == [env_id]
        assert isinstance(job.tasks.train[0].build(), SolvedGemEnv)


# ------------------------------------------------------------------ GEM's step, mapped
def test_reset_is_gems_first_turn_with_its_suffix_and_steps_map_terminated_and_success():
    env = make_env("gem", env_id=GUESS)
    first = env.reset(7)
    assert first.startswith("You are playing Guess The Number.\n")
    assert first.endswith("Enter your first guess to start the game.\nEnter your next guess.")
    assert env.max_steps == 4  # the easy variant's own max_turns
    secret = env.game.game_number
    wrong = 1 if secret != 1 else 2
    r = env.step(f"\\boxed{{{wrong}}}")
    hint = "higher" if wrong < secret else "lower"
    assert not r.done and not r.truncated and r.reward == 0.0
    assert r.observation == (
        f"At turn 1, you guessed {wrong}, and the target number is {hint} than {wrong}.\n"
        "Enter your next guess."
    )
    assert r.info["success"] is False and r.info["gem_return"] == 0.0
    r = env.step(f"my guess: \\boxed{{{secret}}}")
    assert r.done and not r.truncated and r.reward == 1.0 and r.observation == ""
    assert r.info["success"] is True and r.info["gem_terminated"] and not r.info["gem_truncated"]
    assert r.info["gem/final_observation"].startswith("Congratulations!")
    with pytest.raises(RuntimeError, match="finished episode"):
        env.step("\\boxed{3}")
    bare = make_env("gem", env_id=GUESS, include_suffix=False)
    assert bare.reset(7).endswith("Enter your first guess to start the game.\n")


def test_gems_turn_limit_is_terminal_and_not_a_success():
    """At GEM's own max_turns it sets terminated *and* truncated and pays a distance reward: the
    game is over, so the episode terminated (no bootstrap) and it is no success."""
    env = make_env("gem", env_id=GUESS)
    env.reset(3)
    secret = env.game.game_number
    wrong = [g for g in range(1, 11) if g != secret][:4]
    results = [env.step(f"\\boxed{{{g}}}") for g in wrong]
    last = results[-1]
    assert [r.done for r in results] == [False, False, False, True]
    assert not last.truncated and last.info["gem_truncated"] and last.info["gem_terminated"]
    assert last.reward == pytest.approx(1 - abs(wrong[-1] - secret) / 9)
    assert last.info["success"] is False


def test_invalid_and_malformed_actions_are_counted_in_the_evaluation_metrics():
    """GuessTheNumber: a guess out of range and a repeated guess are parsed but refused (GEM's
    invalid_action_reward is 0, like a valid step's), so they are counted from the game's
    previous_guesses; an unparsable reply ends the episode (malformed). The evaluation metrics
    pool the invalid turns over all turns of the episodes."""
    from sao_megatron.envs.base import episode_metrics

    env = make_env("gem", env_id=GUESS)
    env.reset(5)
    secret = env.game.game_number
    wrong = 1 if secret != 1 else 2
    steps = [env.step(a) for a in (f"\\boxed{{{wrong}}}", "\\boxed{11}", f"\\boxed{{{wrong}}}")]
    assert [r.info["gem_invalid_turns"] for r in steps] == [0, 1, 2]
    assert [r.reward for r in steps] == [0.0, 0.0, 0.0] and not any(r.done for r in steps)
    malformed = env.step("I think it is five")
    assert malformed.done and malformed.info["error"] == "malformed"
    assert malformed.info["gem_invalid_turns"] == 2 and malformed.info["num_turns"] == 4
    env.reset(6)
    won = env.step(f"\\boxed{{{env.game.game_number}}}")
    assert won.info["success"] and won.info["gem_invalid_turns"] == 0
    m = episode_metrics(EnvSpec(name="gem", options={"env_id": GUESS}), [malformed.info, won.info])
    assert m == {
        "mean_return": pytest.approx((-0.1 + 1.0) / 2),
        "malformed_end_rate": 0.5,
        "invalid_action_rate": pytest.approx(2 / 5),  # 2 of the 4 + 1 turns
    }
    master = make_env("gem", env_id=MASTERMIND)
    master.reset(1)
    r = master.step("\\boxed{1 2 3}")  # a code has 2 digits here: wrong length, refused
    assert not r.done and r.info["gem_invalid_turns"] == 1


def test_same_seed_same_game_and_the_global_rng_is_left_alone():
    random.seed(11)
    np.random.seed(11)
    py, npy = random.getstate(), np.random.get_state()[1].copy()
    a, b = make_env("gem", env_id=MASTERMIND), make_env("gem", env_id=MASTERMIND)
    a.reset(5)
    b.reset(6)
    c = make_env("gem", env_id=MASTERMIND)
    c.reset(5)
    assert c.game.game_code == a.game.game_code
    assert random.getstate() == py and (np.random.get_state()[1] == npy).all()
    assert random.random() == random.Random(11).random()  # the global stream continues as seeded


MOVES_2048 = ["up", "left", "down", "right"] * 3


def test_interleaved_and_threaded_episodes_replay_the_sequential_ones():
    """2048 draws from the global RNG in every step; episodes stepped in turns (as the rollout
    interleaves them) and in worker threads see the same games as one after the other."""

    def episode(seed):
        env = make_env("gem", env_id="game:Game2048-v0-easy")
        obs = [env.reset(seed)]
        for move in MOVES_2048:
            r = env.step(f"\\boxed{{{move}}}")
            obs.append(r.observation)
            if r.done or r.truncated:
                break
        return obs

    seeds = list(range(8))
    want = {s: episode(s) for s in seeds}
    envs = {s: make_env("gem", env_id="game:Game2048-v0-easy") for s in seeds}
    turns = {s: [envs[s].reset(s)] for s in seeds}
    for move in MOVES_2048:  # one step of every episode, then the next step of each
        for s in seeds:
            if not envs[s].done:
                turns[s].append(envs[s].step(f"\\boxed{{{move}}}").observation)
    assert turns == want
    got: dict[int, list[str]] = {}
    threads = [threading.Thread(target=lambda s=s: got.__setitem__(s, episode(s))) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want
    assert len({tuple(v) for v in want.values()}) == len(seeds)


def test_train_and_held_out_seeds_are_disjoint():
    tasks = TasksConfig(train=[EnvSpec(name="gem", options={"env_id": GUESS})])
    stream = TaskStream(tasks)
    train = {next(stream).seed for _ in range(2000)}
    held_out = set(eval_seeds(tasks.eval_seed, 0, 256))
    assert len(train) == 2000 and len(held_out) == 256 and not train & held_out


# ------------------------------------------------------------------ solvers, demonstrations
@pytest.mark.parametrize(
    ("env_id", "max_turns"),
    [
        (GUESS, 4),
        ("game:GuessTheNumber-v0-hard", 6),
        (MASTERMIND, 6),
        ("game:Mastermind-v0-hard", 8),
        (HANOI, 7),
    ],
)
def test_solvers_win_every_game(env_id, max_turns):
    env = make_env("gem", env_id=env_id)
    assert isinstance(env, SupportsGoldAction)
    turns = []
    for seed in range(40):
        demo = run_demonstration(env, seed)
        assert demo.info["success"] and demo.terminated and demo.total_reward == 1.0, seed
        turns.append(len(demo.actions))
    assert max(turns) <= max_turns


def test_bisection_says_the_interval_and_mastermind_guesses_stay_consistent():
    env = make_env("gem", env_id="game:GuessTheNumber-v0-hard")
    env.reset(1)
    assert env.gold_action() == "Between 1 and 50. \\boxed{25}"
    assert pegs([1, 2, 3, 4], [4, 2, 1, 5]) == (1, 2)  # GEM's own scoring
    env = make_env("gem", env_id=MASTERMIND)
    env.reset(2)
    while True:
        guess = env.gold_action()
        history = {tuple(g): pegs(g, env.game.game_code) for g in env.game.previous_guesses}
        digits = tuple(int(d) for d in guess[len("\\boxed{") : -1].split())
        assert digits in consistent_codes(2, 6, False, history) and digits not in history
        if env.step(guess).done:
            break


@pytest.mark.parametrize("env_id", [MASTERMIND, "game:Mastermind-v0-hard"])
def test_mastermind_reasoning_lists_the_consistent_codes_then_guesses_as_without(env_id):
    plain = make_env("gem", env_id=env_id)
    reasoned = make_env("gem", env_id=env_id, solver_reasoning=True)
    game = reasoned.game
    for seed in range(20):
        plain.reset(seed)
        reasoned.reset(seed)
        actions = []
        while True:
            action = reasoned.gold_action()
            history = {tuple(g): pegs(g, game.game_code) for g in game.previous_guesses}
            left = consistent_codes(game.code_length, game.num_numbers, False, history)
            listed = (
                f"{len(left)} codes"
                if len(left) > 12
                else " ".join("".join(str(d) for d in c) for c in left)
            )
            guess = plain.gold_action()
            assert action == f"Left: {listed}. {guess}", (seed, action)
            assert tuple(game.game_code) in left
            actions.append(action)
            plain.step(guess)
            if reasoned.step(action).done:
                break
        assert reasoned.game.game_code == plain.game.game_code
        assert reasoned.episode_return == 1.0 and len(actions) <= 8
    reasoned.reset(0)
    if env_id == MASTERMIND:
        assert reasoned.gold_action() == "Left: 30 codes. \\boxed{1 2}"


def test_games_without_a_solver_give_no_demonstrations():
    env = make_env("gem", env_id="game:Sudoku-v0-easy")
    assert not isinstance(env, SupportsGoldAction)
    with pytest.raises(TypeError, match="has no gold_action"):
        run_demonstration(env, 0)


# ------------------------------------------------------------------ rendering, both templates
@pytest.fixture(scope="module")
def smollm2_chat(tmp_path_factory):
    """SmolLM2's tokenizer and chat template (rebuilt from the installed GGUF)."""
    from sao_megatron.convert.pretrained import find_smollm2_gguf, tokenizer_from_gguf

    try:
        gguf = find_smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.fail(f"{exc} (make install does it)")
    out = tmp_path_factory.mktemp("smollm2_tok")
    tokenizer_from_gguf(gguf).save_pretrained(out)
    return build_formatter(HFTokenizer(str(out)), EpisodeFormatConfig(format="chat_template"))


@pytest.fixture(scope="module")
def gem_sentencepiece():
    """The from-scratch path's tokenizer, trained on GEM demonstrations."""
    demos = DemonstrationConfig(
        envs=[EnvSpec(name="gem", options={"env_id": e}) for e in (GUESS, MASTERMIND)],
        num_episodes=20,
    )
    return train_tokenizer_for_envs(demos, TokenizerConfig(vocab_size=400))


def _check_episode(traj):
    """The trajectory's token stream is its nodes' observation and action ids, in order."""
    seq = traj.to_token_sequence().token_ids.tolist()
    n = 0
    for node in traj.nodes:
        n += len(node.observation_token_ids)
        assert seq[n : n + len(node.action_token_ids)] == node.action_token_ids
        n += len(node.action_token_ids)
    assert n == len(seq)


@pytest.mark.parametrize("template", ["smollm2", "marker_chat", "markers"])
@pytest.mark.parametrize("env_id", [GUESS, MASTERMIND])
def test_gem_episodes_render_token_in_token_out(template, env_id, request):
    if template == "smollm2":
        formatter = request.getfixturevalue("smollm2_chat")
    else:
        sp = request.getfixturevalue("gem_sentencepiece")
        fmt = "chat_template" if template == "marker_chat" else "markers"
        formatter = build_formatter(sp, EpisodeFormatConfig(format=fmt))
    env = make_env("gem", env_id=env_id)
    seen: list[str] = []
    policy = env.gold_action

    def recording():
        seen.append(policy())
        return seen[-1]

    calls: list[list[int]] = []
    traj = play(env, formatter, seed=4, policy=recording, calls=calls)
    assert len(calls) == len(traj.nodes) >= 2
    ids = traj.to_token_sequence().token_ids.tolist()
    for prompt in calls:  # each prompt is the trajectory's prefix: nothing re-tokenised
        assert ids[: len(prompt)] == prompt
    assert traj.terminated and traj.status == "completed" and traj.total_reward == 1.0
    assert traj.info["success"] is True and traj.info["env"] == env_id
    assert [formatter.action_text(n.action_token_ids) for n in traj.nodes] == seen
    _check_episode(traj)
    # the whole stream is the template's text of the conversation GEM had
    observations = [make_env("gem", env_id=env_id).reset(4)]
    replay = make_env("gem", env_id=env_id)
    replay.reset(4)
    for action in seen[:-1]:
        observations.append(replay.step(action).observation)
    text = formatter.episode_text(observations, seen)
    if template == "markers":
        assert ids[0] == formatter.tokenizer.bos_id
        assert formatter.tokenizer.decode(ids[1:]) == text
    else:
        assert formatter.encode(text)[: len(ids)] == ids


def test_demonstrations_through_the_chat_template(smollm2_chat):
    config = DemonstrationConfig(
        envs=[EnvSpec(name="gem", options={"env_id": e}) for e in (GUESS, MASTERMIND, HANOI)],
        num_episodes=3,
    )
    demos = generate_demonstrations(config)
    assert len(demos) == 9 and all(d.info["success"] for d in demos)
    seqs = demonstration_sequences(config, smollm2_chat)
    assert len(seqs) == 9
    first = seqs[0]
    trained = [
        t for t, m in zip(first.token_ids.tolist(), first.action_mask.tolist(), strict=True) if m
    ]
    want = []
    for a in demos[0].actions:
        want += smollm2_chat.action_ids(a)
    assert trained == want  # exactly the solver's actions (and their end-of-turn) are trained
