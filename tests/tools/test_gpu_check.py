"""tools/gpu_check.py and its wheel preparation on a machine without CUDA.

Without CUDA the script stops at once (exit code 2, one line). The parts it runs on the GPU are
run here on gloo: the skip-with-reason logic for absent Transformer Engine / vLLM, the budgets
and the deadline (tools/gpu_check_runner.py), the policy / critic / SAO step / MFU checks on a
tiny model, and tools/gpu_check_prepare.py (dry run, an offline run on wheels already there,
and the carried wheels against what the check's imports load).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from argparse import Namespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.py"
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
sys.path[:0] = [str(ROOT / "tools")]

import gpu_check  # noqa: E402
import gpu_check_prepare as prep  # noqa: E402
from gpu_check_runner import Runner, time_limit  # noqa: E402

TINY = [
    "model.vocab_size=300",
    "model.hidden_size=64",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "model.head_dim=16",
    "model.num_experts=4",
    "model.num_experts_per_tok=2",
    "model.moe_intermediate_size=32",
    "model.max_position_embeddings=64",
    "tokenizer.vocab_size=300",
]


def _run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(tmp_path / "gpu.json")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )


@pytest.mark.parametrize("mode", [["--dry-run"], []])
def test_fails_clearly_without_cuda(tmp_path, mode):
    proc = _run(*mode, tmp_path=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("gpu_check: CUDA is not available"), lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stdout == ""
    assert not (tmp_path / "gpu.json").exists()  # nothing half-written


def test_plan_and_inputs():
    assert gpu_check.CHECKS == (
        "environment",
        "nccl_1gpu",
        "vllm",
        "policy_bf16",
        "critic_bf16",
        "te_bf16",
        "te_fp8",
        "sao_step",
        "mfu",
    )
    assert set(gpu_check.BUDGET_S) == set(gpu_check.CHECKS)
    # every check on one H200 fits the 8 minutes the lent machine allows, with the deadline
    assert gpu_check.DEADLINE_S + 60 <= prep.CALL_TIMEOUT_S <= 480
    job = gpu_check._job(["precision.params_dtype=bf16", "precision.fp8=true"])
    assert job.precision.params_dtype == "bf16" and job.precision.fp8
    mfu_job = gpu_check._job(["precision.params_dtype=bf16", *gpu_check.MFU_MODEL])
    assert mfu_job.model.hidden_size == 1024 and mfu_job.model.vocab_size == 32768
    assert mfu_job.model.max_position_embeddings >= gpu_check.MFU_SHAPE["seq_len"]
    batch = gpu_check._batch(job.model.vocab_size, 8, 64)
    assert batch.input_ids.shape == (8, 64)
    am = batch.attention_mask
    assert am[:4].all() and not am[4:, 48:].any() and am[4:, :48].all()  # right padding only
    import torch

    if torch.cuda.is_available():  # a GPU machine: the prerequisites are met and reported
        assert gpu_check._prerequisites()["num_gpus"] >= 1
    else:
        with pytest.raises(gpu_check.CheckUnavailable, match="CUDA is not available"):
            gpu_check._prerequisites()


# ------------------------------------------------------------------------------ skips
def _absent(monkeypatch, *modules: str):
    """Make `modules` look uninstalled to gpu_check's own detection (find_spec)."""
    real = gpu_check.importlib.util.find_spec
    monkeypatch.setattr(
        gpu_check.importlib.util, "find_spec", lambda n, *a: None if n in modules else real(n, *a)
    )


def test_absent_te_and_vllm_are_skipped_with_their_reason(monkeypatch):
    _absent(monkeypatch, "transformer_engine", "vllm")
    optional = {m: gpu_check.optional_dependency(m) for m in gpu_check.OPTIONAL}
    assert set(optional) == {"transformer_engine", "vllm"}
    for m, entry in optional.items():
        assert entry == {"absent": f"{m} is not installed (importlib.util.find_spec is None)"}
    env = {"optional": optional, "fp8_capable": True, "compute_capability": "9.0"}
    done = {"te_bf16": "passed"}
    assert (
        gpu_check.skip_reason("vllm", env, done) == f"vLLM is absent: {optional['vllm']['absent']}"
    )
    for name in ("te_bf16", "te_fp8"):
        reason = gpu_check.skip_reason(name, env, done)
        assert reason.startswith(
            "Transformer Engine is absent: transformer_engine is not installed"
        )
    for name in ("environment", "nccl_1gpu", "policy_bf16", "critic_bf16", "sao_step", "mfu"):
        assert gpu_check.skip_reason(name, env, done) is None
    # without the environment check's result the detection runs itself
    assert gpu_check.skip_reason("te_fp8", None, done).startswith("Transformer Engine is absent")


def test_te_present_fp8_needs_hopper_and_te_bf16(monkeypatch):
    monkeypatch.setattr(gpu_check, "optional_dependency", lambda m: {"version": "2.9.0"})
    env = {"optional": {m: {"version": "2.9.0"} for m in gpu_check.OPTIONAL}}
    ampere = env | {"fp8_capable": False, "compute_capability": "8.0"}
    hopper = env | {"fp8_capable": True, "compute_capability": "9.0"}
    assert gpu_check.skip_reason("te_bf16", hopper, {}) is None
    assert gpu_check.skip_reason("vllm", hopper, {}) is None
    assert gpu_check.skip_reason("te_fp8", hopper, {"te_bf16": "passed"}) is None
    assert gpu_check.skip_reason("te_fp8", hopper, {"te_bf16": "failed"}) == (
        "te_bf16 did not pass (failed)"
    )
    assert "8.0 < 9.0" in gpu_check.skip_reason("te_fp8", ampere, {"te_bf16": "passed"})


def test_run_without_cuda_records_every_check_and_never_fails_an_absent_one(monkeypatch, tmp_path):
    """The driver on this CPU machine: `environment` fails (no CUDA), TE and vLLM are skipped
    with the detection's reason, the rest are skipped as needing a check that did not pass;
    a vLLM that is detected but does not import fails (it is not skipped)."""
    _absent(monkeypatch, "transformer_engine", "vllm")
    out = tmp_path / "r.json"
    code = gpu_check.run(Namespace(out=str(out), deadline=600.0))
    rep = json.loads(out.read_text())
    checks = rep["checks"]
    assert code == 1 and list(checks) == [
        "environment",
        "vllm",
        "nccl_1gpu",
        "policy_bf16",
        "critic_bf16",
        "te_bf16",
        "te_fp8",
        "sao_step",
        "mfu",
    ]
    assert checks["environment"]["status"] == "failed"
    assert "CUDA is not available" in checks["environment"]["error"]
    assert checks["vllm"] == checks["vllm"] | {"status": "skipped"}
    assert checks["vllm"]["reason"].startswith("vLLM is absent: vllm is not installed")
    for name in ("te_bf16", "te_fp8"):
        assert checks[name]["reason"].startswith("Transformer Engine is absent"), name
    for name in ("nccl_1gpu", "policy_bf16", "critic_bf16", "sao_step", "mfu"):
        assert checks[name] == checks[name] | {
            "status": "skipped",
            "reason": "a check it needs did not pass",
        }
    assert rep["summary"]["failed"] == ["environment"]
    assert rep["summary"]["skipped"]["vllm"] == checks["vllm"]["reason"]

    # detected as installed but not importable (.venv has no vLLM; .venv-vllm has it): failed
    if VLLM_INSTALLED:
        return
    monkeypatch.setattr(gpu_check, "optional_dependency", lambda m: {"version": "0.0-test"})
    gpu_check.run(Namespace(out=str(out), deadline=600.0))
    vllm = json.loads(out.read_text())["checks"]["vllm"]
    assert vllm["status"] == "failed" and "ModuleNotFoundError" in vllm["error"]


# ------------------------------------------------------------------------------ budgets
def test_a_check_past_its_budget_is_stopped(tmp_path):
    out = tmp_path / "r.json"
    runner = Runner(out, deadline_s=30, budgets={"slow": 0.3, "next": 1})
    t0 = time.monotonic()
    assert runner.run("slow", lambda: time.sleep(5)) is None
    took = time.monotonic() - t0
    assert 0.3 <= took < 2.0, took
    assert runner.run("next", lambda: {"x": 1}) == {"x": 1}  # the next one still runs
    rep = json.loads(out.read_text())
    slow = rep["checks"]["slow"]
    assert slow["status"] == "timed_out" and slow["error"] == "outran its budget of 0.3 s"
    assert rep["checks"]["next"]["result"] == {"x": 1}
    assert rep["summary"]["timed_out"] == ["slow"] and rep["summary"]["passed"] == ["next"]
    assert runner.exit_code() == 1


def test_the_deadline_skips_what_no_longer_fits_and_says_so(tmp_path):
    out = tmp_path / "r.json"
    start = time.monotonic() - 7.0  # 7 s already spent of a 10 s deadline
    runner = Runner(out, deadline_s=10, budgets={"fits": 1, "too_big": 5, "bad": 1}, start=start)
    assert 2.5 < runner.remaining() <= 3.0
    assert runner.run("fits", lambda: {"ok": True}) == {"ok": True}
    assert runner.run("too_big", lambda: pytest.fail("must not start")) is None
    assert runner.exit_code() == 3  # nothing failed, something skipped for time
    runner.run("bad", lambda: 1 / 0)
    rep = json.loads(out.read_text())
    big = rep["checks"]["too_big"]
    assert big["status"] == "skipped_for_time" and big["budget_s"] == 5
    assert big["reason"].startswith("its budget of 5 s does not fit in the ")
    assert big["reason"].endswith(" s left before the deadline")
    bad = rep["checks"]["bad"]
    assert bad["status"] == "failed" and bad["error"] == "ZeroDivisionError: division by zero"
    assert "ZeroDivisionError" in bad["traceback"]
    assert rep["summary"]["skipped_for_time"] == ["too_big"] and runner.exit_code() == 1
    assert rep["deadline_s"] == 10


def test_time_limit_puts_an_outer_timer_back():
    fired = []
    old = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 50.0)
        with time_limit(5.0):
            time.sleep(0.2)
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 49.0 < left < 49.9, left
        assert signal.getsignal(signal.SIGALRM) is not None and not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ------------------------------------------------------------------------------ checks (gloo)
def test_local_specs_leave_the_platform_alone(parallel_1rank):
    local = gpu_check.local_specs(parallel_1rank)
    assert (
        local.platform.use_te is False and local.platform.device == parallel_1rank.platform.device
    )
    assert local.cfg is parallel_1rank.cfg and local.pg_collection is parallel_1rank.pg_collection


def test_model_checks_on_a_tiny_model(parallel_1rank):
    """policy and critic passes, one SAO step, MFU: the functions the GPU runs, on gloo."""
    import bench_mfu

    local = gpu_check.local_specs(parallel_1rank)
    state: dict = {}
    pol = gpu_check.model_pass(local, "policy", rows=4, seq_len=32, overrides=TINY, state=state)
    assert pol["specs"] == "local" and pol["params_dtype"] == "torch.bfloat16"
    assert pol["grad_norm"] > 0 and pol["frozen_params"] == 0 and pol["peak_memory_gib"] is None
    assert -8.0 < pol["mean_logprobs"] < 0 and pol["mean_entropy"] > 0
    assert state["logprobs"].shape == (
        int(gpu_check._batch(300, 4, 32).attention_mask[:, 1:].sum()),
    )
    val = gpu_check.model_pass(local, "value", rows=4, seq_len=32, overrides=TINY, state=state)
    assert val["frozen_params"] > 0 and val["grad_norm"] > 0
    assert val["mean_values"] == 0.0  # the quickstart's value head starts at V = 0
    assert val["loss"] == pytest.approx(2.0)  # (0 - 1)^2 token mean, 2 micro-batches

    sao = gpu_check.check_sao_step(local, rows=4, seq_len=32, overrides=TINY)
    assert sao["metrics"]["deviation/abs_one_minus_ratio_mean"] < 0.05
    assert sao["metrics"]["deviation/num_action_tokens"] > 0 and sao["seconds_per_step"] > 0

    mfu = gpu_check.check_mfu(local, TINY, rows=4, seq_len=32, mbs=2, steps=2, matmul_n=128)
    job = gpu_check._job(["precision.params_dtype=bf16", *TINY])
    assert mfu["mfu"] == "n/a (no bf16 spec peak known for 'cpu' (SPEC_BF16_PEAK))"
    assert (
        mfu["achieved_flops_per_s"]
        == mfu["model_flops_per_step"] / (mfu["seconds_per_step"]["median"])
    )
    assert mfu["mfu_vs_measured_matmul"] == pytest.approx(
        mfu["achieved_flops_per_s"] / mfu["measured_matmul_flops_per_s"]
    )
    ones = {k: 1.0 for k in bench_mfu.COMPONENT_WEIGHTS} | {"_layer0_input_grad": 1.0}
    critic = ones | {"attn_qkv": 0.0, "attn_proj": 0.0}  # the default freeze patterns
    want = bench_mfu.step_flops(job.model, 4, 32, 2, ones, critic)["train_step"]
    assert mfu["model_flops_per_step"] == want


def test_spec_peak_names_what_the_mfu_uses():
    assert gpu_check.spec_peak("NVIDIA H200") == (
        989e12,
        "H200 bf16 dense spec peak, 989 TFLOP/s (NVIDIA datasheet)",
    )
    peak, why = gpu_check.spec_peak("NVIDIA A10")
    assert peak is None and "no bf16 spec peak known for 'NVIDIA A10'" in why


# ------------------------------------------------------------------------------ wheels
def _venv_pins() -> dict[str, str]:
    import importlib.metadata as md

    return {prep.normalize(n): md.version(n) for n in prep.CARRY}


def test_prepare_dry_run_lists_the_pins_and_prints_a_valid_call():
    exclude = ROOT / ".git" / "info" / "exclude"
    before = exclude.read_text() if exclude.exists() else None
    had_whl = (ROOT / ".whl").exists()
    proc = subprocess.run(
        [str(ROOT / "tools" / "gpu_check_prepare.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    pins = _venv_pins()
    for name in prep.CARRY:
        how = "built here from its sdist" if name in prep.FROM_SDIST else "wheel"
        assert any(ln.startswith(f"gpu_check_prepare: {name}=={pins[name]} ({how}") for ln in lines)
    call = json.loads(lines[-1])
    assert call["carry"] == [".whl"] and call["timeout_s"] == prep.CALL_TIMEOUT_S
    assert len(call["command"]) <= 2000
    assert f"  command ({len(call['command'])} characters): {call['command']}" in lines
    assert prep.command_paths(call["command"]) == [".whl/*.whl", "tools/gpu_check.py"]
    assert (ROOT / "tools" / "gpu_check.py").is_file()
    assert "--deadline 420 --out $OUT/gpu_check.json" in call["command"]
    # a dry run writes nothing
    assert (exclude.read_text() if exclude.exists() else None) == before
    assert (ROOT / ".whl").exists() == had_whl


def _fake_wheel(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x.txt", "x" * 1000)


def _wheel_name(name: str, version: str) -> str:
    return f"{name.replace('-', '_')}-{version}-py3-none-any.whl"


def test_prepare_offline_on_wheels_already_there(tmp_path):
    """The real mode in a scratch repository whose .whl/ already holds every pinned wheel: no
    download, a stale version removed, /.whl/ excluded, sizes summed, the call's files exist."""
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "tools" / "gpu_check.py")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    whl = repo / ".whl"
    whl.mkdir()
    for name, version in _venv_pins().items():
        _fake_wheel(whl / _wheel_name(name, version))
    stale = whl / "omegaconf-2.3.0-py3-none-any.whl"
    _fake_wheel(stale)
    args = ["--root", str(repo), "--venv", str(Path(sys.executable).parents[1])]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check_prepare.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pip download" not in proc.stdout and "pip wheel" not in proc.stdout
    assert not stale.exists() and len(list(whl.glob("*.whl"))) == len(prep.CARRY)
    assert (repo / ".git" / "info" / "exclude").read_text().splitlines()[-1] == "/.whl/"
    assert f"{len(prep.CARRY)} wheels in .whl/" in proc.stdout
    call = json.loads(proc.stdout.splitlines()[-1])
    assert len(call["command"]) <= 2000 and call["carry"] == [".whl"]
    assert prep.missing_paths(call["command"], repo) == []
    # what travels besides the carried wheels: the untracked tools/gpu_check.py, not .whl/
    assert prep.tree_bytes(repo) == SCRIPT.stat().st_size
    assert not prep.ensure_excluded(repo)  # already there: not added twice


def test_prepare_refuses_what_does_not_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "LIMIT_BYTES", 10)
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "tools" / "gpu_check.py")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / ".whl").mkdir()
    for name, version in _venv_pins().items():
        _fake_wheel(repo / ".whl" / _wheel_name(name, version))
    venv = Path(sys.executable).parents[1]
    assert prep.main(["--root", str(repo), "--venv", str(venv)]) == 1


def test_pins_and_plan(monkeypatch):
    freeze = "# comment\nMegatron-Core==0.16.1\n-e /work/main\nreasoning_gym==0.1.25\n"
    pins = prep.read_pins(freeze)
    assert pins == {"megatron-core": "0.16.1", "reasoning-gym": "0.1.25"}
    with pytest.raises(ValueError, match="not installed in the virtualenv: omegaconf;"):
        prep.plan(pins)
    full = {prep.normalize(n): "1.0" for n in prep.CARRY}
    assert {h for _, _, h in prep.plan(full)} == {"wheel"}  # every one has a wheel today
    monkeypatch.setattr(prep, "FROM_SDIST", ("omegaconf",))  # the sdist path, were one needed
    how = {n: h for n, _, h in prep.plan(full)}
    assert how == {"omegaconf": "sdist", "megatron-core": "wheel"}


def test_carried_wheels_cover_what_the_check_imports():
    """Every distribution the check's imports load (a fresh interpreter) is on the lent image or
    carried; every carried one is loaded (none carried for nothing)."""
    code = (
        "import importlib, json, sys, importlib.metadata as md\n"
        f"sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tools')!r}]\n"
        "import gpu_check\n"
        "for m in gpu_check.GPU_PATH_MODULES: importlib.import_module(m)\n"
        "pd = md.packages_distributions()\n"
        "out = set()\n"
        "for name, mod in list(sys.modules.items()):\n"
        "    where = str(getattr(mod, '__file__', None) or getattr(mod, '__path__', ''))\n"
        "    if '.' in name or 'site-packages' not in where: continue\n"
        "    if '/setuptools/_vendor/' in where: out.add('setuptools'); continue\n"
        "    out.update(pd.get(name, []))\n"
        "print(json.dumps(sorted(out)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    loaded = {prep.normalize(d) for d in json.loads(proc.stdout.splitlines()[-1])}
    carried = {prep.normalize(n) for n in prep.CARRY}
    known = carried | {prep.normalize(n) for n in prep.ON_IMAGE} | {"sao-megatron"}
    assert loaded - known == set(), "add them to CARRY (or ON_IMAGE if the image has them)"
    assert carried - loaded == set(), "carried but never imported"
