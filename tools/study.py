"""A study: a matrix of `sao-train` runs (algorithm x variant x seed) from one shared start,
run by one command that can be interrupted at any point and picked up later.

    python tools/study.py examples/studies/quickstart_bounds.yaml            # run what is missing
    python tools/study.py examples/studies/quickstart_bounds.yaml --plan     # cells, state, cost
    python tools/study.py examples/studies/quickstart_bounds.yaml --report   # tables and plots
    python tools/study.py STUDY.yaml --only 'sao*' --max-cells 2             # a part of it
    python tools/study.py STUDY.yaml --shared                                # shared stages only
    python tools/study.py STUDY.yaml --stop      # the running study saves and ends (resumable)

The study file (YAML) names the job config, the RL steps and evaluation every cell shares, the
algorithms, the variants (ablations) and the seeds; each cell is one run folder
``<out>/<algorithm>[+<variant>]/seed<N>`` with its provenance in ``cell.json`` (the exact
command, and per attempt the commit, a dirty-tree flag, UTC start and end, load averages, the
exit code and the RL steps done). Rerunning the command:

* skips a finished cell (``study_done.json``; never rerun, whatever else changes);
* continues an unfinished one in the same folder: `sao-train` resumes from the cell's latest
  checkpoint (``checkpoint.save_interval`` of the study, default every 10 RL steps), so an
  interruption loses at most that many steps;
* refuses an unfinished cell whose folder holds another job, naming the cell, the fields
  that changed and the fix (delete the folder, or give the changed cell another variant name).
  ``cell.json`` records the job's whole resolved config (the config file with the overrides),
  so an edit to the config file counts as a change and an override that restates the file's
  value does not; cells recorded before that, and the shared stages, are compared by their
  overrides.

Shared stages run once, into ``<out>/_shared``: the SFT start (``shared.sft``), and the value
pre-training from it (``shared.value_pretrain``) that every cell whose algorithm has a value
model starts from, unless its variant sets ``own_value_pretrain`` (a variant that changes the
critic: it pre-trains its own).

A finished cell is also *recorded* in the repository (``records``, default
``examples/studies/records/<study file name>``: its ``cell.json``, ``study_done.json``, held-out
evaluations, gzipped RL metrics and gzipped held-out episodes: tens to hundreds of KB),
because ``runs/`` is not committed and a machine can be replaced between sittings: a cell
recorded there counts as done (never rerun) and the report reads it when its run folder is
gone. Commit the records with the report.
``--report --write`` refuses to replace a section that lists a finished cell the study can no
longer read (neither run folder nor record), rather than drop its row.

The shared stages' weights are not recorded (hundreds of MB), so a new machine redoes them; so
that its cells start where the recorded ones did, each finished shared stage is *fingerprinted*
(the SHA-256 of every loss, gradient norm and explained variance it logged, bit for bit) into
``<records>/_shared/<stage>.json``, each cell says in ``shared_start.json`` which fingerprints it
started from, and a redone stage that differs from the record stops the study before any cell
starts from it, naming the figures that differ. The report says which cells came from which
start; the record also keeps the seconds the stage took, so that ``--plan`` prices redoing it
(a new machine's sitting starts with them).

``--report`` regenerates every table and the plot from the folders and records that exist and
marks the cells that are missing or unfinished; two axes, always: held-out success against
environment episodes consumed (robust to machine load) and against wall-clock (meaningful only
for runs that had the cores to themselves: the load averages are in the per-cell table).
Where cells wrote their held-out episodes (`logging.eval_episodes`), it also compares them task
by task (every evaluation plays the same tasks): after vs before RL in each cell, and the first
group against each other one on each seed, with the exact McNemar p-value.
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import benchlib
from benchlib import REPO, mean_se, seed_from_sft

from sao_megatron.trainer.metrics import read_metrics

DONE = "study_done.json"
CELL = "cell.json"
#: `<out>/stop`: `--stop` creates it; every job of the study gets it as its SAO_STOP_FILE
#: (sao_megatron.trainer.signals: the trainer saves after its current step, renames the file
#: to `stop.consumed` and exits 0), and the runner starts nothing after it
STOP = "stop"
#: `<out>/runner.json`: the running study's pid and current job (removed when it exits)
RUNNER = "runner.json"
#: what a finished cell's record keeps (relative paths in its run folder); the RL metrics are
#: kept gzipped (`METRICS_GZ`): 1000 updates of metrics are ~5 MB as text
EVALS = "rl/eval.jsonl"
METRICS = "rl/metrics.jsonl"
METRICS_GZ = METRICS + ".gz"
#: the held-out episodes of each evaluation (`logging.eval_episodes`); a record keeps the first
#: and the last evaluation's, gzipped (~100 KB a 256-episode evaluation): the same tasks in
#: every cell, so cells compare task by task
EPISODES = "rl/eval_episodes"
#: in a cell's run folder and record: the fingerprints (`stage_fingerprint`) of the shared
#: stages it started from
SHARED_START = "shared_start.json"
#: the metric keys a shared stage's fingerprint hashes: what its weights determine (losses,
#: gradient norms, accuracies, explained variances), not its clock
FINGERPRINT_KEYS = re.compile(r"loss|grad_norm|accuracy|explained_variance")


class StudyStopped(Exception):  # noqa: N818 - a control-flow outcome, not an error
    """The study was stopped with --stop: the running job saved and exited; nothing else runs."""


# ---------------------------------------------------------------------------- the study file
@dataclass(kw_only=True)
class Variant:
    """One ablation: overrides on top of the algorithm's; `own_value_pretrain` when it changes
    the critic (the shared pre-trained critic would not be its own); `algorithms`: the
    algorithms it applies to (empty: all)."""

    overrides: list[str] = field(default_factory=list)
    own_value_pretrain: bool = False
    algorithms: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    """the study's seeds this variant runs (empty: all of them); an ablation can run on fewer
    seeds than the main comparison"""


@dataclass(kw_only=True)
class HorizonEval:
    """`horizon_eval` (Tower-of-Hanoi studies): held-out success and per-move error rates of each
    finished cell's final policy (``hf_policy_final``) and of the RL start, at each horizon,
    by `tools/eval_horizon.py`'s evaluation (one vLLM engine, the job's episode loop), saved in
    the cell's ``horizon_eval.json`` as soon as measured (never rerun for the same key).

    Fields:
        horizons: optimal moves from the goal of the held-out puzzles (e.g. [50, 200, 500]).
        num_tasks: held-out puzzles per horizon, the same for every policy.
        groups: globs over cell groups ("sao", "sao+k1") to evaluate; empty: every group.
    """

    horizons: list[int] = field(default_factory=lambda: [50, 200, 500])
    num_tasks: int = 24
    groups: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class Study:
    """The parsed study file; see examples/studies/*.yaml for every field in use.

    Fields:
        name: the study's name (plot file name; the BENCHMARKS section is `section`).
        config: the job config every cell runs (path from the repository root).
        out: the study's folder (cells, shared stages, report).
        section: the docs/BENCHMARKS.md heading ``--report --write`` replaces.
        overrides: job overrides of every run, shared stages included.
        rl_steps: policy updates of every cell (its episode budget: the same trajectories per
            batch for every algorithm means the same episodes per update).
        num_eval_tasks / eval_interval: held-out tasks, evaluated before RL, every
            `eval_interval` RL steps and after.
        save_interval: RL checkpoint every this many steps (what an interruption can lose).
        shared_sft / shared_value_pretrain: run these stages once for all cells (see module).
        algorithms: name -> overrides; a name with settings in `tools/bench_sao_vs_grpo.py`
            (`ALGORITHM_SETTINGS`: sao, grpo, grpo_dis) gets its `algo_overrides` before its
            own.
        variants: name -> `Variant`; "" is the baseline (no overrides), implied unless
            `include_baseline` is false (a study of variants only, e.g. staleness bounds).
        seeds: the seeds of every (algorithm, variant); seed N sets ``seed=N rollout.seed=N``:
            the job derives parallel.seed = 1234 + N and tasks.train_seed = N from ``seed``
            (`sao_megatron.trainer.derived`), and rollout.seed is given too because a job
            config may set it, which would win over the derived value (the shipped configs
            leave it out). The held-out set, tasks.eval_seed, is fixed.
        group_size: GRPO's group (trajectories per task) for the named algorithms.
        seconds_per_step: algorithm -> RL seconds per step measured on a short run, for
            `--plan` until a cell of that algorithm has run (the study's own rate replaces it).
        horizon_eval: evaluate finished cells at several Hanoi horizons (`HorizonEval`).
        report_eval_keys: held-out metrics (``rl/eval.jsonl`` keys, e.g.
            "eval/gem/mean_turns") the report gives before and after RL, mean ± s.e. per group.
        shared_from: another study's `out` whose shared stages (``_shared``) this one starts
            from (same config and `overrides`: the stages' commands must match, else the run
            is refused as for a changed cell); empty: its own.
        shared_save_interval: checkpoint the shared stages every this many of their steps (SFT
            steps, value pre-training steps), so a long one resumes; 0: the config's own
            ``checkpoint.save_interval``.
        records: the committed folder of finished cells' records (see the module); empty: the
            study file's folder ``records/<study file name without .yaml>``.
    """

    name: str
    config: str
    out: str
    section: str = ""
    overrides: list[str] = field(default_factory=list)
    rl_steps: int = 50
    num_eval_tasks: int = 128
    eval_interval: int = 0
    save_interval: int = 10
    shared_sft: bool = True
    shared_value_pretrain: bool = True
    algorithms: dict[str, list[str]] = field(default_factory=dict)
    variants: dict[str, Variant] = field(default_factory=dict)
    include_baseline: bool = True
    seeds: list[int] = field(default_factory=lambda: [0])
    group_size: int = 8
    seconds_per_step: dict[str, float] = field(default_factory=dict)
    horizon_eval: HorizonEval | None = None
    report_eval_keys: list[str] = field(default_factory=list)
    shared_from: str = ""
    shared_save_interval: int = 0
    records: str = ""


def load_study(path: str | Path) -> Study:
    """A `Study` from a YAML file (OmegaConf structured: an unknown or misspelt key is an error
    naming it; `sao_megatron.configs.load_config`)."""
    from sao_megatron.configs import load_config

    study = load_config(Study, path)
    if not study.records:
        study.records = str(Path(path).parent / "records" / Path(path).stem)
    if not study.algorithms:
        raise ValueError(f"{path}: `algorithms` is empty: name at least one (e.g. sao: [])")
    if not study.include_baseline and not study.variants:
        raise ValueError(f"{path}: include_baseline is false and there are no `variants`")
    if study.rl_steps < 1 or study.save_interval < 0:
        raise ValueError(f"{path}: rl_steps must be >= 1 and save_interval >= 0")
    for name, v in study.variants.items():
        unknown = [a for a in v.algorithms if a not in study.algorithms]
        if unknown:
            raise ValueError(
                f"{path}: variants.{name}.algorithms names {unknown}, not in `algorithms` "
                f"({sorted(study.algorithms)})"
            )
        stray = [x for x in v.seeds if x not in study.seeds]
        if stray:
            raise ValueError(
                f"{path}: variants.{name}.seeds names {stray}, not in `seeds` ({study.seeds})"
            )
    h = study.horizon_eval
    if h is not None and (not h.horizons or min(h.horizons) < 1 or h.num_tasks < 1):
        raise ValueError(
            f"{path}: horizon_eval needs horizons >= 1 (e.g. [50, 200, 500]) and num_tasks >= 1"
        )
    return study


# ---------------------------------------------------------------------------- cells
@dataclass
class Cell:
    algorithm: str
    variant: str  # "" = the baseline
    seed: int
    run_dir: Path
    overrides: list[str]  # the job's, after the config path
    needs_value_model: bool
    own_value_pretrain: bool
    record_dir: Path | None = None  # its committed record (`record_cell`)

    @property
    def group(self) -> str:
        return self.algorithm + (f"+{self.variant}" if self.variant else "")

    @property
    def name(self) -> str:
        return f"{self.group}/seed{self.seed}"


def _algorithm_overrides(study: Study, name: str, base) -> list[str]:
    """The benchmark settings of `name` (`bench_sao_vs_grpo.ALGORITHM_SETTINGS`, when it has
    some) without their stages: the cell's stages are asked of its algorithm in `cells`."""
    from bench_sao_vs_grpo import ALGORITHM_SETTINGS, algo_overrides

    if name in ALGORITHM_SETTINGS:
        return [
            o
            for o in algo_overrides(name, study.group_size, False, base)
            if not o.startswith("stages=")
        ]
    return []


def cells(study: Study) -> list[Cell]:
    """Every cell of the study, in run order: seed-major (a cut-short study has every
    algorithm on its first seeds), then algorithm, then variant; with a baseline, its cells
    (the main comparison) all come before the variants' (the ablations)."""
    from sao_megatron.algorithm import registry
    from sao_megatron.configs import load_config
    from sao_megatron.trainer.job import JobConfig

    base = load_config(JobConfig, REPO / study.config, study.overrides)
    variants = {"": Variant()} if study.include_baseline else {}
    variants |= study.variants
    out = []
    for seed in study.seeds:
        for algo, algo_user in study.algorithms.items():
            algo_ov = [*_algorithm_overrides(study, algo, base), *algo_user]
            for vname, v in variants.items():
                if (v.algorithms and algo not in v.algorithms) or (v.seeds and seed not in v.seeds):
                    continue
                job = load_config(
                    JobConfig, REPO / study.config, [*study.overrides, *algo_ov, "stages=[rl]"]
                )
                needs_value = registry.build(job.algorithm).needs_value_model
                own_vp = needs_value and (v.own_value_pretrain or not study.shared_value_pretrain)
                stages = "[value_pretrain,rl]" if own_vp else "[rl]"
                if not study.shared_sft:
                    stages = "[sft,value_pretrain,rl]" if needs_value else "[sft,rl]"
                group = algo + (f"+{vname}" if vname else "")
                run_dir = Path(study.out) / group / f"seed{seed}"
                overrides = [
                    *study.overrides,
                    *algo_ov,
                    *v.overrides,
                    f"stages={stages}",
                    f"rl.steps={study.rl_steps}",
                    f"tasks.num_eval_tasks={study.num_eval_tasks}",
                    f"rl.eval_interval={study.eval_interval}",
                    f"checkpoint.save_interval={study.save_interval}",
                    "logging.console=false",
                    f"seed={seed}",  # parallel.seed, tasks.train_seed derived from it
                    f"rollout.seed={seed}",  # a config's own rollout.seed would win
                ]
                record = Path(study.records) / group / f"seed{seed}"
                out.append(Cell(algo, vname, seed, run_dir, overrides, needs_value, own_vp, record))
    if study.include_baseline:  # the main comparison first, then the ablations (stable sort)
        out.sort(key=lambda c: c.variant != "")
    return out


def _recorded(cell: Cell) -> bool:
    return cell.record_dir is not None and (cell.record_dir / DONE).exists()


def _folder_state(folder: Path) -> str:
    """A job folder's (a cell's, a shared stage's) "done", "unfinished" or "missing"."""
    if (folder / DONE).exists():
        return "done"
    return "unfinished" if (folder / CELL).exists() else "missing"


def state(cell: Cell) -> str:
    """ "done" (its run folder or its record says so), "unfinished" (started, not done: it
    resumes) or "missing"."""
    return "done" if _recorded(cell) else _folder_state(cell.run_dir)


def source(cell: Cell) -> Path:
    """The folder the cell's figures are read from: its run folder while that holds the cell
    (done or unfinished), else its record (a finished cell whose run folder is gone)."""
    if (cell.run_dir / CELL).exists() or not _recorded(cell):
        return cell.run_dir
    return cell.record_dir


def read_rl_metrics(folder: Path) -> list[dict]:
    """The RL stage's metric records of a run folder (``rl/metrics.jsonl``) or of a record
    (``rl/metrics.jsonl.gz``), in file order. Raises FileNotFoundError when neither exists."""
    if (folder / METRICS).exists():
        return read_metrics(folder / "rl")
    with gzip.open(folder / METRICS_GZ, "rt") as f:
        return [json.loads(x) for x in f if x.strip()]


def record_cell(cell: Cell) -> Path | None:
    """Copy a finished cell's record from its run folder into `cell.record_dir` (replacing an
    older one: a horizon evaluation added later goes in too); returns the record's folder, or
    None when the run folder holds no finished cell."""
    if cell.record_dir is None or not (cell.run_dir / DONE).exists():
        return None
    tmp = cell.record_dir.with_name(cell.record_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "rl").mkdir(parents=True)
    for name in (DONE, CELL, EVALS, HORIZON, SHARED_START):
        if (cell.run_dir / name).exists():
            shutil.copy2(cell.run_dir / name, tmp / name)
    with gzip.GzipFile(tmp / METRICS_GZ, "wb", mtime=0) as f:  # mtime 0: the same bytes again
        f.write((cell.run_dir / METRICS).read_bytes())
    kept = sorted((cell.run_dir / EPISODES).glob("step_*.jsonl"))
    for episodes in dict.fromkeys(kept[:1] + kept[-1:]):  # before and after RL: what is compared
        (tmp / EPISODES).mkdir(exist_ok=True)
        with gzip.GzipFile(tmp / EPISODES / (episodes.name + ".gz"), "wb", mtime=0) as f:
            f.write(episodes.read_bytes())
    shutil.rmtree(cell.record_dir, ignore_errors=True)
    tmp.rename(cell.record_dir)
    return cell.record_dir


def record_finished(all_cells: list[Cell], study: Study | None = None) -> list[Path]:
    """Record each finished cell whose record is missing or behind its run folder (a file
    there that the record lacks or holds an older copy of); returns the records written. With
    `study`, a finished cell that does not say which shared start it came from gets it first
    (`infer_shared_start`)."""
    out = []
    for c in all_cells:
        if not (c.run_dir / DONE).exists() or c.record_dir is None:
            continue
        if study is not None:
            infer_shared_start(study, c)
        behind = not (c.record_dir / METRICS_GZ).exists()
        for n in (DONE, CELL, EVALS, HORIZON, SHARED_START):
            mine, kept = c.run_dir / n, c.record_dir / n
            if mine.exists() and (not kept.exists() or kept.stat().st_mtime < mine.stat().st_mtime):
                behind = True
        if not behind:
            continue
        written = record_cell(c)
        if written is not None:
            print(f"[study] recorded {c.name} in {written} (commit it)", flush=True)
            out.append(written)
    return out


def _rl_steps_done(run_dir: Path) -> int:
    try:
        return max((int(r["step"]) for r in read_rl_metrics(run_dir) if "step" in r), default=0)
    except FileNotFoundError:
        return 0


def _command(study: Study, run_dir: Path, overrides: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sao_megatron.cli.train",
        study.config,
        f"run_dir={run_dir}",
        *overrides,
    ]


def _runner_state(study: Study, job: dict | None = None) -> None:
    """Write `<out>/runner.json` (this process and its current job), read by --stop."""
    out = Path(study.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / RUNNER).write_text(json.dumps({"pid": os.getpid(), **(job or {})}))


def stop_study(study: Study) -> str:
    """Ask the running study to stop (`--stop`): its job saves after the current step and
    exits, and the runner starts nothing more. Returns what was done; raises SystemExit when
    no runner of this study is alive."""
    state_file = Path(study.out) / RUNNER
    try:
        runner = json.loads(state_file.read_text())
        os.kill(int(runner["pid"]), 0)  # alive?
    except (FileNotFoundError, ProcessLookupError, ValueError, KeyError):
        raise SystemExit(
            f"{study.name}: no running study ({state_file} names no live process)"
        ) from None
    (Path(study.out) / STOP).touch()
    job = runner.get("job", "no job yet")
    return (
        f"{study.name}: stop asked (runner pid {runner['pid']}, running {job}); the job saves "
        "after its current step and exits, then the runner ends"
    )


def _exit_reason(rc: int) -> str:
    """A job's exit code in words: a signal by name, SIGKILL with the usual cause on Linux."""
    if rc >= 0:
        return f"exit {rc}"
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = f"signal {-rc}"
    if -rc == signal.SIGKILL:
        return (
            f"exit {rc}: killed by {name}, most often the kernel's out-of-memory killer (`dmesg | "
            "grep -i 'killed process'`); run one job at a time or lower the cell's memory"
        )
    return f"exit {rc}: killed by {name}"


def _attempt(study: Study, run_dir: Path, cmd: list[str], what: str) -> int:
    """Run `cmd` once into run_dir (log appended to run_dir/job.log), recording the attempt's
    provenance in run_dir/cell.json; returns its exit code."""
    record = json.loads((run_dir / CELL).read_text())
    attempt = {
        "commit": benchlib._git("rev-parse", "--short", "HEAD"),
        "dirty": bool(benchlib._git("status", "--porcelain", "--untracked-files=no")),
        "start_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "loadavg_start": os.getloadavg()[0],
        "rl_steps_before": _rl_steps_done(run_dir),
    }
    record["attempts"].append(attempt)  # written before the job: a killed attempt shows
    (run_dir / CELL).write_text(json.dumps(record, indent=1))
    print(f"[study] {what}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    stop = Path(study.out) / STOP
    consumed = stop.with_name(STOP + ".consumed")
    env = os.environ | {"SAO_STOP_FILE": str(stop.resolve())}
    with open(run_dir / "job.log", "a") as log:
        log.write(f"\n===== study attempt {len(record['attempts'])}, {attempt['start_utc']} UTC\n")
        log.flush()
        job = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        _runner_state(study, {"job_pid": job.pid, "job": what, "run_dir": str(run_dir)})
        rc = job.wait()
    stopped = consumed.exists() or stop.exists()  # asked during the job (or as it ended)
    if stopped:
        consumed.unlink(missing_ok=True)
        stop.unlink(missing_ok=True)
    attempt |= {
        "end_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "wall_s": round(time.perf_counter() - t0, 1),
        "loadavg_end": os.getloadavg()[0],
        "exit_code": rc,
        "rl_steps_after": _rl_steps_done(run_dir),
        "stopped": stopped,
    }
    (run_dir / CELL).write_text(json.dumps(record, indent=1))
    print(f"[study]   exit {rc} after {attempt['wall_s']:.0f} s", flush=True)
    if stopped:
        raise StudyStopped(
            f"{what}: stopped with --stop at RL step {attempt['rl_steps_after']} (its last "
            "checkpoint is kept); rerun the study to continue"
        )
    return rc


_NOT_WHAT_IT_TRAINS = ("checkpoint.save_interval",)  # how often a job saves


def _what_it_makes(spec: dict) -> dict:
    """A job's config and overrides without those of `_NOT_WHAT_IT_TRAINS`."""
    overrides = [
        o for o in spec["overrides"] or [] if o.split("=", 1)[0] not in _NOT_WHAT_IT_TRAINS
    ]
    return {"config": spec["config"], "overrides": overrides}


def resolved_config(config: str, overrides: list[str]) -> dict[str, object]:
    """The job's whole config as the trainer will read it (the config file with the overrides
    applied), flattened to dotted names with JSON values, without the fields that do not change
    what it trains. Two spellings of one job (an override that restates the file's value)
    resolve alike; an edit to the config file shows here, not in the overrides."""
    import dataclasses

    from sao_megatron.configs import load_config
    from sao_megatron.trainer.job import JobConfig

    job = load_config(JobConfig, REPO / config, overrides)
    tree = json.loads(json.dumps(dataclasses.asdict(job), default=str))
    flat: dict[str, object] = {}

    def walk(node: object, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            flat[prefix] = node

    walk(tree, "")
    for k in _NOT_WHAT_IT_TRAINS:
        flat.pop(k, None)
    return flat


def _config_changes(old: dict[str, object], new: dict[str, object], limit: int = 6) -> list[str]:
    """'field: old -> new' for each dotted field of both that differs (at most `limit`, then a
    count). A field only one side has is a config field added or removed in the code since the
    cell was recorded, not a change to the study: an unfinished cell must still resume."""
    keys = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
    out = [f"{k}: {old[k]!r} -> {new[k]!r}" for k in keys[:limit]]
    if len(keys) > limit:
        out.append(f"... {len(keys) - limit} more")
    return out


def _run_folder(
    study: Study, run_dir: Path, overrides: list[str], what: str, prepare=None, shared=False
) -> None:
    """Run one job into run_dir to its end, once: skip when done, resume when unfinished, refuse
    another job's folder (`shared`: a finished one too: a shared stage made by another command
    is not this study's start). Raises RuntimeError with the log's tail when the job fails."""
    cmd = _command(study, run_dir, overrides)
    spec = {"config": study.config, "overrides": overrides}
    if (run_dir / DONE).exists() and not shared:
        return
    # a cell is compared by what it trains; a shared stage by its command (an edit to the RL
    # part of the config file must not orphan the study's SFT start)
    resolved = None if shared else resolved_config(study.config, overrides)
    if (run_dir / CELL).exists():
        old = json.loads((run_dir / CELL).read_text())
        fix = "delete the folder to rerun it, or give the change a variant of its own"
        if resolved is not None and "resolved" in old:  # whatever the spelling; file edits too
            changes = _config_changes(old["resolved"], resolved)
            if changes:
                raise RuntimeError(
                    f"{what}: {run_dir} holds another job: the study file, {study.config} or a "
                    f"default in the code changed what this cell trains ({'; '.join(changes)}): "
                    f"{fix}"
                )
        elif _what_it_makes({k: old.get(k) for k in spec}) != _what_it_makes(spec):
            raise RuntimeError(
                f"{what}: {run_dir} holds another job ({old.get('overrides')}); the study file "
                f"changed this cell: {fix}"
            )
        if (run_dir / DONE).exists():
            return
        if resolved is not None and "resolved" not in old:  # recorded from now on
            (run_dir / CELL).write_text(json.dumps({**old, "resolved": resolved}, indent=1))
        what += f" (resuming at RL step {_rl_steps_done(run_dir)})"
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        if prepare is not None:
            prepare(run_dir)
        record = {**spec, "command": cmd, "attempts": []}
        if resolved is not None:
            record["resolved"] = resolved
        (run_dir / CELL).write_text(json.dumps(record, indent=1))
    rc = _attempt(study, run_dir, cmd, what)
    if rc != 0:
        tail = "\n".join((run_dir / "job.log").read_text().splitlines()[-30:])
        raise RuntimeError(
            f"{what} failed ({_exit_reason(rc)}); rerun the study to resume it. Log "
            f"{run_dir / 'job.log'}:\n{tail}"
        )
    steps = _rl_steps_done(run_dir)
    if not shared and steps < study.rl_steps:
        raise RuntimeError(
            f"{what} exited 0 at RL step {steps} of {study.rl_steps} without --stop (a signal "
            "to the job?): not marked done; rerun the study to resume it. Log "
            f"{run_dir / 'job.log'}"
        )
    (run_dir / DONE).write_text(json.dumps({"rl_steps": steps}))


def _shared_dirs(study: Study) -> tuple[Path, Path]:
    shared = Path(study.shared_from or study.out) / "_shared"
    return shared / "sft", shared / "value_pretrain"


# ---------------------------------------------------------------------------- shared starts
def _cell_stages(study: Study, cell: Cell) -> list[tuple[str, Path]]:
    """The shared stages (name, folder) a cell starts from."""
    sft_dir, vp_dir = _shared_dirs(study)
    out = [("sft", sft_dir)] if study.shared_sft else []
    if study.shared_value_pretrain and cell.needs_value_model and not cell.own_value_pretrain:
        out.append(("value_pretrain", vp_dir))
    return out


def stage_fingerprint(folder: Path, stage: str) -> dict | None:
    """What identifies a finished shared stage's result without its weights (hundreds of MB,
    never committed): its steps and the SHA-256 of every logged figure its weights determine
    (`FINGERPRINT_KEYS`, each float by its exact bits; per step the records merged, the later
    winning: a resumed stage's redone steps count once), with the last step's figures to read.
    The same command on a machine whose kernels round alike gives the same digest (a replaced
    VM redid GEM's SFT and value pre-training to identical figures, 2026-12-06). None while the
    stage is not done (``study_done.json``)."""
    if not (folder / DONE).exists():
        return None
    by_step: dict[int, dict] = {}
    for r in read_metrics(folder / stage):
        if "step" in r:
            by_step.setdefault(int(r["step"]), {}).update(r)
    rows = []
    for step in sorted(by_step):
        figs = {
            k: float(v)
            for k, v in sorted(by_step[step].items())
            if FINGERPRINT_KEYS.search(k) and isinstance(v, int | float) and not isinstance(v, bool)
        }
        rows.append([step, [[k, v.hex()] for k, v in figs.items()], figs])
    digest = hashlib.sha256(json.dumps([r[:2] for r in rows]).encode()).hexdigest()
    import torch

    return {
        "stage": stage,
        "steps": rows[-1][0] if rows else 0,
        "digest": digest,
        "last": rows[-1][2] if rows else {},
        "finished_utc": time.strftime(
            "%Y-%m-%d %H:%M:%S", time.gmtime((folder / DONE).stat().st_mtime)
        ),
        "cpu": benchlib.cpu_model(),
        "torch": torch.__version__,
        "wall_s": _stage_wall_s(folder),
    }


def _stage_wall_s(folder: Path) -> float | None:
    """The seconds a job folder's attempts ran (their ``wall_s`` in ``cell.json``, summed):
    what redoing a shared stage costs a new machine (`--plan`). Not part of the digest (the
    clock is not the result). None when an attempt's time is unknown."""
    try:
        attempts = json.loads((folder / CELL).read_text()).get("attempts") or []
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    walls = [a.get("wall_s") for a in attempts]
    if not walls or any(w is None for w in walls):
        return None
    return round(sum(walls), 1)


def _start_record(study: Study, stage: str) -> Path:
    return Path(study.records) / "_shared" / f"{stage}.json"


def _recorded_starts(study: Study, stage: str, digest: str) -> list[str]:
    """The recorded cells that say they started from the shared `stage` with `digest`."""
    out = []
    root = Path(study.records)
    for path in sorted(root.glob(f"*/seed*/{SHARED_START}")):
        if json.loads(path.read_text()).get(stage, {}).get("digest") == digest:
            out.append(f"{path.parent.parent.name}/{path.parent.name}")
    return out


def check_shared_start(study: Study, stage: str, folder: Path) -> dict:
    """The finished shared `stage`'s fingerprint, checked against the one recorded for the
    study (``<records>/_shared/<stage>.json``, written the first time: commit it). A redone
    stage (a new machine: ``runs/`` is not kept) must match it, else the cells it would start
    are not from the recorded cells' start. Raises RuntimeError naming what differs, the cells
    recorded from the old start and the fix."""
    fp = stage_fingerprint(folder, stage)
    if fp is None:
        raise RuntimeError(f"shared {stage}: {folder} is not finished ({DONE} missing)")
    path = _start_record(study, stage)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(fp, indent=1) + "\n")
        msg = f"[study] recorded the shared {stage}'s fingerprint in {path} (commit it)"
        print(msg, flush=True)
        return fp
    kept = json.loads(path.read_text())
    if kept["digest"] == fp["digest"]:
        _add_recorded_wall(path, kept, fp)
        return fp
    diffs = [f"steps {kept['steps']} -> {fp['steps']}"] if kept["steps"] != fp["steps"] else []
    for k in sorted(set(kept["last"]) | set(fp["last"])):
        a, b = kept["last"].get(k), fp["last"].get(k)
        if a != b:
            diffs.append(f"{k} {a} -> {b}")
    old = _recorded_starts(study, stage, kept["digest"])
    raise RuntimeError(
        f"shared {stage}: {folder} is not the start recorded in {path} (made "
        f"{kept['finished_utc']} UTC on '{kept['cpu']}', torch {kept['torch']}; this one on "
        f"'{fp['cpu']}', torch {fp['torch']}): at the last step "
        f"{'; '.join(diffs[:6]) or 'the same last figures, earlier steps differ'}. Its cells "
        f"would not share a start with the recorded ones ({', '.join(old) or 'none'}). Run on a "
        "machine whose kernels round alike (the same CPU family and torch), or start the study "
        f"over from this start: `git rm -r {path}` and the records of those cells"
    )


def _add_recorded_wall(path: Path, kept: dict, fp: dict) -> None:
    """Give a recorded start that predates ``wall_s`` the time of a redone stage that matched
    it (the same start, so the same job; the record is otherwise left as it is)."""
    if kept.get("wall_s") is None and fp.get("wall_s") is not None:
        path.write_text(json.dumps({**kept, "wall_s": fp["wall_s"]}, indent=1) + "\n")
        print(f"[study] recorded the shared {fp['stage']}'s time in {path} (commit it)", flush=True)


def record_shared_starts(study: Study) -> None:
    """Record the fingerprint of each finished shared stage that has none recorded yet (a
    stage finished by a runner that predates fingerprints), and the time of one whose record
    predates ``wall_s`` when it matches; a recorded one is otherwise left as it is (the
    runner, not a report, refuses a stage that differs: `check_shared_start`)."""
    sft_dir, vp_dir = _shared_dirs(study)
    for stage, folder in (("sft", sft_dir), ("value_pretrain", vp_dir)):
        if not (folder / DONE).exists():
            continue
        path = _start_record(study, stage)
        if not path.exists():
            check_shared_start(study, stage, folder)
            continue
        kept = json.loads(path.read_text())
        if kept.get("wall_s") is not None:  # nothing to add: no need to re-read its metrics
            continue
        fp = stage_fingerprint(folder, stage)
        if fp is not None and kept["digest"] == fp["digest"]:
            _add_recorded_wall(path, kept, fp)


def infer_shared_start(study: Study, cell: Cell) -> None:
    """Write a finished cell's missing ``shared_start.json`` when its start is certain: every
    shared stage it uses is finished in this study's folder and finished before the cell's
    first attempt began (a cell made by a runner that predates the file, on this machine)."""
    if (cell.run_dir / SHARED_START).exists() or not (cell.run_dir / CELL).exists():
        return
    attempts = json.loads((cell.run_dir / CELL).read_text()).get("attempts") or []
    began = attempts[0].get("start_utc") if attempts else None
    starts = {}
    for stage, folder in _cell_stages(study, cell):
        fp = stage_fingerprint(folder, stage)
        if fp is None or began is None or fp["finished_utc"] > began:
            return
        starts[stage] = fp
    if starts:
        (cell.run_dir / SHARED_START).write_text(json.dumps(starts, indent=1) + "\n")


def preflight(study: Study) -> None:
    """What the study's jobs need and cannot make themselves, checked before its first job:
    the vLLM virtualenv of the local rollout engines (the SFT stage does not use them, so a
    missing one would otherwise fail the study only after it). Raises SystemExit with the fix."""
    from sao_megatron.configs import load_config
    from sao_megatron.rollout.engine_process import vllm_python
    from sao_megatron.trainer.job import JobConfig

    job = load_config(JobConfig, REPO / study.config, study.overrides)
    if job.rollout.launches_engines:
        try:
            vllm_python(job.rollout)
        except ValueError as e:
            raise SystemExit(f"{study.name}: nothing started: {e}") from None


def run(study: Study, todo: list[Cell], selected: list[Cell] | None = None) -> None:
    """Run the shared stages the cells need, then each cell not done, in order; with
    `horizon_eval`, evaluate each finished cell of `selected` (default `todo`) as it finishes
    (and those finished before, first)."""
    selected = todo if selected is None else selected
    evaluate_horizons(study, selected)
    sft_dir, vp_dir = _shared_dirs(study)
    n = study.shared_save_interval
    saves = [f"checkpoint.save_interval={n}"] if n else []
    if study.shared_sft:
        _run_folder(
            study,
            sft_dir,
            [
                *study.overrides,
                "stages=[sft]",
                "tasks.num_eval_tasks=0",
                "logging.console=false",
                *saves,
            ],
            "shared SFT",
            shared=True,
        )
        check_shared_start(study, "sft", sft_dir)
    needs_vp = any(c.needs_value_model and not c.own_value_pretrain for c in todo or selected)
    if needs_vp and study.shared_value_pretrain:
        _run_folder(
            study,
            vp_dir,
            [
                *study.overrides,
                "stages=[value_pretrain]",
                "tasks.num_eval_tasks=0",
                "logging.console=false",
                *saves,
            ],
            "shared value pre-training",
            prepare=(lambda d: seed_from_sft(sft_dir, d)) if study.shared_sft else None,
            shared=True,
        )
        check_shared_start(study, "value_pretrain", vp_dir)
    for i, cell in enumerate(todo, 1):
        if (Path(study.out) / STOP).exists():  # asked between two jobs
            (Path(study.out) / STOP).unlink()
            raise StudyStopped(f"stopped with --stop before cell {i}/{len(todo)} {cell.name}")

        def prepare(run_dir: Path, cell=cell) -> None:
            if study.shared_sft:
                seed_from_sft(sft_dir, run_dir)
            if cell.needs_value_model and not cell.own_value_pretrain:
                shutil.copytree(vp_dir / "checkpoints" / "rl", run_dir / "checkpoints" / "rl")
            starts = {st: stage_fingerprint(d, st) for st, d in _cell_stages(study, cell)}
            if starts:
                (run_dir / SHARED_START).write_text(json.dumps(starts, indent=1) + "\n")

        _run_folder(
            study,
            cell.run_dir,
            cell.overrides,
            f"cell {i}/{len(todo)} {cell.name}",
            prepare=prepare,
        )
        record_finished([cell], study)
        evaluate_horizons(study, selected)


# ---------------------------------------------------------------------------- horizon evaluation
HORIZON = "horizon_eval.json"
START = "the RL start"


def _start_horizon_file(study: Study) -> Path:
    """Where the RL start's horizon evaluation is saved (the study's own `_shared`, also when
    its shared stages come from another study)."""
    return Path(study.out) / "_shared" / HORIZON


def wants_horizon_eval(study: Study, cell: Cell) -> bool:
    """Whether `study.horizon_eval` covers the cell's group."""
    h = study.horizon_eval
    return h is not None and (not h.groups or any(fnmatch.fnmatch(cell.group, g) for g in h.groups))


def _start_policy(study: Study, all_cells: list[Cell]) -> Path | None:
    """The RL start's Hugging Face folder: the shared value pre-training's (it serves the SFT
    policy, never trains it), else a finished cell's ``hf_policy`` that ran in one attempt (a
    resumed job re-exports it from its checkpoint, so only a single attempt's is the start)."""
    vp = _shared_dirs(study)[1] / "hf_policy"
    if study.shared_sft and (vp / "config.json").exists():
        return vp
    for c in all_cells:
        if state(c) == "done" and (c.run_dir / "hf_policy" / "config.json").exists():
            if len(json.loads((c.run_dir / CELL).read_text())["attempts"]) == 1:
                return c.run_dir / "hf_policy"
    return None


def horizon_result(path: Path, study: Study) -> dict[int, dict[str, float]] | None:
    """The saved {horizon: figures} at `path` when measured with the study's horizons and task
    count; else None."""
    if not path.exists() or study.horizon_eval is None:
        return None
    saved = json.loads(path.read_text())
    h = study.horizon_eval
    if saved.get("key") != {"horizons": list(h.horizons), "num_tasks": h.num_tasks}:
        return None
    return {int(k): v for k, v in saved["results"].items()}


def evaluate_horizons(study: Study, all_cells: list[Cell], evaluate=None) -> None:
    """Evaluate, at the study's horizons, every finished cell `horizon_eval` covers and the RL
    start, each once (saved as measured; an interrupted evaluation redoes only its policy).
    `evaluate`: ``eval_horizon.evaluate_policy`` (a test passes its own)."""
    if study.horizon_eval is None:
        return
    from sao_megatron.configs import load_config
    from sao_megatron.trainer.job import JobConfig

    if evaluate is None:
        from eval_horizon import evaluate_policy as evaluate
    h = study.horizon_eval
    todo = [
        (c.run_dir / "hf_policy_final", c.run_dir / HORIZON, c.name, c.run_dir)
        for c in all_cells
        if wants_horizon_eval(study, c)
        and (c.run_dir / DONE).exists()  # a recorded cell's policy is gone with its run folder
        and horizon_result(c.run_dir / HORIZON, study) is None
        and (c.record_dir is None or horizon_result(c.record_dir / HORIZON, study) is None)
    ]
    start = _start_policy(study, all_cells)
    if start is not None:
        todo.insert(0, (start, _start_horizon_file(study), START, start.parent))
    for hf, out, what, run_dir in todo:
        if horizon_result(out, study) is not None:
            continue
        job = load_config(JobConfig, run_dir / "config.yaml")
        print(f"[study] horizon evaluation of {what} ({hf}): H = {h.horizons}", flush=True)
        t0 = time.perf_counter()
        results = evaluate(hf, job, list(h.horizons), h.num_tasks, run_dir / "horizon_eval_engine")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "key": {"horizons": list(h.horizons), "num_tasks": h.num_tasks},
                    "hf_dir": str(hf),
                    "commit": benchlib._git("rev-parse", "--short", "HEAD"),
                    "utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                    "wall_s": round(time.perf_counter() - t0, 1),
                    "results": results,
                },
                indent=1,
            )
        )
    record_finished(all_cells, study)


def horizon_table(study: Study, all_cells: list[Cell]) -> str:
    """Success and per-move error rates by horizon: the RL start, then each group's mean ±
    standard error over its evaluated seeds (`eval_horizon.render_over_seeds`); the cells not
    evaluated yet are named."""
    from eval_horizon import render_over_seeds

    results: dict[str, dict[int, dict[str, float]]] = {}
    start = horizon_result(_start_horizon_file(study), study)
    if start is not None:
        results[START] = start
    missing = []
    for c in all_cells:
        if not wants_horizon_eval(study, c):
            continue
        r = horizon_result(source(c) / HORIZON, study)
        if r is None:
            missing.append(c.name)
        else:
            results[f"{c.group} r{c.seed}"] = r
    h = study.horizon_eval
    head = (
        f"Held-out Hanoi by horizon ({h.num_tasks} puzzles per horizon, the same for every "
        "policy; `tools/eval_horizon.py`'s evaluation of each cell's final policy):"
    )
    text = head + ("\n\n" + render_over_seeds(results, list(h.horizons)) if results else "")
    if missing:
        text += "\n\nNot evaluated yet: " + ", ".join(missing) + "."
    return text


# ---------------------------------------------------------------------------- report
@dataclass
class CellFigures:
    cell: Cell
    state: str
    steps: int
    before: float | None  # held-out success before RL
    after: float | None  # after the last RL step (None while unfinished)
    episodes: list[tuple[float, float]]  # (episodes consumed in RL, held-out success)
    walls: list[tuple[float, float]]  # (RL wall-clock s, held-out success)
    wall_s: float | None
    loadavg: float | None  # the highest load average recorded at an attempt's start or end
    ev_mean: float | None  # the critic's explained variance before its updates, mean over RL
    collapsed: bool | None = None  # tools/bench_stability.py's rule, on finished cells
    attempts: int = 1  # jobs run into the folder (> 1: resumed; its RL clock is the last one's)
    eval_first: dict | None = None  # the held-out evaluation before RL (rl/eval.jsonl)
    eval_last: dict | None = None  # the last one (after RL, on a finished cell)
    by_step: list[tuple[int, float]] = field(default_factory=list)  # (RL update, held-out)
    lowest: float | None = None  # the lowest held-out success at any evaluation after RL began


def figures(cell: Cell) -> CellFigures:
    st = state(cell)
    empty = CellFigures(cell, st, 0, None, None, [], [], None, None, None)
    src = source(cell)
    if st == "missing" or not ((src / METRICS).exists() or (src / METRICS_GZ).exists()):
        return empty
    # a run killed between checkpoints redoes the steps after its last one when it resumes,
    # appending them again: the last record of a step is the one the run went on from
    by_step = {int(r["step"]): r for r in read_rl_metrics(src) if "time/rl_elapsed_s" in r}
    recs = [by_step[k] for k in sorted(by_step)]
    if not recs:
        return empty
    episodes = _across_restarts(
        [r.get("rollout/episodes_started", 0.0) for r in recs],
        recs[0].get("rollout/episodes_started", 0.0) - recs[0].get("batch/num_trajectories", 0),
    )
    clock = _across_restarts([r["time/rl_elapsed_s"] for r in recs], 0.0)
    at = {int(r["step"]): i for i, r in enumerate(recs)}
    evals = []
    path = src / EVALS
    if path.exists():
        evals = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        last = {int(e.get("step", 0)): e for e in evals if "eval/success_rate" in e}
        evals = [last[k] for k in sorted(last)]
    ep, wall, by_step = [], [], []
    for e in evals:
        step = int(e.get("step", 0))
        if step == 0:
            ep.append((0.0, e["eval/success_rate"]))
            wall.append((0.0, e["eval/success_rate"]))
        elif step in at:
            ep.append((episodes[at[step]], e["eval/success_rate"]))
            wall.append((clock[at[step]], e["eval/success_rate"]))
        else:
            continue
        by_step.append((step, e["eval/success_rate"]))
    record = json.loads((src / CELL).read_text())
    loads = [a.get(k) for a in record["attempts"] for k in ("loadavg_start", "loadavg_end")]
    evs = [
        r["value/explained_variance_before"]
        for r in recs
        if r.get("value/explained_variance_before") is not None
    ]
    evs = [x for x in evs if x == x]
    before = ep[0][1] if ep and ep[0][0] == 0.0 else None
    collapsed = None
    rewards = [r.get("reward/mean") for r in recs]
    entropies = [r.get("policy/entropy") for r in recs]
    if st == "done" and None not in rewards and None not in entropies:
        from bench_stability import collapsed as collapse_rule

        collapsed = collapse_rule(rewards, entropies)
    after = ep[-1][1] if st == "done" and len(ep) > 1 else None
    lowest = min((x for _, x in ep[1:]), default=None)  # any evaluation after RL started
    if st == "done" and before is not None and lowest is not None and lowest < before / 2:
        # held-out success halved at some evaluation (a recovery after it does not undo it): a
        # collapse whatever the batch signals say
        collapsed = True
    return CellFigures(
        cell=cell,
        state=st,
        steps=int(recs[-1]["step"]),
        before=before,
        after=after,
        episodes=ep,
        walls=wall,
        wall_s=clock[-1],
        loadavg=max((x for x in loads if x is not None), default=None),
        ev_mean=sum(evs) / len(evs) if evs else None,
        collapsed=collapsed,
        attempts=len(record["attempts"]),
        eval_first=evals[0] if evals and int(evals[0].get("step", 0)) == 0 else None,
        eval_last=evals[-1] if st == "done" and len(evals) > 1 else None,
        by_step=by_step,
        lowest=lowest,
    )


def _across_restarts(values: list[float], baseline: float) -> list[float]:
    """A per-process running count (episodes started, the RL clock) made continuous across
    the processes of a resumed run: each process counts from 0 again, so a value below its
    predecessor starts a new process, whose values add to where the last one left off.
    `baseline`: what the first process had counted before RL (value pre-training's episodes)."""
    out, offset, prev = [], -baseline, None
    for v in values:
        if prev is not None and v < prev:
            offset = out[-1]  # a restart: this process's count starts after the last one's
        out.append(v + offset)
        prev = v
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _mse(xs: list[float | None]) -> str:
    m, se, n = mean_se(xs)
    if n == 0:
        return "-"
    return f"{100 * m:.1f}%" + (f" ± {100 * se:.1f}" if n > 1 else "") + f" (n={n})"


def provenance_line(figs: list[CellFigures]) -> str:
    """Where and when the cells ran: this machine, the UTC span and the commits of their
    attempts (cell.json), and whether any attempt ran on a dirty tree."""
    import torch

    attempts = []
    for f in figs:
        if f.state != "missing" and (source(f.cell) / CELL).exists():
            attempts += json.loads((source(f.cell) / CELL).read_text())["attempts"]
    starts = sorted(a["start_utc"] for a in attempts if a.get("start_utc"))
    ends = sorted(a["end_utc"] for a in attempts if a.get("end_utc"))
    commits = sorted({a["commit"] for a in attempts if a.get("commit")})
    dirty = any(a.get("dirty") for a in attempts)
    machine = (
        f"Machine: `nproc` = {os.cpu_count()}, CPU '{benchlib.cpu_model()}', torch "
        f"{torch.__version__}."
    )
    if not attempts:
        return machine + " No cell has run yet."
    return (
        f"{machine} Cells ran {starts[0]} - {ends[-1] if ends else '(running)'} UTC at commit(s) "
        f"{', '.join(commits)}{' (an attempt on a tree with uncommitted changes)' if dirty else ''}"
        "; per-cell load averages below."
    )


def shared_start_line(study: Study, figs: list[CellFigures]) -> str:
    """Which shared start the finished cells came from: the recorded fingerprint of each shared
    stage (`check_shared_start`), the cells that say they started from it, from another, or do
    not say (finished before starts were fingerprinted). Empty when nothing is recorded."""
    parts = []
    for stage, label in (("sft", "SFT"), ("value_pretrain", "value pre-training")):
        path = _start_record(study, stage)
        if not path.exists():
            continue
        kept = json.loads(path.read_text())
        same, other, unsaid = [], [], []
        for f in figs:
            if f.state != "done" or stage not in dict(_cell_stages(study, f.cell)):
                continue
            said = source(f.cell) / SHARED_START
            if not said.exists():
                unsaid.append(f.cell.name)
            elif json.loads(said.read_text()).get(stage, {}).get("digest") == kept["digest"]:
                same.append(f.cell.name)
            else:
                other.append(f.cell.name)
        last = ", ".join(f"{k} {v:.4g}" for k, v in list(kept["last"].items())[:3])
        text = (
            f"{label} `{kept['digest'][:12]}` ({kept['steps']} steps, {kept['finished_utc']} "
            f"UTC; last step {last}): {len(same)} finished cell(s) from it"
        )
        if other:
            text += f"; from another start: {', '.join(other)}"
        if unsaid:
            text += f"; not fingerprinted (finished before starts were): {', '.join(unsaid)}"
        parts.append(text)
    if not parts:
        return ""
    return (
        "Shared start (fingerprint: SHA-256 of every loss, gradient norm and explained variance "
        "the stage logged; a stage redone on a new machine must match it): "
        + ". ".join(parts)
        + "."
    )


def report_text(study: Study, figs: list[CellFigures], plot_rel: str | None) -> str:
    """The study's markdown: the matrix by group over seeds, then one row per cell."""
    groups: dict[str, list[CellFigures]] = {}
    for f in figs:
        groups.setdefault(f.cell.group, []).append(f)
    done = sum(f.state == "done" for f in figs)
    starts = shared_start_line(study, figs)
    lines = [
        f"Study file `{study.name}`: `python tools/study.py STUDY.yaml` runs it (resumable), "
        f"`--report` regenerates this section. Config `{study.config}`, {study.rl_steps} RL "
        f"steps a cell, {study.num_eval_tasks} held-out tasks; {done} of {len(figs)} cells "
        "done. Mean ± standard error over the finished seeds; 'collapsed': held-out success "
        "at any evaluation during or after RL below half its value before, or the rule of "
        "tools/bench_stability.py "
        "(last-quarter batch reward below half the best 10-update mean and entropy moved > "
        "50%).",
        "",
        provenance_line(figs),
        "",
        *([starts, ""] if starts else []),
        "| algorithm + variant | seeds done | held-out before | held-out after | after - before "
        "| collapsed | worst seed: lowest held-out after RL began | critic EV during RL |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for g, fs in groups.items():
        fin = [f for f in fs if f.state == "done"]
        deltas = [f.after - f.before for f in fin if f.after is not None and f.before is not None]
        m, se, n = mean_se(deltas)
        delta = "-" if not n else f"{100 * m:+.1f}" + (f" ± {100 * se:.1f}" if n > 1 else "")
        ev = mean_se([f.ev_mean for f in fin])
        judged = [f.collapsed for f in fin if f.collapsed is not None]
        collapses = f"{sum(judged)} of {len(judged)}" if judged else "-"
        low = [f for f in fin if f.lowest is not None]
        worst = min(low, key=lambda f: f.lowest) if low else None
        worst_text = "-" if worst is None else f"{_pct(worst.lowest)} (seed {worst.cell.seed})"
        lines.append(
            f"| {g} | {len(fin)} of {len(fs)} | {_mse([f.before for f in fin])} | "
            f"{_mse([f.after for f in fin])} | {delta} | {collapses} | {worst_text} | "
            f"{'-' if not ev[2] else f'{ev[0]:.2f}'} |"
        )
    lines += ["", *per_seed_table(groups), *paired_differences(groups), *task_by_task(groups)]
    lines += [
        "",
        "| cell | state | RL steps | held-out before -> after | RL wall s | max load avg |",
        "|---|---|---|---|---|---|",
    ]
    for f in figs:
        st = f.state if f.state != "unfinished" else f"unfinished (step {f.steps})"
        wall = "-" if f.wall_s is None else f"{f.wall_s:.0f}"
        if f.attempts > 1:
            wall += f" ({f.attempts} attempts: not comparable)"
        load = "-" if f.loadavg is None else f"{f.loadavg:.1f}"
        lines.append(
            f"| {f.cell.name} | {st} | {f.steps} of {study.rl_steps} | "
            f"{_pct(f.before)} -> {_pct(f.after)} | {wall} | {load} |"
        )
    if study.report_eval_keys:
        lines += [
            "",
            "Held-out metrics before -> after RL (mean ± standard error over the finished seeds):",
            "",
            "| algorithm + variant | "
            + " | ".join(f"`{k}`" for k in study.report_eval_keys)
            + " |",
            "|---|" + "---|" * len(study.report_eval_keys),
        ]
        for g, fs in groups.items():
            fin = [f for f in fs if f.state == "done"]
            row = []
            for k in study.report_eval_keys:
                ends = []
                for which in ("eval_first", "eval_last"):
                    m, se, n = mean_se([(getattr(f, which) or {}).get(k) for f in fin])
                    ends.append("-" if not n else f"{m:.3g}" + (f" ± {se:.2g}" if n > 1 else ""))
                row.append(" -> ".join(ends))
            lines.append(f"| {g} | " + " | ".join(row) + " |")
    if plot_rel:
        lines += ["", f"![{study.name}]({plot_rel})"]
    return "\n".join(lines)


def per_seed_table(groups: dict[str, list[CellFigures]]) -> list[str]:
    """Held-out success after RL, one row per seed and one column per group: the same-seed
    comparison (the groups of a seed share its SFT start and value pre-training), with the
    lowest evaluation during RL in brackets and a marked collapse."""
    seeds = sorted({f.cell.seed for fs in groups.values() for f in fs})
    lines = [
        "Held-out success after RL per seed (in brackets: the lowest evaluation after RL began; "
        "**bold**: a collapse by the rule above; '-': not finished):",
        "",
        "| seed | " + " | ".join(groups) + " |",
        "|---|" + "---|" * len(groups),
    ]
    for seed in seeds:
        row = []
        for fs in groups.values():
            f = next((x for x in fs if x.cell.seed == seed), None)
            if f is None or f.state != "done" or f.after is None:
                row.append("-" if f is None or f.state == "missing" else f"(step {f.steps})")
                continue
            text = _pct(f.after) + ("" if f.lowest is None else f" ({_pct(f.lowest)})")
            row.append(f"**{text}**" if f.collapsed else text)
        lines.append(f"| {seed} | " + " | ".join(row) + " |")
    return lines


def paired_differences(groups: dict[str, list[CellFigures]]) -> list[str]:
    """The first group against each other one, seed by seed: held-out success after RL of the
    first minus the other's on each seed both finished (the same SFT start and value
    pre-training, so the seed's start cancels), in points, with the mean ± standard error of
    those differences over the seeds (a paired comparison: tighter than the groups' own
    spreads when the seeds' starts differ). Nothing when no seed has both finished."""
    names = list(groups)
    if len(names) < 2:
        return []

    def after(fs: list[CellFigures]) -> dict[int, float]:
        return {f.cell.seed: f.after for f in fs if f.state == "done" and f.after is not None}

    ref, out = after(groups[names[0]]), []
    for name in names[1:]:
        other = after(groups[name])
        seeds = sorted(ref.keys() & other.keys())
        if not seeds:
            continue
        diffs = [100 * (ref[s] - other[s]) for s in seeds]
        m, se, n = mean_se(diffs)
        mean = f"{m:+.1f} ± {se:.1f}" if n > 1 else f"{m:+.1f}"
        out.append(
            f"- {names[0]} - {name}: {' / '.join(f'{d:+.1f}' for d in diffs)} points (seed(s) "
            f"{', '.join(map(str, seeds))}); mean {mean} over {n} seed(s); {names[0]} ahead on "
            f"{sum(d > 0 for d in diffs)} of {n}"
        )
    if not out:
        return []
    head = f"Same-seed differences of held-out success after RL ({names[0]} minus each group):"
    return ["", head, "", *out]


def heldout_outcomes(cell: Cell, step: int) -> dict[tuple[str, int], bool] | None:
    """(environment label, seed) -> solved, of the cell's held-out evaluation at `step`
    (``rl/eval_episodes/step_<step>.jsonl``, or its ``.gz`` in a record); None when the cell
    has no such file (it predates `logging.eval_episodes`, or did not evaluate at `step`)."""
    from sao_megatron.trainer.evaluate import read_episodes

    folder = source(cell) / EPISODES
    for name in (f"step_{step:08d}.jsonl", f"step_{step:08d}.jsonl.gz"):
        if (folder / name).exists():
            return {
                (e["env"], int(e["seed"])): bool(e["solved"]) for e in read_episodes(folder / name)
            }
    return None


def mcnemar(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value of b tasks solved only by one side and c only by the
    other: 2 P(Binomial(b + c, 1/2) <= min(b, c)), capped at 1 (McNemar 1947; the exact
    binomial form)."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2.0 * tail)


def _paired_line(label: str, a: dict, b: dict) -> str | None:
    """``label: +d points on n tasks (x solved only by the first, y only by the second; exact
    McNemar p)``, over the tasks both hold; None when they share none."""
    tasks = a.keys() & b.keys()
    if not tasks:
        return None
    only_a = sum(a[t] and not b[t] for t in tasks)
    only_b = sum(b[t] and not a[t] for t in tasks)
    diff = 100.0 * (only_a - only_b) / len(tasks)
    return (
        f"- {label}: {diff:+.1f} points on {len(tasks)} tasks ({only_a} solved only by the "
        f"first, {only_b} only by the second; exact McNemar p = {mcnemar(only_a, only_b):.3g})"
    )


def task_by_task(groups: dict[str, list[CellFigures]]) -> list[str]:
    """Held-out outcomes compared on the very same tasks (every evaluation of a study plays
    the same seeds): each finished cell after RL against itself before RL, and, seed by seed,
    the first group against each other one after RL. Cells whose evaluations did not write
    their episodes (`logging.eval_episodes`) are left out; nothing when none did."""
    names, out = list(groups), []

    def finished(fs: list[CellFigures]) -> dict[int, CellFigures]:
        return {f.cell.seed: f for f in fs if f.state == "done" and f.eval_last}

    for name in names:
        for seed, f in sorted(finished(groups[name]).items()):
            before = heldout_outcomes(f.cell, 0)
            after = heldout_outcomes(f.cell, int(f.eval_last["step"]))
            if before is not None and after is not None:
                line = _paired_line(f"{name}/seed{seed}, after RL vs before", after, before)
                out += [line] if line else []
    ref = finished(groups[names[0]]) if names else {}
    for name in names[1:]:
        for seed, other in sorted(finished(groups[name]).items()):
            if seed not in ref:
                continue
            a = heldout_outcomes(ref[seed].cell, int(ref[seed].eval_last["step"]))
            b = heldout_outcomes(other.cell, int(other.eval_last["step"]))
            if a is not None and b is not None:
                line = _paired_line(f"seed {seed}, {names[0]} vs {name} after RL", a, b)
                out += [line] if line else []
    if not out:
        return []
    head = (
        "Task by task (the same held-out tasks on both sides: a paired comparison, "
        "`rl/eval_episodes`):"
    )
    return ["", head, "", *out]


def plot(study: Study, figs: list[CellFigures], path: Path) -> None:
    """Held-out success against episodes consumed (left) and RL wall-clock (middle), one thin
    line per finished or unfinished cell, coloured by group; right: each group's mean over its
    finished seeds at each evaluation's RL update, with a band of ± one standard error and the
    worst seed dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4), sharey=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    groups = list(dict.fromkeys(f.cell.group for f in figs))
    for f in figs:
        if not f.episodes:
            continue
        c = colours[groups.index(f.cell.group) % len(colours)]
        label = (
            f.cell.group
            if f.cell.seed == min(x.cell.seed for x in figs if x.cell.group == f.cell.group)
            else None
        )
        style = "-" if f.state == "done" else ":"
        for ax, pts in ((axes[0], f.episodes), (axes[1], f.walls)):
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                style,
                color=c,
                alpha=0.8,
                marker=".",
                label=label,
            )
    for g in groups:
        fin = [f for f in figs if f.cell.group == g and f.state == "done" and f.by_step]
        if not fin:
            continue
        steps = sorted(set.intersection(*({s for s, _ in f.by_step} for f in fin)))
        at = [dict(f.by_step) for f in fin]
        stats = [mean_se([a[s] for a in at]) for s in steps]
        mean = [m for m, _, _ in stats]
        se = [e if n > 1 else 0.0 for _, e, n in stats]
        c = colours[groups.index(g) % len(colours)]
        axes[2].plot(steps, mean, "-", color=c, marker=".", label=f"{g} (n={len(fin)})")
        low = [m - e for m, e in zip(mean, se, strict=True)]
        high = [m + e for m, e in zip(mean, se, strict=True)]
        axes[2].fill_between(steps, low, high, color=c, alpha=0.15, linewidth=0)
        axes[2].plot(steps, [min(a[s] for a in at) for s in steps], "--", color=c, alpha=0.6)
    axes[0].set_xlabel("environment episodes consumed in RL")
    axes[1].set_xlabel("RL wall-clock (s; see the load averages)")
    axes[2].set_xlabel("RL update (mean ± s.e. over finished seeds; dashed: worst seed)")
    axes[0].set_ylabel("held-out success")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if axes[2].lines:
        axes[2].legend(fontsize=8)
    fig.suptitle(f"{study.name}: one line per cell (dotted: unfinished); right: over seeds")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def lost_cells(study: Study, all_cells: list[Cell], doc: Path) -> list[str]:
    """The cells the study's section of `doc` reports as done (its per-cell table) that the
    study can no longer read: neither their run folder nor their record is there."""
    if not doc.exists() or not study.section:
        return []
    m = re.search(
        rf"^## {re.escape(study.section)}\n(.*?)(?=^## |\Z)", doc.read_text(), re.S | re.M
    )
    if m is None:
        return []
    listed = set(re.findall(r"^\| (\S+) \| done \|", m.group(1), re.M))
    return [c.name for c in all_cells if c.name in listed and state(c) != "done"]


# ---------------------------------------------------------------------------- plan
def _shared_plan(study: Study, all_cells: list[Cell]) -> tuple[list[str], float]:
    """One line per shared stage the study runs: its state, steps logged of the config's, and
    the time left at its own measured rate (seconds between its logged steps) once it has one,
    else, for a missing stage, the time its recorded start took (``wall_s`` of
    ``<records>/_shared/<stage>.json``). A new machine has none of them (their weights are not
    recorded), and they come before any cell. Also the seconds left that are known."""
    from sao_megatron.configs import load_config
    from sao_megatron.trainer.job import JobConfig

    job = load_config(JobConfig, REPO / study.config, study.overrides)
    sft_dir, vp_dir = _shared_dirs(study)
    needs_vp = any(c.needs_value_model and not c.own_value_pretrain for c in all_cells)
    stages = [
        ("sft", sft_dir, job.sft.steps, study.shared_sft),
        (
            "value_pretrain",
            vp_dir,
            job.value_pretrain.steps,
            study.shared_value_pretrain and needs_vp,
        ),
    ]
    lines, left = [], 0.0
    for stage, folder, total, runs in stages:
        if not runs:
            continue
        st = _folder_state(folder)
        try:
            recs = [r for r in read_metrics(folder / stage) if "step" in r]
        except FileNotFoundError:
            recs = []
        steps = max((int(r["step"]) for r in recs), default=0)
        path = _start_record(study, stage)
        kept = json.loads(path.read_text()) if path.exists() else None
        est = "-"
        if st != "done":
            times = [r["time/unix"] for r in recs if "time/unix" in r]
            if len(times) > 1 and total > steps:
                rate = (times[-1] - times[0]) / (len(times) - 1)
                left += (total - steps) * rate
                est = f"~{(total - steps) * rate / 60:.0f} min (at most; its own rate)"
            elif st == "missing" and kept is not None and kept.get("wall_s") is not None:
                left += kept["wall_s"]
                est = f"~{kept['wall_s'] / 60:.0f} min (the recorded start's)"
            else:
                est = "unknown until it logs two steps"
        if kept is not None:
            est += f"; must match the recorded start `{kept['digest'][:12]}`"
        lines.append(f"{'shared ' + stage:40s} {st:11s} step {steps:4d}/{total}  {est}")
    return lines, left


def plan_text(study: Study, all_cells: list[Cell]) -> str:
    """Each cell's state, and the 2-core time left estimated from the RL seconds per step the
    study's own cells of the same algorithm measured, else the study file's `seconds_per_step`
    hint (marked), else "unknown" (run one cell first)."""
    per_step: dict[str, list[float]] = {}
    figs = [figures(c) for c in all_cells]
    for f in figs:
        if f.wall_s and f.steps:
            per_step.setdefault(f.cell.algorithm, []).append(f.wall_s / f.steps)
    lines, shared_left = _shared_plan(study, all_cells)
    left, unknown = 0.0, []
    for f in figs:
        rate = per_step.get(f.cell.algorithm)
        rate_s = sum(rate) / len(rate) if rate else study.seconds_per_step.get(f.cell.algorithm)
        remaining = study.rl_steps - f.steps if f.state != "done" else 0
        est = "-"
        if remaining and rate_s:
            left += remaining * rate_s
            est = f"~{remaining * rate_s / 60:.0f} min" + ("" if rate else " (hint)")
        elif remaining:
            unknown.append(f.cell.name)
            est = "unknown"
        lines.append(f"{f.cell.name:40s} {f.state:11s} step {f.steps:4d}/{study.rl_steps}  {est}")
    shared = f" + ~{shared_left / 60:.0f} min of shared stages" if shared_left else ""
    lines.append(
        f"left: ~{left / 3600:.1f} h of RL{shared} (measured rates, else the study's hints)"
    )
    if study.horizon_eval is not None:
        paths = [_start_horizon_file(study)]
        paths += [source(c) / HORIZON for c in all_cells if wants_horizon_eval(study, c)]
        walls = [json.loads(x.read_text())["wall_s"] for x in paths if horizon_result(x, study)]
        n = sum(horizon_result(x, study) is None for x in paths)
        each = f"~{sum(walls) / len(walls) / 60:.0f} min each" if walls else "cost unknown yet"
        lines.append(f"horizon evaluations left: {n} of {len(paths)} policies ({each})")
    if unknown:
        lines.append(f"unknown rate (no cell of the algorithm has run yet): {len(unknown)} cells")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("study", help="the study file (examples/studies/*.yaml)")
    ap.add_argument("--plan", action="store_true", help="print each cell's state and cost left")
    ap.add_argument("--report", action="store_true", help="tables and plot from the runs there")
    ap.add_argument(
        "--write",
        action="store_true",
        help="with --report: replace the study's section of docs/BENCHMARKS.md",
    )
    ap.add_argument(
        "--only",
        default="*",
        help="run only cells whose name ('sao+variant/seed0') matches one of these globs "
        "(comma-separated: 'grpo*,sao+k1/*')",
    )
    ap.add_argument("--max-cells", type=int, default=0, help="run at most this many cells")
    ap.add_argument(
        "--stop",
        action="store_true",
        help="ask this study's running runner to stop: its job saves after the current step "
        "and exits (resumable), and no other job starts",
    )
    ap.add_argument(
        "--shared",
        action="store_true",
        help="run only the shared stages (SFT, value pre-training) the selected cells need",
    )
    args = ap.parse_args(argv)
    study = load_study(args.study)
    all_cells = cells(study)
    if args.plan:
        print(plan_text(study, all_cells))
        return 0
    if args.stop:
        print(stop_study(study))
        return 0
    record_shared_starts(study)
    record_finished(all_cells, study)
    if args.report:
        if args.write:
            lost = lost_cells(study, all_cells, benchlib.DOC)
            if lost:
                raise SystemExit(
                    f"{args.study}: not written: docs/BENCHMARKS.md's section '{study.section}' "
                    f"reports {', '.join(lost)} as done, but neither its run folder under "
                    f"{study.out} nor its record under {study.records} is here (a run folder "
                    "made before records were kept, on another machine?). Rerun the cell(s) "
                    f"(`--only '{lost[0]}'`) or restore the record from git, then --write; "
                    "`--report` without --write prints what it would write"
                )
        figs = [figures(c) for c in all_cells]
        img_name = f"study_{benchlib.section_slug(study.name)}.png"
        img = (REPO / "docs" / "img" if args.write else Path(study.out)) / img_name
        plot(study, figs, img)
        text = report_text(study, figs, f"img/{img.name}" if args.write else str(img))
        if study.horizon_eval is not None:
            text += "\n\n" + horizon_table(study, all_cells)
        print(text)
        if args.write:
            if not study.section:
                raise SystemExit(f"{args.study}: --write needs `section` (a BENCHMARKS heading)")
            benchlib.write_section(study.section, text + "\n\n" + benchlib.READING)
        return 0
    globs = [g for g in args.only.split(",") if g]

    def chosen(c: Cell) -> bool:
        return any(fnmatch.fnmatch(c.name, g) for g in globs)

    todo = [c for c in all_cells if chosen(c) and state(c) != "done"]
    if args.max_cells:
        todo = todo[: args.max_cells]
    print(f"[study] {study.name}: {len(todo)} cell(s) to run of {len(all_cells)}", flush=True)
    selected = [c for c in all_cells if chosen(c)]
    out = Path(study.out)
    for stale in (out / STOP, out / (STOP + ".consumed")):  # a --stop no runner took
        stale.unlink(missing_ok=True)
    _runner_state(study)
    try:
        if todo or args.shared:
            preflight(study)
            run(study, [] if args.shared else todo, selected)
        else:  # nothing to train: no shared stage either (a new machine need not redo them)
            evaluate_horizons(study, selected)
    except StudyStopped as e:
        print(f"[study] {e}", flush=True)
    finally:
        (out / RUNNER).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
