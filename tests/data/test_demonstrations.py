import pytest
import torch

from sao_megatron.data.demonstrations import (
    DemonstrationConfig,
    demonstration_sequences,
    generate_demonstrations,
    run_demonstration,
    train_tokenizer_for_envs,
)
from sao_megatron.data.episode import EpisodeFormatter
from sao_megatron.data.tokenizer import TokenizerConfig
from sao_megatron.envs import EnvSpec, StepResult, make_env
from sao_megatron.envs.hanoi import optimal_distance

SPECS = [
    EnvSpec(name="hanoi", options={"horizon": 25}),
    EnvSpec(name="chain_sum"),
    EnvSpec(name="basic_arithmetic", options={"reward": "math_verify"}),
    EnvSpec(name="babyai"),
]


def _key(demos):
    return [(d.task_id, d.observations, d.actions, d.is_gold, d.rewards) for d in demos]


def test_deterministic_by_seed_and_gold_succeeds():
    cfg = DemonstrationConfig(envs=SPECS, num_episodes=5, seed=7)
    a, b = generate_demonstrations(cfg), generate_demonstrations(cfg)
    assert _key(a) == _key(b)
    assert len(a) == 20 and all(d.total_reward == 1.0 and d.terminated for d in a)
    assert all(d.is_gold == [True] * len(d.actions) for d in a)
    other = generate_demonstrations(DemonstrationConfig(envs=SPECS, num_episodes=5, seed=8))
    assert _key(other) != _key(a)
    assert len({d.task_id for d in a}) == 20


def test_noisy_gold_recovers_via_the_gold_solver():
    env = make_env("hanoi", horizon=40, max_steps_factor=4.0)
    num_mistakes = 0
    for seed in range(6):
        demo = run_demonstration(env, seed, noise_epsilon=0.15)
        env.reset(seed)
        dist = env.remaining_optimal_moves()
        for action, gold in zip(demo.actions, demo.is_gold, strict=True):
            r = env.step(action)
            assert "error" not in r.info  # mistakes are legal moves
            new = optimal_distance(env.state, env.target_peg) if not r.done else 0
            if gold:
                assert new == dist - 1  # every gold move is optimal from wherever we are
            else:
                num_mistakes += 1
                assert new > dist - 1
            dist = new
        assert demo.total_reward == 1.0  # the budget (4H) leaves room to recover
    assert num_mistakes > 0


def test_sft_sequences_exclude_mistakes_unless_asked():
    tokcfg = TokenizerConfig(vocab_size=400)
    cfg = DemonstrationConfig(envs=[SPECS[0]], num_episodes=3, seed=1, noise_epsilon=0.2)
    tok = train_tokenizer_for_envs(cfg, tokcfg)
    fmt = EpisodeFormatter(tok)
    demos = generate_demonstrations(cfg)
    assert any(not g for d in demos for g in d.is_gold)
    seqs = demonstration_sequences(cfg, fmt)
    assert len(seqs) == 3
    for d, s in zip(demos, seqs, strict=True):
        assert tok.decode(s.token_ids.tolist()) == d.text()
        trained = tok.decode(s.token_ids[s.action_mask].tolist())
        assert trained == "".join(
            a + "<|eoa|>" for a, g in zip(d.actions, d.is_gold, strict=True) if g
        )
        everything = d.to_sft_sequences(fmt, train_on_noise=True)[0]
        assert int(everything.action_mask.sum()) > int(s.action_mask.sum())
        assert torch.equal(everything.token_ids, s.token_ids)


def test_config_errors_and_envs_without_gold():
    with pytest.raises(ValueError, match="demonstrations.envs"):
        DemonstrationConfig(envs=[])
    with pytest.raises(ValueError, match="demonstrations.num_episodes"):
        DemonstrationConfig(envs=SPECS, num_episodes=0)
    with pytest.raises(ValueError, match="demonstrations.noise_epsilon"):
        DemonstrationConfig(envs=SPECS, noise_epsilon=1.0)
    cfg = DemonstrationConfig(envs=[{"name": "hanoi", "options": {"horizon": 3}}], num_episodes=1)
    assert isinstance(cfg.envs[0], EnvSpec)

    class NoGold:
        name, max_steps = "nogold", 1

        def reset(self, seed):
            return ""

        def step(self, action):
            return StepResult(observation="", reward=0.0, done=True)

    with pytest.raises(TypeError, match="no gold_action"):
        run_demonstration(NoGold(), 0)


def test_opening_episodes_add_first_moves_and_leave_full_episodes_unchanged():
    spec = EnvSpec(name="hanoi", options={"horizon": 25, "start": "random", "extra_disks": 1})
    base = generate_demonstrations(DemonstrationConfig(envs=[spec], num_episodes=3, seed=1))
    cfg = DemonstrationConfig(envs=[spec], num_episodes=3, seed=1, opening_episodes=4)
    demos = generate_demonstrations(cfg)
    assert _key(demos[:3]) == _key(base)  # the full episodes are the same
    openings = demos[3:]
    assert len(openings) == 4
    for d in openings:
        assert len(d.actions) == 1 and len(d.observations) == 1 and d.truncated
        assert not d.terminated and d.is_gold == [True]
        # the opening's first move is the full gold episode's first move from the same seed
        full = run_demonstration(make_env("hanoi", **spec.options), d.seed)
        assert d.actions == full.actions[:1] and d.observations == full.observations[:1]
    assert len({d.task_id for d in openings}) == 4
    three = generate_demonstrations(
        DemonstrationConfig(envs=[spec], num_episodes=1, opening_episodes=2, opening_turns=3)
    )
    assert [len(d.actions) for d in three] == [25, 3, 3]


@pytest.mark.parametrize(
    "kwargs, field",
    [({"opening_episodes": -1}, "opening_episodes"), ({"opening_turns": 0}, "opening_turns")],
)
def test_opening_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"demonstrations.{field}"):
        DemonstrationConfig(**kwargs)
