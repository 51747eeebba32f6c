"""`sao-train` without arguments prints usage with an example; --help shows descriptions."""

from __future__ import annotations

import pytest

from sao_megatron.cli.train import field_docs, main
from sao_megatron.trainer.job import JobConfig


def test_bare_call_prints_usage_and_an_example(capsys):
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage: sao-train" in err and "sao-train examples/configs/quickstart.yaml" in err
    assert "required" not in err


def test_help_lists_field_descriptions(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr()
    assert "Warning" not in out.err
    lines = out.out.splitlines()
    i = lines.index("  model.hidden_size = 256")
    assert lines[i + 1].strip() == "Model width."  # an attribute docstring
    j = next(k for k, line in enumerate(lines) if line.startswith("  logging.log_interval = "))
    assert lines[j + 1].strip().startswith("write every this many steps")  # a Fields: entry


def test_field_docs_cover_most_fields():
    from sao_megatron.configs import describe

    names = [n for n, _ in describe(JobConfig)]
    docs = field_docs(JobConfig)
    assert sum(n in docs for n in names) / len(names) > 0.8
