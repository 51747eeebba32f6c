"""Per-step metrics: JSONL + TensorBoard (+ W&B) files, a tqdm progress bar, phase timers, memory.

One `MetricsLogger` per process; only the logging rank (``is_logging_rank=True``: rank 0 of the
last pipeline stage, where losses live) writes anything. Each logged step is one JSON object per
line in ``<run_dir>/metrics.jsonl`` (flushed per line, so a crash loses at most the current
step), the same scalars in TensorBoard under ``<run_dir>/tensorboard``, and in W&B when enabled and
installed. Non-finite values are written as JSON ``null`` with a warning naming the key.

Metric names are ``group/name`` (TensorBoard groups by the prefix); the controller's standard
names are listed in `STANDARD_METRICS` (units in the comments) and are what
``tools/plot_metrics.py`` and the progress bar look for.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

METRICS_FILE = "metrics.jsonl"
#: held-out evaluations of the RL stage, one record per evaluation (``step`` = policy version)
EVAL_FILE = "eval.jsonl"
TENSORBOARD_DIR = "tensorboard"

#: Standard metric names written by the controller (unit after the colon).
STANDARD_METRICS: dict[str, str] = {
    "reward/mean": "mean episode return of the trained trajectories",
    "reward/success_rate": "fraction of episodes solved, 0..1",
    "episode/length_mean": "mean number of action nodes per episode",
    "loss/policy": "policy (DIS or PPO-clip) loss",
    "loss/value": "clipped value loss",
    "value/explained_variance": "1 - Var(R - V) / Var(R)",
    "placement/value_ahead": "1: this step's value work ran during the previous step "
    "(value.placement=separate only)",
    "deviation/abs_one_minus_ratio_mean": "mean |1 - r_t| over action tokens (target < 0.05)",
    "deviation/mismatch_kl": "E[l_b - l_theta], nats/token",
    "deviation/k3": "k3 KL estimator, nats/token",
    "deviation/ess": "normalised effective sample size, 0..1",
    "deviation/dropped_fraction": "fraction of action tokens outside the DIS band "
    "(algorithm.importance.eps_low/eps_high; dropped with weighting dis_band)",
    "deviation/dropped_against_advantage_fraction": "fraction of action tokens outside the DIS "
    "band on the side against their advantage (A > 0, r <= 1 - eps_low; A < 0, r >= 1 + eps_high): "
    "no gradient under dis_band, pulled back by ppo_clip",
    "deviation/version_lag_mean": "train_version - token policy_version, mean (versions)",
    "deviation/version_lag_max": "same, max (versions)",
    "deviation/lag0/abs_one_minus_ratio_mean": "mean |1 - r_t| over the lag-0 action tokens",
    "deviation/routing_mismatch_frac": "share of (token, MoE layer) top-k choices where the "
    "trainer's own experts differ from the rollout's recorded ones, 0..1 (MoE with routing)",
    "grad_norm/policy": "global grad norm before clipping",
    "policy/skipped_zero_advantage": "1: no fresh action token had a non-zero advantage, the "
    "policy step was skipped (algorithm.skip_zero_advantage_updates)",
    "grad_norm/value": "global grad norm before clipping",
    "lr/policy": "learning rate",
    "lr/value": "learning rate",
    "throughput/rollout_trajectories_per_s": "trajectories/s finished by the rollout engine",
    "throughput/rollout_tokens_per_s": "generated tokens/s",
    "throughput/train_tokens_per_s": "trained tokens/s",
    "throughput/steps_per_s": "train steps/s (added by MetricsLogger)",
    "rollout/worker_utilization": "busy fraction of rollout workers since the start, 0..1",
    "rollout/busy_fraction": "engines' busy fraction of this step's wall time, 0..1",
    "rollout/staleness/in_bound_fraction/turns_<bucket>": "share of the action tokens of the "
    "batch's episodes of <bucket> turns (1, 2-4, 5-16, 17-64, 65-256, 257-inf) within the "
    "staleness bound, 0..1 (sao_megatron.rollout.staleness.in_bound_by_length)",
    "rollout/staleness/num_episodes/turns_<bucket>": "episodes of <bucket> turns in the batch "
    "(buckets without one are not logged)",
    "controller/max_staleness": "deviation controller's admission bound eta (versions)",
    "controller/max_inflight": "deviation controller's episodes-in-flight bound",
    "deviation/token_bound": "per-token staleness bound of this batch (the controller's eta)",
    "time/rollout": "s per step waiting for trajectories",
    "time/value": "s per step in the value phases (value targets + K value updates)",
    "time/old_logprobs": "s per step recomputing the old log-probs (GRPO; SAO with decoupled_ppo)",
    "time/advantages": "s per step computing advantages (SAO: with a fresh value forward)",
    "time/policy": "s per step in the policy update alone (every algorithm)",
    "time/sync": "s per step publishing weights",
    "time/checkpoint": "s per step saving checkpoints",
    "memory/peak_rss_gib": "peak resident host memory, GiB",
    "memory/peak_gpu_gib": "peak torch.cuda allocated memory, GiB",
}

#: Progress-bar label -> metric keys (the first one present is shown).
PROGRESS_KEYS: dict[str, tuple[str, ...]] = {
    "loss": ("loss/policy", "sft/loss", "loss/value"),
    "reward": ("reward/mean",),
    "success": ("reward/success_rate",),
    "dev": ("deviation/abs_one_minus_ratio_mean",),
    "route": ("deviation/routing_mismatch_frac",),  # MoE runs with recorded routing
    "eta": ("controller/max_staleness",),  # with rollout.deviation_target
}


@dataclass(kw_only=True)
class LoggingConfig:
    """Where and how metrics are written.

    The folder is the logger's ``run_dir`` argument (a job: run_dir/<stage>), not a field.

    Fields:
        tensorboard: write TensorBoard event files.
        wandb: also log to Weights & Biases (needs ``pip install wandb``; a warning otherwise).
        wandb_project: W&B project name.
        log_interval: write every this many steps (>= 1); `MetricsLogger.log(force=True)`
            always writes.
        console: show progress on the logging rank: a tqdm bar when stderr is a terminal,
            else (a log file, a SLURM .out) one plain line every ``progress_interval`` steps
            and at the last step, never ``\r``-joined bar redraws.
        progress_interval: steps between the plain progress lines (>= 1).
        eval_episodes: write every held-out episode of each evaluation (task, seed, outcome,
            decoded turns) to run_dir/rl/eval_episodes/step_<step>.jsonl (~1-3 KB an episode).
    """

    #: former fields -> the fix, for migration errors (sao_megatron.configs)
    MOVED_FIELDS: ClassVar[dict[str, str]] = {
        "run_dir": "was removed: metrics go to <run_dir>/<stage>/; set the top-level run_dir",
    }

    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "sao_megatron"
    log_interval: int = 1
    console: bool = True
    progress_interval: int = 10
    eval_episodes: bool = True

    def __post_init__(self) -> None:
        if self.log_interval < 1:
            raise ValueError(f"logging.log_interval={self.log_interval}: must be >= 1")
        if self.progress_interval < 1:
            raise ValueError(f"logging.progress_interval={self.progress_interval}: must be >= 1")


def _to_scalar(key: str, value: Any) -> float | int | str | bool | None:
    """A JSON-able scalar; one-element tensors/numpy arrays become Python numbers."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"metric '{key}': expected a scalar, got shape {tuple(value.shape)}")
        return value.item()
    if hasattr(value, "item") and getattr(value, "size", None) == 1:  # numpy scalar / array
        return value.item()
    raise TypeError(f"metric '{key}': expected a scalar number or str, got {type(value).__name__}")


class MetricsLogger:
    """Writes per-step metrics (see module docstring). Use as a context manager or call close().

    Args:
        config: the logging config.
        run_dir: folder for metrics.jsonl and tensorboard/ (created on the logging rank).
        is_logging_rank: True on exactly one rank (rank 0 of the last PP stage); all others
            no-op.
        total_steps: number of train steps, for the progress bar (None = unknown).
        initial_step: first step number (a resumed run starts the bar there).
        stage: the stage's name, shown first on the bar and on every progress line.
        metrics_file: the JSONL file's name in `run_dir` (`METRICS_FILE`: one record per train
            step; `EVAL_FILE`: the held-out evaluations).
    """

    def __init__(
        self,
        config: LoggingConfig,
        run_dir: str | Path,
        *,
        is_logging_rank: bool,
        total_steps: int | None = None,
        initial_step: int = 0,
        stage: str = "",
        metrics_file: str = METRICS_FILE,
    ) -> None:
        self.config = config
        self.enabled = is_logging_rank
        self.run_dir = Path(run_dir)
        self._file = None
        self._tb = None
        self._wandb = None
        self._bar = None
        self._warned: set[str] = set()
        self._last: tuple[int, float] | None = None
        self.stage, self.total_steps = stage, total_steps
        self._plain = False  # console progress as plain lines (stderr is not a terminal)
        self._pending: str | None = None  # the last plain line not yet printed
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / metrics_file, "a", buffering=1)  # line buffered
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIR))
        if config.wandb:
            try:
                import wandb
            except ImportError:
                warnings.warn(
                    "logging.wandb=True but wandb is not installed: W&B logging is off "
                    "(pip install wandb, or set logging.wandb=false)",
                    stacklevel=2,
                )
            else:
                self._wandb = wandb.init(project=config.wandb_project, dir=str(self.run_dir))
        if config.console and not _is_tty(sys.stderr):
            self._plain = True
        elif config.console:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=initial_step,
                desc=stage or None,
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )

    def log(self, step: int, metrics: Mapping[str, Any], *, force: bool = False) -> None:
        """Record one train step's metrics.

        Args:
            step: train step (x axis everywhere).
            metrics: name -> scalar (float/int/bool/str or 1-element tensor/array).
        Adds ``throughput/steps_per_s`` (from the previous logged step) and ``time/unix``.

        Raises:
            TypeError: a value that is not a scalar, naming the key.
        """
        if not self.enabled:
            return
        now = time.time()
        record: dict[str, Any] = {"step": int(step)}
        for key, value in metrics.items():
            record[key] = _to_scalar(key, value)
        if self._last is not None and step > self._last[0] and now > self._last[1]:
            record.setdefault(
                "throughput/steps_per_s", (step - self._last[0]) / (now - self._last[1])
            )
        self._last = (int(step), now)
        record["time/unix"] = now
        self._update_bar(step, record)
        if not force and step % self.config.log_interval != 0:
            return
        for key, value in record.items():
            if isinstance(value, float) and not math.isfinite(value):
                record[key] = None
                if key not in self._warned:
                    self._warned.add(key)
                    warnings.warn(
                        f"metric '{key}' is {value} at step {step}; written as null "
                        "(warned once per key)",
                        stacklevel=2,
                    )
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        numeric = {
            k: v
            for k, v in record.items()
            if k not in ("step", "time/unix") and isinstance(v, (int, float)) and v is not None
        }
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, float(value), global_step=int(step))
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=int(step))

    def _update_bar(self, step: int, record: Mapping[str, Any]) -> None:
        if self._bar is None and not self._plain:
            return
        post = {}
        for label, keys in PROGRESS_KEYS.items():
            value = next((record[k] for k in keys if k in record), None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                post[label] = f"{value:.3g}"
        if "throughput/steps_per_s" in record:
            post["step/s"] = f"{record['throughput/steps_per_s']:.3g}"
        if self._bar is not None:
            self._bar.update(max(int(step) - self._bar.n, 0))
            self._bar.set_postfix(post, refresh=True)
            return
        of = f"/{self.total_steps}" if self.total_steps else ""
        head = f"[{self.stage}] " if self.stage else ""
        line = f"{head}step {int(step)}{of} " + " ".join(f"{k}={v}" for k, v in post.items())
        self._pending = line.rstrip()
        last = self.total_steps is not None and int(step) >= self.total_steps
        if step == 1 or last or step % self.config.progress_interval == 0:
            self._flush_progress()

    def _flush_progress(self) -> None:
        if self._pending is not None:
            print(self._pending, file=sys.stderr, flush=True)
            self._pending = None

    def write(self, message: str) -> None:
        """Print a line on the logging rank without breaking the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        """Flush and close every sink (idempotent); prints the last progress line if the
        interval skipped it."""
        self._flush_progress()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/metrics.jsonl`` (or of the file itself), in file order; a
    truncated last line (crash mid-write) is skipped. Raises FileNotFoundError naming the path."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics file (was the run started with this run_dir?)")
    records = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
    return records


class Timer:
    """Wall-clock seconds per phase, accumulated until `summary()`.

    ``with timer.phase("rollout"): ...`` adds the elapsed time to ``time/rollout``. With
    ``cuda_sync=True`` (and CUDA present) the device is synchronised at both ends so GPU work is
    counted in the phase that launched it.
    """

    def __init__(self, *, cuda_sync: bool = False) -> None:
        self.cuda_sync = cuda_sync and torch.cuda.is_available()
        self._totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body of the with-block under ``time/<name>`` (seconds)."""
        if self.cuda_sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda_sync:
                torch.cuda.synchronize()
            self._totals[f"time/{name}"] += time.perf_counter() - start

    def summary(self, reset: bool = True) -> dict[str, float]:
        """``{"time/<phase>": seconds}`` since the last reset."""
        out = dict(self._totals)
        if reset:
            self._totals.clear()
        return out


def _read_status_kib(field: str) -> int | None:
    """A ``VmHWM``/``VmRSS`` line of /proc/self/status in KiB (None where /proc is absent)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_memory() -> bool:
    """Start a new peak-memory window (e.g. one training update); returns True if it could.

    Host: writes ``5`` to ``/proc/self/clear_refs``, which resets the kernel's peak RSS
    (``VmHWM``) to the current RSS (Linux >= 4.0, proc(5)). GPU: ``reset_peak_memory_stats``.
    Where neither works (macOS) the peak stays the process lifetime's.
    """
    ok = False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        ok = True
    except OSError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
    return ok


def peak_memory_gib() -> dict[str, float]:
    """Peak host RSS of this process and (with CUDA) peak torch-allocated GPU memory, in GiB,
    since the last `reset_peak_memory()` (or since the process started).

    Host: ``VmHWM`` of /proc/self/status (Linux); elsewhere
    ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (KiB on Linux, bytes on macOS), the lifetime
    peak. GPU: ``torch.cuda.max_memory_allocated()`` of the current device.
    """
    hwm = _read_status_kib("VmHWM")
    if hwm is not None:
        rss_bytes = hwm * 1024
    else:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rss_bytes = rss if sys.platform == "darwin" else rss * 1024
    out = {"memory/peak_rss_gib": rss_bytes / 2**30}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["memory/peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def rollout_metrics(stats: dict) -> dict[str, float]:
    """The rollout's counters, with the throughput/utilisation figures under standard names."""
    out = dict(stats)
    out["throughput/rollout_trajectories_per_s"] = out.pop("rollout/trajectories_per_s", 0.0)
    out["throughput/rollout_tokens_per_s"] = out.pop("rollout/tokens_per_s", 0.0)
    util = [v for k, v in stats.items() if k.startswith("engine/") and k.endswith("/utilisation")]
    if util:
        out["rollout/worker_utilization"] = sum(util) / len(util)
    return out


def eval_summary(metrics: dict[str, float]) -> str:
    """One console line of an evaluation: each env's success rate with its standard error and
    task count, then the episode errors (e.g. ``chain_sum 10.2% +- 1.9 (256 tasks); 0 errors``)."""
    parts = []
    for key, rate in sorted(metrics.items()):
        if key.startswith("eval/") and key.endswith("/success_rate") and key.count("/") == 2:
            env = key.split("/")[1]
            se = metrics.get(f"eval/{env}/success_se", math.nan)
            n = metrics.get(f"eval/{env}/num_tasks", math.nan)
            parts.append(f"{env} {100 * rate:.1f}% +- {100 * se:.1f} ({n:.0f} tasks)")
    errors = metrics.get("eval/num_errors", 0.0)
    return "; ".join(parts) + f"; {errors:.0f} errors"


def episode_metrics(batch) -> dict[str, float]:
    """Reward, success and length statistics of the batch's trajectories."""
    totals = batch.node_rewards.sum(1)
    cut = batch.cut_action if batch.cut_action is not None else batch.truncated & False
    truncated = batch.truncated | cut
    return {
        "reward/mean": float(totals.mean()),
        "reward/success_rate": float((totals >= 1.0 - 1e-6).float().mean()),
        "episode/length_mean": float(batch.num_nodes.float().mean()),
        # budget-truncated or cut at the token budget (the latter do not bootstrap)
        "episode/truncated_fraction": float(truncated.float().mean()),
        "episode/cut_action_fraction": float(cut.float().mean()),
        "episode/action_tokens_per_trajectory": batch.num_action_tokens / batch.num_trajectories,
    }
