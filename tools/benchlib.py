"""Shared plumbing of the end-to-end benchmarks (`bench_sao_vs_grpo.py`, `bench_ablations.py`,
`eval_horizon.py`): run `sao-train` jobs from one shared SFT checkpoint, read their metrics,
summarise runs with median and spread, describe the machine, and rewrite a section of
docs/BENCHMARKS.md.

Every job is a real `sao-train` subprocess (`python -m sao_megatron.cli.train CONFIG
overrides...`) so a benchmark measures exactly what a user runs. A finished run (its
`summary.json`, and no `bench_running` left by a job that was stopped or failed) is reused
(delete its folder to re-measure); an unfinished one is refused until its folder is deleted.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sao_megatron.trainer.metrics import read_metrics  # noqa: E402

DOC = REPO / "docs" / "BENCHMARKS.md"


# ---------------------------------------------------------------------------- machine
def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else what `platform` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_info() -> dict[str, str]:
    """Cores, CPU model, torch, load average, UTC date and git commit (with a dirty flag)."""
    import torch

    cpu = cpu_model()
    commit = _git("rev-parse", "--short", "HEAD")
    if _git("status", "--porcelain", "--untracked-files=no"):
        commit += " (+ uncommitted changes)"
    info = {
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "torch": torch.__version__,
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "commit": commit,
        "loadavg_1min": f"{os.getloadavg()[0]:.1f}",
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


JOBS_RUN = 0  # jobs this process actually ran (0: every run was reused from disk)


def measured_machine_info(out: Path, start: dict[str, str], name: str) -> dict[str, str]:
    """Machine facts of the measurement: `start` (taken before the first job) completed with the
    load average at the end, saved as out/machine_<name>.json; when this invocation reran nothing
    (every run reused), the saved facts of the original measurement are returned instead."""
    path = out / f"machine_{name}.json"
    if JOBS_RUN == 0 and path.exists():
        return json.loads(path.read_text())
    info = dict(start)
    info["loadavg_1min_end"] = f"{os.getloadavg()[0]:.1f}"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info, indent=1))
    return info


def machine_line(info: dict[str, str]) -> str:
    gpu = f", GPU {info['gpu']}" if "gpu" in info else ", no GPU"
    load = f"1-minute load average {info['loadavg_1min']} before"
    if "loadavg_1min_end" in info:
        load += f" and {info['loadavg_1min_end']} at the end (vLLM's CPU threads count in it)"
    cpu = info["cpu"]
    return (
        f"Machine: `nproc` = {info['nproc']}, CPU '{cpu}'{gpu}, torch {info['torch']}, "
        f"{load}. Date: {info['date_utc']} UTC. Commit: {info['commit']}."
    )


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ---------------------------------------------------------------------------- jobs
#: in a run folder while run_job's job runs; left behind by a job that was stopped or failed
RUNNING_MARK = "bench_running"


def run_job(config: str, overrides: list[str], run_dir: Path, *, force: bool = False) -> Path:
    """Run `sao-train config run_dir=... overrides` unless run_dir holds its finished run.

    The job's stdout/stderr go to run_dir/job.log. A job writes summary.json from its first
    stage on, so run_dir/bench_running marks a job this function started and that has not
    ended with exit 0; such a folder is never reused. Raises RuntimeError with the log's tail if
    the job fails, and when run_dir holds another job's run or an unfinished one (delete it).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {"config": config, "overrides": overrides}
    spec_file = run_dir / "bench_job.json"
    running = run_dir / RUNNING_MARK
    if running.exists() and not force:
        raise RuntimeError(
            f"{run_dir} holds an unfinished run (its job was stopped or failed: {running} "
            "exists); delete the folder to run it again"
        )
    if (run_dir / "summary.json").exists() and not force:
        old = json.loads(spec_file.read_text()) if spec_file.exists() else spec
        if old != spec:
            raise RuntimeError(
                f"{run_dir} holds a finished run of another job ({old}); delete the folder or "
                "use another --out"
            )
        print(f"[bench] reusing {run_dir} (delete it to re-measure)", flush=True)
        return run_dir
    spec_file.write_text(json.dumps(spec, indent=1))
    running.write_text(f"started {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC\n")
    global JOBS_RUN
    JOBS_RUN += 1
    cmd = [sys.executable, "-m", "sao_megatron.cli.train", config, f"run_dir={run_dir}"]
    cmd += overrides
    print("[bench] " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(run_dir / "job.log", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = "\n".join((run_dir / "job.log").read_text().splitlines()[-40:])
        raise RuntimeError(f"job failed (exit {rc}), log {run_dir / 'job.log'}:\n{tail}")
    running.unlink()
    print(f"[bench]   done in {time.perf_counter() - t0:.0f} s", flush=True)
    return run_dir


def shared_sft(config: str, overrides: list[str], out: Path) -> Path:
    """Run (once) the config's SFT stage alone into `out`; later runs start from its weights."""
    return run_job(config, ["stages=[sft]", "tasks.num_eval_tasks=0", *overrides], out)


def seed_from_sft(sft_dir: Path, run_dir: Path) -> None:
    """Give run_dir the SFT run's tokenizer and final SFT checkpoint (hard links), so that a job
    with stages without "sft" starts RL from those weights (controller: rl_stage). A job with
    a Hugging Face tokenizer (``tokenizer.kind: hf``) trains none: its run has no tokenizer/ and
    each run reads the model's own."""
    if not (sft_dir / "checkpoints" / "sft").is_dir():
        raise FileNotFoundError(f"{sft_dir}: no checkpoints/sft: the SFT run did not finish")
    for sub in ("tokenizer", "checkpoints/sft"):
        dst = run_dir / sub
        if not dst.exists() and (sft_dir / sub).exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(sft_dir / sub, dst, copy_function=os.link)


def rl_overrides(user: list[str], budget_s: float, num_eval_tasks: int, repeat: int) -> list[str]:
    """Overrides shared by every benchmark RL run: the wall-clock budget (steps unbounded), the
    repeat's seeds (model/data seed, task stream, sampling), no periodic checkpoints."""
    return [
        *user,
        "rl.steps=100000",
        f"rl.time_budget_s={budget_s:g}",
        f"tasks.num_eval_tasks={num_eval_tasks}",
        "checkpoint.save_interval=0",
        "logging.console=false",
        f"seed={repeat}",
        f"tasks.train_seed={repeat + 1}",
        f"rollout.seed={repeat}",
    ]


def sao_overrides(has_value_pretrain: bool) -> list[str]:
    return ["stages=[value_pretrain,rl]" if has_value_pretrain else "stages=[rl]"]


def job_algorithm(config: str, overrides: list[str]):
    """The algorithm object the job `config` + `overrides` trains: `registry.build` of its
    resolved ``algorithm`` section. Tools ask it what a run needs (``needs_value_model``: a
    critic and its pre-training; ``group_size`` > 1: grouped sampling) instead of testing
    ``algorithm.name``."""
    from sao_megatron.algorithm import registry
    from sao_megatron.configs import load_config
    from sao_megatron.trainer.job import JobConfig

    return registry.build(load_config(JobConfig, str(REPO / config), overrides).algorithm)


# ---------------------------------------------------------------------------- run summary
@dataclass
class RunFigures:
    """What one RL run measured (from run_dir/rl/metrics.jsonl and run_dir/summary.json)."""

    name: str
    steps: int
    wall_s: float
    trajectories_per_s: float  # trained trajectories / wall-clock of value pre-training + RL
    train_tokens_per_s: float  # real tokens forward/backward-ed / time in train steps
    peak_rss_gib: float  # max over updates of the trainer's per-update peak RSS
    peak_gpu_gib: float | None
    time_split: dict[str, float]  # fraction of wall-clock: rollout wait, train, sync, other
    abs_one_minus_ratio: float  # mean over steps
    version_lag: float  # mean over steps
    worker_utilization: float  # engines' busy fraction (last step, cumulative over the run)
    before: dict[str, float]
    after: dict[str, float]
    curve: list[tuple[float, float]] = field(default_factory=list)  # (elapsed s, reward/mean)
    deviation_curve: list[tuple[float, float]] = field(default_factory=list)
    # (elapsed s, held-out eval/success_rate): before RL at 0, rl.eval_interval(_s) evaluations
    # at the stage's clock, the final one at the last step's
    eval_curve: list[tuple[float, float]] = field(default_factory=list)
    # (elapsed s, value/explained_variance_before) per RL step (critics only)
    ev_curve: list[tuple[float, float]] = field(default_factory=list)


def run_figures(run_dir: Path, name: str) -> RunFigures:
    recs = [r for r in read_metrics(run_dir / "rl") if "time/rl_elapsed_s" in r]
    if not recs:
        raise RuntimeError(f"{run_dir}/rl/metrics.jsonl has no RL step records")
    summary = json.loads((run_dir / "summary.json").read_text())
    wall = recs[-1]["time/rl_elapsed_s"]
    trained_traj = sum(r.get("batch/num_trajectories", 0.0) for r in recs)
    t_train = sum(r.get("time/train", 0.0) for r in recs)
    tokens = sum(r["throughput/train_tokens_per_s"] * r.get("time/train", 0.0) for r in recs)
    split = {
        "rollout wait": sum(r.get("time/rollout", 0.0) for r in recs),
        "train": t_train,
        "sync": sum(r.get("time/sync", 0.0) for r in recs),
        "checkpoint": sum(r.get("time/checkpoint", 0.0) for r in recs),
    }
    split["other"] = max(wall - sum(split.values()), 0.0)  # value pre-training, logging
    gpu = [r["memory/peak_gpu_gib"] for r in recs if r.get("memory/peak_gpu_gib") is not None]
    return RunFigures(
        name=name,
        steps=len(recs),
        wall_s=wall,
        trajectories_per_s=trained_traj / wall,
        train_tokens_per_s=tokens / max(t_train, 1e-9),
        peak_rss_gib=max(r.get("memory/peak_rss_gib") or 0.0 for r in recs),
        peak_gpu_gib=max(gpu) if gpu else None,
        time_split={k: v / wall for k, v in split.items()},
        abs_one_minus_ratio=_mean(r.get("deviation/abs_one_minus_ratio_mean") for r in recs),
        version_lag=_mean(r.get("deviation/version_lag_mean") for r in recs),
        worker_utilization=recs[-1].get("rollout/worker_utilization") or float("nan"),
        before={k[7:]: v for k, v in summary.items() if k.startswith("before/")},
        after={k[6:]: v for k, v in summary.items() if k.startswith("after/")},
        curve=[(r["time/rl_elapsed_s"], r["reward/mean"]) for r in recs],
        deviation_curve=[
            (r["time/rl_elapsed_s"], r["deviation/abs_one_minus_ratio_mean"])
            for r in recs
            if r.get("deviation/abs_one_minus_ratio_mean") is not None
        ],
        eval_curve=eval_curve(run_dir, wall),
        ev_curve=[
            (r["time/rl_elapsed_s"], r["value/explained_variance_before"])
            for r in recs
            if r.get("value/explained_variance_before") is not None
        ],
    )


def eval_curve(run_dir: Path, wall_s: float) -> list[tuple[float, float]]:
    """Held-out success against the RL stage's clock from run_dir/rl/eval.jsonl: the
    before-RL evaluation at 0 s, evaluations during RL at their ``time/rl_elapsed_s``, the
    final one (the last record without a clock reading) at `wall_s`."""
    path = run_dir / "rl" / "eval.jsonl"
    if not path.exists():
        return []
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = []
    for i, r in enumerate(recs):
        if "eval/success_rate" not in r:
            continue
        if "time/rl_elapsed_s" in r:
            t = r["time/rl_elapsed_s"]
        elif i == 0 and r.get("step") == 0:
            t = 0.0
        else:
            t = wall_s
        out.append((float(t), float(r["eval/success_rate"])))
    return out


def _mean(xs) -> float:
    v = [x for x in xs if x is not None]
    return sum(v) / len(v) if v else float("nan")


def mean_se(xs) -> tuple[float, float, int]:
    """(mean, standard error = sample std / sqrt(n), n) of the values that are not None/NaN;
    se is NaN for n < 2 and both are NaN for n = 0."""
    v = [float(x) for x in xs if x is not None and x == x]
    n = len(v)
    if not n:
        return math.nan, math.nan, 0
    m = sum(v) / n
    se = math.sqrt(sum((x - m) ** 2 for x in v) / (n - 1) / n) if n > 1 else math.nan
    return m, se, n


def spread(values: list[float], fmt: str = "{:.3g}") -> str:
    """'median [min, max]' of repeated measurements ('x' alone for one value)."""
    v = [x for x in values if x is not None and x == x]
    if not v:
        return "-"
    if len(v) == 1:
        return fmt.format(v[0])
    lo, med, hi = min(v), statistics.median(v), max(v)
    return f"{fmt.format(med)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def smooth(points: list[tuple[float, float]], window: int = 5) -> tuple[list[float], list[float]]:
    """Trailing moving average of y over `window` points (x unchanged)."""
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    out = [
        sum(ys[max(0, i - window + 1) : i + 1]) / (i - max(0, i - window + 1) + 1)
        for i in range(len(ys))
    ]
    return xs, out


# ---------------------------------------------------------------------------- docs
READING = "<!-- reading -->"


def section_slug(section: str) -> str:
    """A docs/BENCHMARKS.md section title as a file-name part: lower case, every run of other
    characters one underscore (e.g. "SAO vs GRPO (seeds)" -> "sao_vs_grpo_seeds")."""
    return re.sub(r"[^a-z0-9]+", "_", section.lower()).strip("_")


def write_section(heading: str, body: str, doc: Path = DOC) -> None:
    """Replace (or append) the ``## heading`` section of docs/BENCHMARKS.md with `body`.

    A body ending in the READING marker keeps the text that followed the marker in the old
    section (the hand-written reading of the figures)."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"^## {re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    block = f"## {heading}\n\n{body.strip()}\n\n"
    old = pattern.search(text)
    if old and READING in old.group(0) and block.rstrip().endswith(READING):
        # keep the hand-written reading of the figures (re-read it after re-measuring)
        block = block.rstrip() + old.group(0).split(READING, 1)[1].rstrip() + "\n\n"
    text = (
        pattern.sub(lambda _: block, text)
        if pattern.search(text)
        else text.rstrip() + "\n\n" + block
    )
    doc.write_text(text.rstrip() + "\n")
    print(f"[bench] wrote section '{heading}' of {doc}", flush=True)
