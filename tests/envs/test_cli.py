import io
from contextlib import redirect_stdout

from sao_megatron.cli.envs import main
from sao_megatron.data.demonstrations import run_demonstration
from sao_megatron.envs import make_env


def _run(argv):
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(argv)
    return rc, buf.getvalue()


def test_show_prints_the_episode_as_the_agent_sees_it():
    for name, extra in [
        ("hanoi", ["--horizon", "6"]),
        ("chain_sum", []),
        ("basic_arithmetic", []),
        ("babyai", []),
    ]:
        rc, out = _run(["show", name, "--seed", "3", *extra])
        assert rc == 0
        env = make_env(name, **({"horizon": 6} if extra else {}))
        demo = run_demonstration(env, 3)
        assert out.startswith(demo.text() + "\n")
        assert "total reward 1.0" in out


def test_show_noisy_and_list_and_errors(capsys):
    rc, out = _run(["show", "hanoi", "--horizon", "20", "--epsilon", "0.5", "--seed", "1"])
    assert rc == 0 and "deliberate mistakes" in out and "(0 deliberate" not in out
    rc, out = _run(["list"])
    assert rc == 0 and "hanoi" in out.split()
    rc = main(["show", "hanoi", "--option", "horizn=3"])
    assert rc == 2 and "unknown option" in capsys.readouterr().err


def test_show_all_prints_every_environment():
    rc, out = _run(["show", "all", "--horizon", "3", "--seed", "1"])
    assert rc == 0
    for name in ["babyai", "basic_arithmetic", "chain_sum", "hanoi"]:
        assert f"===== {name}\n<|obs|>" in out and f"--- {name}:1:" in out
    # the latency wrapper (registered on import) plays its default wrapped 3-move Hanoi
    latency = out.split("===== latency\n", 1)[1].split("=====", 1)[0]
    assert latency.startswith("<|obs|>") and "--- hanoi:1:" in latency
    assert "'env_latency_total_s': " in latency
    assert out.count("total reward 1.0") == 5


def test_show_with_tokenizer_and_window(tmp_path):
    from sao_megatron.data.demonstrations import DemonstrationConfig, train_tokenizer_for_envs
    from sao_megatron.data.tokenizer import TokenizerConfig, save_tokenizer

    tok = train_tokenizer_for_envs(
        DemonstrationConfig(num_episodes=5), TokenizerConfig(vocab_size=320, hard_vocab_limit=True)
    )
    save_tokenizer(tok, str(tmp_path))
    rc, out = _run(
        ["show", "hanoi", "--horizon", "6", "--tokenizer", str(tmp_path), "--window", "1"]
    )
    assert rc == 0 and "--- tokens: [" in out
    last_context = out.split("--- last windowed context + action:\n")[1]
    assert last_context.count("<|eoa|>") == 2  # one earlier action in the window + the last one


def test_options_prints_the_schema_table(capsys):
    from sao_megatron.envs.base import fixed_options, options_schema
    from sao_megatron.envs.options import options_table

    assert main(["options", "chain_sum"]) == 0
    out = capsys.readouterr().out
    assert out == options_table(options_schema("chain_sum"), fixed_options("chain_sum")) + "\n"
    assert "| `difficulty` |" in out and "| `dataset` |" not in out  # fixed by chain_sum
    assert main(["options", "hanio"]) == 2
    assert "did you mean 'hanoi'" in capsys.readouterr().err
