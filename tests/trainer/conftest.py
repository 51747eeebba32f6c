"""Fixtures of the trainer's whole-job tests: one finished SFT stage of the TINY job."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="package")
def tiny_sft(tmp_path_factory) -> Path:
    """A run folder whose SFT stage of the TINY quickstart job finished (tokenizer and
    checkpoints/sft; no engine), trained once for tests/trainer: the whole-job tests that check
    the later stages start from a copy of it (`test_job_integration.from_sft`)."""
    from tests.trainer.test_job_integration import _run

    run = tmp_path_factory.mktemp("tiny_sft") / "sft"
    _run(run, "stages=[sft]", "tasks.num_eval_tasks=0")
    return run
