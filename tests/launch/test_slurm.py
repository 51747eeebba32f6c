"""`launch_scripts/train_slurm.sbatch` on a real one-node SLURM cluster, requeue included.

Starts the cluster with tools/slurm_local_setup.sh (root; installs Debian's packages) or uses
one that answers already. One job, submitted unchanged with small overrides (a 2-layer model,
SFT 10 steps, value pre-training 1, RL 16 with vLLM): once RL has logged two steps, the test
sends the job's batch shell USR1 (what `--signal=B:USR1@300` sends before a time limit). The
trainer must finish its step, save a checkpoint at that step (save_interval=100 would never save
there), exit 0, the job requeue itself and the second start resume from that checkpoint: every
SFT and RL step in metrics.jsonl exactly once, everything under RUN_DIR, the job COMPLETED with
one restart.
A second job cancels during SFT (saved, not requeued); a third runs the engines in a job step of
their own (ROLLOUT_NODES=1) and checks the trainer trained with them.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "tools" / "slurm_local_setup.sh"
SBATCH = ROOT / "launch_scripts" / "train_slurm.sbatch"
SFT_STEPS, RL_STEPS = 10, 16  # RL long enough that the signal after step 2 lands mid-stage
# The quickstart job shrunk (2-layer, 128-wide MoE; small batches): what these tests check is
# the batch script, SLURM's signals and requeue and the engines' job step, not the model.
SMALL = [
    "model.hidden_size=128",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=2",
    "model.num_experts=4",
    "model.moe_intermediate_size=64",
    "demonstrations.num_episodes=64",
    "sft.batch_size=8",
    "sft.micro_batch_size=4",
    "rollout.trajectories_per_batch=4",
    "rollout.max_concurrent_episodes=4",
    "value_pretrain.num_heldout_trajectories=4",
    "rl.micro_batch_size=2",
]
OVERRIDES = [
    *SMALL,
    f"sft.steps={SFT_STEPS}",
    "value_pretrain.steps=1",
    f"rl.steps={RL_STEPS}",
    "tasks.num_eval_tasks=0",
    "checkpoint.save_interval=100",
    "rollout.startup_timeout_s=1200",
    "logging.tensorboard=false",
]
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "DEADLINE")

pytestmark = [pytest.mark.slurm, pytest.mark.integration, pytest.mark.vllm]


def _cluster_up() -> bool:
    if not shutil.which("sinfo"):
        return False
    return subprocess.run(["bash", str(SETUP), "status"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def slurm_cluster():
    """A usable one-node cluster, started here if needed; skipped (with the reason) only where
    SLURM cannot be installed: not root, or the package install failed."""
    if _cluster_up():
        return
    if os.geteuid() != 0:
        pytest.skip(
            "SLURM: no cluster answers and not root, so tools/slurm_local_setup.sh cannot run"
        )
    out = subprocess.run(
        ["nice", "-n", "10", "bash", str(SETUP)],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    if out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).splitlines()[-15:])
        if not shutil.which("slurmctld") or not shutil.which("sbatch"):
            pytest.skip(f"SLURM could not be installed on this machine:\n{tail}")
        pytest.fail(f"tools/slurm_local_setup.sh failed with SLURM installed:\n{tail}")
    assert _cluster_up()


def _job(job_id: str) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=False
    )
    fields = {}
    for token in out.stdout.split():
        key, _, value = token.partition("=")
        fields.setdefault(key, value)
    return fields


def _steps(path: Path) -> list[int]:
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _evidence(job_id: str, job: dict[str, str], out_file: Path) -> str:
    """What a failure message needs to be read without the machine: the job's state fields, the
    end of its .out file and the daemons' log lines about it (SLURM_LOG_DIR of
    tools/slurm_local_setup.sh)."""
    fields = " ".join(f"{k}={job.get(k)}" for k in ("JobState", "Reason", "ExitCode", "Restarts"))
    parts = [f"scontrol: {fields}"]
    if out_file.exists():
        tail = out_file.read_text(errors="replace").splitlines()[-25:]
        parts.append(f"last lines of {out_file}:\n" + "\n".join(tail))
    log_dir = Path(os.environ.get("SLURM_LOG_DIR", "/var/log/slurm"))
    for name in ("slurmctld.log", "slurmd.log"):
        log = log_dir / name
        if log.exists():
            marks = (f"JobId={job_id} ", f"Job {job_id} ", f"[{job_id}.", f"job {job_id} ")
            lines = [ln for ln in log.read_text(errors="replace").splitlines()
                     if any(m in ln + " " for m in marks)]  # fmt: skip
            parts.append(f"{log} about job {job_id}:\n" + "\n".join(lines[-15:]))
    return "\n".join(parts)


def _wait(
    what: str,
    cond,
    job_id: str,
    out_file: Path,
    timeout_s: float,
    poll_s: float = 3.0,
    on_poll=None,
) -> dict[str, str]:
    """Poll until cond(job fields) is true, calling on_poll(job fields) after each poll that is not;
    fail with the job's evidence when it ended otherwise or time ran out."""
    t0 = time.monotonic()
    while True:
        job = _job(job_id)
        if cond(job):
            return job
        state = job.get("JobState", "?")
        if state in ENDED:
            pytest.fail(
                f"job {job_id} is {state} while waiting for {what}\n"
                + _evidence(job_id, job, out_file)
            )
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(
                f"job {job_id} still {state} after {timeout_s:.0f} s waiting for {what}\n"
                + _evidence(job_id, job, out_file)
            )
        if on_poll is not None:
            on_poll(job)
        time.sleep(poll_s)


def _release_requeue_hold(job_id: str, job: dict[str, str]) -> None:
    """Shorten SLURM's hold on a requeued job (PENDING, Reason=BeginTime, ~120 s ahead) to 5 s.

    That wait is SLURM's, not what the tests check. Not `StartTime=now`: slurmd refuses to launch
    a batch job whose credential was made in the same second as the previous instance's
    revocation (`slurm_cred_revoked`: `cred->ctime <= j->revoked`, whole seconds; slurmd.log
    "Job N already killed, do not launch batch job") and the job ends FAILED. It happened in CI
    when the scheduler ran 0.1 s after a `StartTime=now`. Acting only while the hold is > 30 s
    ahead also covers the requeue setting its hold after this poll saw Restarts=1.
    """
    if job.get("JobState") != "PENDING" or job.get("Reason") != "BeginTime":
        return
    try:
        begin = datetime.fromisoformat(job.get("StartTime", ""))
    except ValueError:  # "Unknown" and the like: nothing to shorten
        return
    if (begin - datetime.now()).total_seconds() > 30:
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+5"], check=True)


@pytest.mark.timeout(3600)
def test_sbatch_job_runs_and_resumes_from_the_signal_checkpoint(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SAO_"))}
    env |= {"CONFIG": "examples/configs/quickstart.yaml", "RUN_DIR": str(run_dir)}
    t_submit = time.monotonic()
    sub = subprocess.run(
        ["sbatch", "--parsable", "--job-name=sao-slurm-test", f"--output={tmp_path}/slurm-%j.out",
         str(SBATCH), *OVERRIDES],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    out_file = tmp_path / f"slurm-{job_id}.out"
    rl_metrics = run_dir / "rl" / "metrics.jsonl"
    try:
        _wait("RL step 2", lambda j: len(_steps(rl_metrics)) >= 2, job_id, out_file, 2400, 1.0)
        t_signal = time.monotonic()
        signalled_after = max(_steps(rl_metrics))
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)
        _wait("the requeue", lambda j: j.get("Restarts") == "1", job_id, out_file, 2400, 1.0)
        job = _wait(
            "the requeued job to complete",
            lambda j: j.get("JobState") == "COMPLETED",
            job_id,
            out_file,
            2400,
            on_poll=lambda j: _release_requeue_hold(job_id, j),
        )
    finally:
        if _job(job_id).get("JobState") not in (*ENDED, None):
            subprocess.run(["scancel", job_id], check=False)
    t_done = time.monotonic()
    log = out_file.read_text()
    print(
        f"\nslurm job {job_id}: RL step {signalled_after} at the signal after "
        f"{t_signal - t_submit:.0f} s, completed {t_done - t_signal:.0f} s later "
        f"(total {t_done - t_submit:.0f} s); {out_file}"
    )
    assert job["Restarts"] == "1", f"the job was not requeued exactly once; see {out_file}"
    assert job["ExitCode"] == "0:0"
    stopped = [line for line in log.splitlines() if "stopped by signal at step" in line]
    assert len(stopped) == 1, f"no (or several) 'stopped by signal' lines in {out_file}"
    stop_step = int(stopped[0].split("stopped by signal at step ")[1].split(";")[0])
    assert signalled_after <= stop_step < RL_STEPS
    ckpt = run_dir / "checkpoints" / "rl" / f"step_{stop_step:08d}"
    assert f"checkpoint saved at {ckpt}" in stopped[0]
    assert ckpt.is_dir()  # written at the signal: not a save_interval step
    assert "requeueing job" in log and "(restart 1)" in log
    assert "Traceback" not in log, f"a traceback in {out_file}"
    # No step redone or skipped across the two starts; SFT ran once (RL resumed, SFT skipped).
    assert _steps(rl_metrics) == list(range(1, RL_STEPS + 1))
    assert _steps(run_dir / "sft" / "metrics.jsonl") == list(range(1, SFT_STEPS + 1))
    # Everything under RUN_DIR (not the config's run_dir).
    for rel in (
        "config.yaml",
        "summary.json",
        "hf_policy_final",
        "rollout",
        f"checkpoints/rl/step_{RL_STEPS:08d}",
        f"checkpoints/sft/step_{SFT_STEPS:08d}",
    ):
        assert (run_dir / rel).exists(), rel  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rl/steps_done"] == RL_STEPS
    assert not (run_dir / ".stop_request").exists()
    assert not (run_dir / ".stop_request.consumed").exists()


@pytest.mark.timeout(1800)
def test_scancel_during_sft_saves_that_step_and_does_not_requeue(slurm_cluster, tmp_path):
    """`scancel` (SIGTERM to every process of the job): the ranks finish the SFT step, save it,
    exit 0, and the batch shell does not requeue a cancelled job. SFT only: no engines."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SAO_"))}
    env |= {"RUN_DIR": str(run_dir)}
    sub = subprocess.run(
        ["sbatch", "--parsable", "--job-name=sao-slurm-cancel", f"--output={tmp_path}/slurm-%j.out",
         str(SBATCH), *SMALL, "stages=[sft]", "sft.steps=500", "checkpoint.save_interval=1000",
         "logging.tensorboard=false"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    out_file = tmp_path / f"slurm-{job_id}.out"
    sft_metrics = run_dir / "sft" / "metrics.jsonl"
    try:
        _wait("SFT step 3", lambda j: len(_steps(sft_metrics)) >= 3, job_id, out_file, 1200, 1.0)
        at_cancel = max(_steps(sft_metrics))
        subprocess.run(["scancel", job_id], check=True)
        job = _wait("the job to end", lambda j: j.get("JobState") in ENDED, job_id, out_file, 600)
    finally:
        if _job(job_id).get("JobState") not in (*ENDED, None):
            subprocess.run(["scancel", "--signal=KILL", job_id], check=False)
    log = out_file.read_text()
    print(f"\nslurm job {job_id}: scancel at SFT step {at_cancel}; {out_file}")
    assert job["JobState"] == "CANCELLED" and job["Restarts"] == "0"
    stopped = [line for line in log.splitlines() if "stopped by signal at step" in line]
    assert len(stopped) == 1, f"no 'stopped by signal' line in {out_file}"
    stop_step = int(stopped[0].split("stopped by signal at step ")[1].split(";")[0])
    assert at_cancel <= stop_step < 500
    assert (run_dir / "checkpoints" / "sft" / f"step_{stop_step:08d}").is_dir()
    assert _steps(sft_metrics) == list(range(1, stop_step + 1))
    assert "the trainer saved and stopped on TERM: no requeue" in log
    assert "Traceback" not in log, f"a traceback in {out_file}"


def _weight_version(url: str) -> int | None:
    try:
        return int(httpx.get(url + "/weight_info", timeout=5.0).json()["weight_version"])
    except (httpx.HTTPError, KeyError, ValueError):
        return None


@pytest.mark.timeout(3600)
def test_rollout_engines_in_their_own_job_step(slurm_cluster, tmp_path):
    """ROLLOUT_NODES=1 on the one-node cluster: the vLLM engines run in a job step of their
    own (`sao-serve`: `python -m sao_megatron.cli.serve`, sharing the node with the trainer's
    step), the trainer finds them through RUN_DIR/rollout/engine_urls.json, loads its weights
    into them and syncs every new version through the shared run_dir; it starts no engine
    itself."""
    run_dir = tmp_path / "run"
    rl_steps = 4
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SAO_"))}
    env |= {"RUN_DIR": str(run_dir), "ROLLOUT_NODES": "1"}
    sub = subprocess.run(
        ["sbatch", "--parsable", "--job-name=sao-slurm-engines",
         f"--output={tmp_path}/slurm-%j.out", str(SBATCH), *SMALL, "sft.steps=3",
         "value_pretrain.steps=1",
         f"rl.steps={rl_steps}", "tasks.num_eval_tasks=0", "checkpoint.save_interval=100",
         "rollout.startup_timeout_s=1200", "logging.tensorboard=false"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    out_file = tmp_path / f"slurm-{job_id}.out"
    urls_file = run_dir / "rollout" / "engine_urls.json"
    seen_urls: list[str] = []
    seen_versions: dict[str, int] = {}

    def watch(job: dict[str, str]) -> bool:
        """Record the published URLs and the weight versions the engines report meanwhile."""
        if not seen_urls and urls_file.exists():
            try:
                seen_urls.extend(json.loads(urls_file.read_text())["urls"])
            except (ValueError, KeyError):
                pass
        for url in seen_urls:
            if (v := _weight_version(url)) is not None:
                seen_versions[url] = max(v, seen_versions.get(url, -1))
        return job.get("JobState") == "COMPLETED"

    t0 = time.monotonic()
    try:
        _wait("the job to complete", watch, job_id, out_file, 2400, 0.5)
    finally:
        if _job(job_id).get("JobState") not in (*ENDED, None):
            subprocess.run(["scancel", job_id], check=False)
    log = out_file.read_text()
    job = _job(job_id)
    print(
        f"\nslurm job {job_id}: COMPLETED in {time.monotonic() - t0:.0f} s; engines {seen_urls}, "
        f"weight versions seen while running {seen_versions}; {out_file}"
    )
    assert job["ExitCode"] == "0:0" and job["Restarts"] == "0"
    assert "rollout engines on 1 node(s) (localhost, shared with the trainer)" in log
    # The URLs the engine step published are what the trainer used: this node's name, not
    # loopback, each one engine of the serve step, and the trainer started no engine itself.
    assert len(seen_urls) == 1, f"no engine_urls.json seen while the job ran; see {out_file}"
    url = seen_urls[0]
    assert url.startswith(f"http://{socket.gethostname()}:"), url
    assert "[engines 0]" in log and f"engine 0 ready at {url}" in log
    ready = [line for line in log.splitlines() if "remote engines ready after" in line]
    assert len(ready) == 1 and ready[0].endswith(
        url
        + " (logs "
        + str(run_dir / "rollout" / "remote" / socket.gethostname() / "engines" / "engine0.log")
        + ")"
    )
    assert f"remote engines {url} serve policy version 0" in log
    assert not (run_dir / "rollout" / "engines").exists()  # no local engine was started
    # Every policy version reached the engine through the shared run_dir; the engine step
    # reports the last one when the trainer releases it, and exits 0.
    for version in range(1, rl_steps + 1):
        assert f"weights v{version}: " in log, f"version {version} never synced; see {out_file}"
    # the start weights (v0) go through the same hand-off as every update (EngineFleet.load)
    synced = [line for line in log.splitlines() if "weights v" in line and "failed" in line]
    assert [int(line.split("weights v")[1].split(":")[0]) for line in synced] == list(
        range(rl_steps + 1)
    ), synced
    assert all(line.endswith("failed []") for line in synced), synced
    assert seen_versions.get(url, -1) >= 1, f"never saw the engine past version 0: {out_file}"
    assert f"engine {url}: weight version {rl_steps} at shutdown" in log
    assert "released by the trainer" in log
    assert "engine step exited with status 0" in log
    assert "Traceback" not in log, f"a traceback in {out_file}"
    assert _steps(run_dir / "rl" / "metrics.jsonl") == list(range(1, rl_steps + 1))
    assert not urls_file.exists()  # the engine step cleaned up after itself
