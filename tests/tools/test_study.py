"""tools/study.py: the matrix of cells, shared stages run once, interrupted cells resumed in
their folder, finished cells never rerun, a changed cell refused, and the report and plan from
whatever runs exist. The jobs are a fake `sao-train` (a script that writes the metrics a real
RL stage writes, resumes from its own metrics like a checkpointed run, and can be told to die
after a step); the cells' commands are the real ones."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from sao_megatron.configs import load_config
from sao_megatron.trainer.job import JobConfig

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
_spec = importlib.util.spec_from_file_location("study", ROOT / "tools" / "study.py")
study_mod = importlib.util.module_from_spec(_spec)
sys.modules["study"] = study_mod  # dataclasses look their module up
_spec.loader.exec_module(study_mod)

FAKE_JOB = r"""
import json, os, sys
from pathlib import Path
run_dir = Path(sys.argv[1]); ov = dict(o.split("=", 1) for o in sys.argv[2:])
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"run_dir": str(run_dir), "stages": ov["stages"]}) + "\n")
stages = ov["stages"]
def log_steps(stage, key, first):  # what the real stage logs per step (a loss, the clock)
    (run_dir / stage).mkdir(exist_ok=True)
    with open(run_dir / stage / "metrics.jsonl", "a") as f:
        for step in (1, 2):
            f.write(json.dumps({"step": step, key: first / step, "time/unix": 1e9 + step}) + "\n")
if stages == "[sft]":
    log_steps("sft", "sft/loss", float(os.environ.get("FAKE_SFT_LOSS", "1.0")))
    import time; time.sleep(float(os.environ.get("FAKE_SFT_SECONDS", "0")))  # its wall-clock
    (run_dir / "checkpoints" / "sft" / "step_00000010").mkdir(parents=True)
    (run_dir / "tokenizer").mkdir(); (run_dir / "tokenizer" / "t.model").write_text("tok")
    sys.exit(0)
def hf(name):  # a Hugging Face folder, as the job exports them
    (run_dir / name).mkdir(exist_ok=True); (run_dir / name / "config.json").write_text("{}")
if "FAKE_CONFIG" in os.environ:  # the job writes the config it trained with
    (run_dir / "config.yaml").write_text(Path(os.environ["FAKE_CONFIG"]).read_text())
if stages == "[value_pretrain]":
    assert (run_dir / "checkpoints" / "sft" / "step_00000010").is_dir(), "not seeded from SFT"
    (run_dir / "checkpoints" / "rl" / "step_00000000").mkdir(parents=True)
    (run_dir / "checkpoints" / "rl" / "step_00000000" / "critic").write_text("vp")
    log_steps("value_pretrain", "value_pretrain/explained_variance", 0.25)
    hf("hf_policy")
    sys.exit(0)
steps, seed = int(ov["rl.steps"]), int(ov["seed"])
sao = "algorithm.name=grpo" not in sys.argv[2:]
assert (run_dir / "checkpoints" / "rl" / "step_00000000").is_dir() == sao, "critic seeding"
rl = run_dir / "rl"; rl.mkdir(exist_ok=True)
metrics = rl / "metrics.jsonl"
done = [json.loads(x)["step"] for x in metrics.read_text().splitlines()] if metrics.exists() else []
every = int(ov["checkpoint.save_interval"])
start = max(done, default=0) // every * every  # resumes from its last checkpoint
die_at = int(os.environ.get("FAKE_DIE_AT", "0"))
def episodes(step, solved):  # 4 held-out tasks (seeds 1-4), as logging.eval_episodes writes
    (rl / "eval_episodes").mkdir(exist_ok=True)
    lines = [json.dumps({"env": "t", "seed": k, "solved": k in solved}) for k in (1, 2, 3, 4)]
    (rl / "eval_episodes" / f"step_{step:08d}.jsonl").write_text("\n".join(lines) + "\n")
if not done:
    with open(rl / "eval.jsonl", "a") as f:
        first = {"step": 0, "eval/success_rate": 0.1 + 0.01 * seed, "eval/turns": 5.0}
        f.write(json.dumps(first) + "\n")
    episodes(0, {1})
for step in range(start + 1, steps + 1):
    with open(metrics, "a") as f:
        f.write(json.dumps({"step": step, "time/rl_elapsed_s": 2.0 * step,
                            "rollout/episodes_started": 40 + 16 * step,
                            "batch/num_trajectories": 16, "reward/mean": 0.5, "policy/entropy": 0.1,
                            "value/explained_variance_before": 0.2 if sao else None}) + "\n")
    if die_at and step == die_at:
        sys.exit(3)
    if int(os.environ.get("FAKE_KILL_AT", "0")) == step:  # as the out-of-memory killer does
        import signal; os.kill(os.getpid(), signal.SIGKILL)
    if int(os.environ.get("FAKE_STOP_AT", "0")) == step:  # --stop arrives during this step
        Path(os.environ["SAO_STOP_FILE"]).touch()
    stop = Path(os.environ["SAO_STOP_FILE"])
    if stop.exists():  # the trainer: saved after this step, the file consumed, exit 0
        stop.replace(stop.with_name(stop.name + ".consumed"))
        sys.exit(0)
    if int(os.environ.get("FAKE_EXIT0_AT", "0")) == step:
        sys.exit(0)
with open(rl / "eval.jsonl", "a") as f:
    final = (0.5 if sao else 0.3) + 0.01 * seed
    last = {"step": steps, "eval/success_rate": final, "eval/turns": 3.0 + seed}
    f.write(json.dumps(last) + "\n")
episodes(steps, {1, 2, 3} if sao else {1, 2} if seed == 0 else {4})
hf("hf_policy_final")
"""

STUDY = """\
name: test study
config: examples/configs/quickstart.yaml
out: {out}
section: Test study
rl_steps: 4
num_eval_tasks: 8
save_interval: 2
algorithms:
  sao: []
  grpo: []
variants:
  k1:
    overrides: [algorithm.sao.value_updates_per_policy_update=1]
    algorithms: [sao]
seeds: [0, 1]
"""


@pytest.fixture
def study(tmp_path, monkeypatch):
    fake = tmp_path / "fake_job.py"
    fake.write_text(FAKE_JOB)
    log = tmp_path / "jobs.jsonl"
    monkeypatch.setenv("FAKE_LOG", str(log))

    def command(study, run_dir, overrides):
        return [sys.executable, str(fake), str(run_dir), *overrides]

    monkeypatch.setattr(study_mod, "_command", command)
    monkeypatch.setattr(study_mod, "preflight", lambda st: None)  # the fake jobs need no engines
    path = tmp_path / "study.yaml"
    path.write_text(STUDY.format(out=tmp_path / "out"))
    jobs = lambda: [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []  # noqa: E731
    return path, tmp_path / "out", jobs


def test_cells_are_seed_major_with_their_own_overrides(study):
    path, out, _ = study
    cells = study_mod.cells(study_mod.load_study(path))
    assert [c.name for c in cells] == [
        "sao/seed0", "grpo/seed0", "sao/seed1", "grpo/seed1", "sao+k1/seed0", "sao+k1/seed1",
    ]  # fmt: skip
    by = {c.name: c for c in cells}
    assert by["sao+k1/seed1"].run_dir == out / "sao+k1" / "seed1"
    assert "algorithm.sao.value_updates_per_policy_update=1" in by["sao+k1/seed1"].overrides
    assert "algorithm.name=grpo" in by["grpo/seed0"].overrides
    grpo1 = by["grpo/seed1"].overrides
    assert {"seed=1", "rollout.seed=1", "rl.steps=4", "stages=[rl]"} <= set(grpo1)
    assert not [o for o in grpo1 if o.startswith(("tasks.train_seed=", "parallel.seed="))]
    # what the cell's job resolves to: the seeds follow seed=1
    job = load_config(JobConfig, ROOT / "examples/configs/quickstart.yaml", grpo1)
    assert (job.seed, job.parallel.seed, job.tasks.train_seed, job.rollout.seed) == (1, 1235, 1, 1)
    assert job.tasks.eval_seed == 1_000_003
    assert by["sao/seed0"].needs_value_model and not by["grpo/seed0"].needs_value_model


def test_shared_stages_once_interrupted_cell_resumes_and_done_cells_never_rerun(study, monkeypatch):
    path, out, jobs = study
    monkeypatch.setenv("FAKE_DIE_AT", "3")  # every job dies after RL step 3
    with pytest.raises(RuntimeError, match=r"cell 1/6 sao/seed0 failed \(exit 3\); rerun"):
        study_mod.main([str(path)])
    assert [j["stages"] for j in jobs()] == ["[sft]", "[value_pretrain]", "[rl]"]
    cell = json.loads((out / "sao" / "seed0" / "cell.json").read_text())
    assert [a["exit_code"] for a in cell["attempts"]] == [3]
    assert cell["attempts"][0]["rl_steps_after"] == 3 and "commit" in cell["attempts"][0]

    monkeypatch.delenv("FAKE_DIE_AT")
    assert study_mod.main([str(path)]) == 0
    # the shared stages are not rerun; the first cell resumes in its folder, the others run
    assert [j["stages"] for j in jobs()] == ["[sft]", "[value_pretrain]"] + ["[rl]"] * 7
    cell = json.loads((out / "sao" / "seed0" / "cell.json").read_text())
    assert [(a["rl_steps_before"], a["rl_steps_after"]) for a in cell["attempts"]] == [
        (0, 3),
        (3, 4),
    ]
    # it died after step 3 and resumed from its step-2 checkpoint: step 3 logged twice, the
    # report reads the last record of each step
    metrics = (out / "sao" / "seed0" / "rl" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in metrics] == [1, 2, 3, 3, 4]
    cells = {c.name: c for c in study_mod.cells(study_mod.load_study(path))}
    figs = study_mod.figures(cells["sao/seed0"])
    assert figs.steps == 4 and figs.episodes == [(0.0, 0.1), (64.0, 0.5)]
    # a resumed process counts episodes and its clock from 0 again: made continuous
    assert study_mod._across_restarts([56, 72, 88, 16, 32], 40) == [16, 32, 48, 64, 80]
    assert study_mod._across_restarts([2.0, 4.0, 1.5, 3.0], 0.0) == [2.0, 4.0, 5.5, 7.0]
    # SAO cells start from the shared pre-trained critic, GRPO's from the SFT start only
    assert (out / "sao+k1" / "seed1" / "checkpoints" / "rl" / "step_00000000" / "critic").exists()
    assert (out / "grpo" / "seed1" / "checkpoints" / "sft" / "step_00000010").is_dir()

    n = len(jobs())
    assert study_mod.main([str(path)]) == 0
    assert len(jobs()) == n  # everything done: nothing runs


def test_a_killed_cell_names_the_signal_and_resumes(study, monkeypatch):
    path, out, jobs = study
    monkeypatch.setenv("FAKE_KILL_AT", "3")
    with pytest.raises(RuntimeError) as err:
        study_mod.main([str(path)])
    msg = str(err.value)
    assert msg.startswith("cell 1/6 sao/seed0 failed (exit -9: killed by SIGKILL, most often")
    assert "out-of-memory killer" in msg and "dmesg" in msg
    assert str(out / "sao" / "seed0" / "job.log") in msg
    cell = json.loads((out / "sao" / "seed0" / "cell.json").read_text())
    assert [(a["exit_code"], a["rl_steps_after"]) for a in cell["attempts"]] == [(-9, 3)]
    monkeypatch.delenv("FAKE_KILL_AT")
    assert study_mod.main([str(path)]) == 0
    cell = json.loads((out / "sao" / "seed0" / "cell.json").read_text())
    assert [(a["rl_steps_before"], a["exit_code"]) for a in cell["attempts"]] == [(0, -9), (3, 0)]
    assert study_mod._exit_reason(-15) == "exit -15: killed by SIGTERM"
    assert study_mod._exit_reason(-200) == "exit -200: killed by signal 200"


def test_a_changed_cell_is_refused_and_only_selects_cells(study, monkeypatch):
    path, out, jobs = study
    monkeypatch.setenv("FAKE_DIE_AT", "1")
    with pytest.raises(RuntimeError):
        study_mod.main([str(path), "--only", "grpo/*"])
    assert [j["run_dir"] for j in jobs()][-1] == str(out / "grpo" / "seed0")
    assert not (out / "_shared" / "value_pretrain").exists()  # no SAO cell selected
    monkeypatch.delenv("FAKE_DIE_AT")
    assert study_mod.main([str(path), "--only", "nothing*,grpo/seed1"]) == 0  # several globs
    assert [j["run_dir"] for j in jobs()][-1] == str(out / "grpo" / "seed1")
    path.write_text(path.read_text().replace("rl_steps: 4", "rl_steps: 6"))
    with pytest.raises(
        RuntimeError, match=r"grpo/seed0.*holds another job.*rl.steps: 4 -> 6.*delete the folder"
    ):
        study_mod.main([str(path), "--only", "grpo/*", "--max-cells", "1"])


def test_a_cell_is_what_its_resolved_config_trains(study, monkeypatch, tmp_path):
    """The study compares what an unfinished cell trains, not how the study file spells it: an
    edit to the job's config file is refused (naming the field), an override that restates the
    config's value is not; a cell recorded before the resolved config gets it on resuming."""
    path, out, jobs = study
    config = tmp_path / "job.yaml"
    config.write_text((ROOT / "examples/configs/quickstart.yaml").read_text())
    path.write_text(path.read_text().replace("examples/configs/quickstart.yaml", str(config)))
    monkeypatch.setenv("FAKE_DIE_AT", "1")
    with pytest.raises(RuntimeError, match="failed"):
        study_mod.main([str(path), "--only", "grpo/seed0"])
    monkeypatch.delenv("FAKE_DIE_AT")
    cell = out / "grpo" / "seed0" / "cell.json"
    recorded = json.loads(cell.read_text())["resolved"]
    assert recorded["rollout.max_staleness"] == 1 and "checkpoint.save_interval" not in recorded

    # the same job spelled differently (the config's own staleness bound restated): resumes
    path.write_text(path.read_text().replace("  grpo: []", "  grpo: [rollout.max_staleness=1]"))
    assert study_mod.main([str(path), "--only", "grpo/seed0"]) == 0
    assert (out / "grpo" / "seed0" / "study_done.json").exists()

    # the config file edited under an unfinished cell: refused, naming the field (the shared
    # SFT start, made from the same file, is still this study's start)
    monkeypatch.setenv("FAKE_DIE_AT", "1")
    with pytest.raises(RuntimeError, match="failed"):
        study_mod.main([str(path), "--only", "grpo/seed1"])
    monkeypatch.delenv("FAKE_DIE_AT")
    text = config.read_text()
    config.write_text(text.replace("trajectories_per_batch: 16", "trajectories_per_batch: 8"))
    with pytest.raises(RuntimeError, match=r"grpo/seed1.*rollout.trajectories_per_batch: 16 -> 8"):
        study_mod.main([str(path), "--only", "grpo/seed1"])
    # a config field the code added or removed since the cell was recorded is no change
    record = json.loads((out / "grpo" / "seed1" / "cell.json").read_text())
    assert (
        study_mod._config_changes(record["resolved"], record["resolved"] | {"new.field": 1}) == []
    )
    # a finished cell stays finished whatever changed
    assert study_mod.main([str(path), "--only", "grpo/seed0"]) == 0

    # a cell recorded before configs were: compared by its overrides, then recorded
    record = json.loads((out / "grpo" / "seed1" / "cell.json").read_text())
    del record["resolved"]
    (out / "grpo" / "seed1" / "cell.json").write_text(json.dumps(record))
    assert study_mod.main([str(path), "--only", "grpo/seed1"]) == 0
    resolved = json.loads((out / "grpo" / "seed1" / "cell.json").read_text())["resolved"]
    assert resolved["rollout.trajectories_per_batch"] == 8


def test_report_marks_missing_and_unfinished_cells_and_plan_prices_them(study, monkeypatch):
    path, out, _ = study
    assert study_mod.main([str(path), "--only", "*/seed0"]) == 0
    monkeypatch.setenv("FAKE_DIE_AT", "2")
    with pytest.raises(RuntimeError):
        study_mod.main([str(path), "--only", "sao/seed1"])
    st = study_mod.load_study(path)
    figs = [study_mod.figures(c) for c in study_mod.cells(st)]
    text = study_mod.report_text(st, figs, "img/x.png")
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")}
    assert "| sao/seed1 | unfinished (step 2) | 2 of 4 |" in text
    commit = json.loads((out / "sao" / "seed0" / "cell.json").read_text())["attempts"][0]["commit"]
    assert f"UTC at commit(s) {commit}" in text and "; per-cell load averages below." in text
    assert "| grpo/seed1 | missing | 0 of 4 | - -> - |" in text
    assert rows["sao"] == (
        "| sao | 1 of 2 | 10.0% (n=1) | 50.0% (n=1) | +40.0 | 0 of 1 | 50.0% (seed 0) | 0.20 |"
    )
    assert rows["grpo"] == (
        "| grpo | 1 of 2 | 10.0% (n=1) | 30.0% (n=1) | +20.0 | 0 of 1 | 30.0% (seed 0) | - |"
    )
    # the same-seed table: one row per seed, one column per group, unfinished cells marked
    assert "| seed | sao | grpo | sao+k1 |" in text
    assert "| 0 | 50.0% (50.0%) | 30.0% (30.0%) | 50.0% (50.0%) |" in text
    assert "| 1 | (step 2) | - | - |" in text
    # paired by seed against the first group: seed 0 only (seed 1 of sao is unfinished)
    pairs = [x for x in text.splitlines() if x.startswith("- sao - ")]
    assert pairs == [
        "- sao - grpo: +20.0 points (seed(s) 0); mean +20.0 over 1 seed(s); sao ahead on 1 of 1",
        "- sao - sao+k1: +0.0 points (seed(s) 0); mean +0.0 over 1 seed(s); sao ahead on 0 of 1",
    ]
    sao0 = next(f for f in figs if f.cell.name == "sao/seed0")
    # episodes counted from the start of RL (40 before it: value pre-training's)
    assert sao0.episodes == [(0.0, 0.1), (64.0, 0.5)] and sao0.walls == [(0.0, 0.1), (8.0, 0.5)]

    plan = study_mod.plan_text(st, study_mod.cells(st))
    assert "sao/seed1" in plan and "unfinished" in plan
    # sao: 2 s per step measured; seed1 has 2 steps left (4 s), sao+k1/seed1 4 (8 s); grpo 8 s
    assert "~0 min" in plan and "left: ~0.0 h" in plan
    st.seconds_per_step = {"grpo": 600.0}  # a measured rate (grpo/seed0: 2 s) beats the hint
    assert "(hint)" not in study_mod.plan_text(st, study_mod.cells(st))

    # both seeds of every group done: mean ± s.e.
    monkeypatch.delenv("FAKE_DIE_AT")
    assert study_mod.main([str(path)]) == 0
    figs = [study_mod.figures(c) for c in study_mod.cells(st)]
    text = study_mod.report_text(st, figs, None)
    assert "| sao | 2 of 2 | 10.5% ± 0.5 (n=2) | 50.5% ± 0.5 (n=2) | +40.0 ± 0.0 | 0 of 2 |" in text
    assert "| 1 | 51.0% (51.0%) | 31.0% (31.0%) | 51.0% (51.0%) |" in text
    assert "- sao - grpo: +20.0 / +20.0 points (seed(s) 0, 1); mean +20.0 ± 0.0 over 2" in text
    sao1 = next(f for f in figs if f.cell.name == "sao/seed1")
    assert sao1.by_step == [(0, 0.11), (4, 0.51)] and sao1.lowest == 0.51
    img = out / "plot.png"
    study_mod.plot(st, figs, img)
    assert img.stat().st_size > 10_000


def test_study_file_errors_name_the_field(tmp_path):
    bad = tmp_path / "s.yaml"
    bad.write_text("name: x\nconfig: c.yaml\nout: o\nrl_stesp: 3\nalgorithms: {sao: []}\n")
    with pytest.raises(ValueError, match="did you mean 'rl_steps'"):
        study_mod.load_study(bad)
    bad.write_text("name: x\nconfig: c.yaml\nout: o\nalgorithms: {}\n")
    with pytest.raises(ValueError, match="`algorithms` is empty"):
        study_mod.load_study(bad)
    bad.write_text(
        "name: x\nconfig: c.yaml\nout: o\nalgorithms: {sao: []}\n"
        "variants: {k1: {algorithms: [gpro]}}\n"
    )
    with pytest.raises(ValueError, match=r"variants.k1.algorithms names \['gpro'\]"):
        study_mod.load_study(bad)
    bad.write_text(
        "name: x\nconfig: c.yaml\nout: o\nalgorithms: {sao: []}\ninclude_baseline: false\n"
    )
    with pytest.raises(ValueError, match="no `variants`"):
        study_mod.load_study(bad)


def test_a_finished_cell_that_collapsed_is_flagged(study):
    """bench_stability's rule on the cell's batch rewards and entropies: reward from 0.5 to 0 and
    entropy from 0.1 to 0.01 in the last half is a collapse; a steady run is not."""
    path, out, _ = study
    cell = study_mod.cells(study_mod.load_study(path))[0]
    (cell.run_dir / "rl").mkdir(parents=True)
    (cell.run_dir / "cell.json").write_text(json.dumps({"attempts": []}))
    (cell.run_dir / "study_done.json").write_text("{}")

    def write(rewards, entropies):
        recs = [
            {"step": i + 1, "time/rl_elapsed_s": i + 1.0, "reward/mean": r, "policy/entropy": e}
            for i, (r, e) in enumerate(zip(rewards, entropies, strict=True))
        ]
        (cell.run_dir / "rl" / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in recs)
        )
        return study_mod.figures(cell).collapsed

    assert write([0.5] * 40, [0.1] * 40) is False
    assert write([0.5] * 20 + [0.0] * 20, [0.1] * 20 + [0.01] * 20) is True

    # steady batch signals, but held-out success halved (0.89 -> 0.40) at any evaluation: a
    # collapse too; 0.89 -> 0.50 is not
    def held_out(after, middle=0.89):
        evals = [
            {"step": 0, "eval/success_rate": 0.89},
            {"step": 20, "eval/success_rate": middle},
            {"step": 40, "eval/success_rate": after},
        ]
        (cell.run_dir / "rl" / "eval.jsonl").write_text(
            "".join(json.dumps(e) + "\n" for e in evals)
        )
        return write([0.5] * 40, [0.1] * 40)

    assert held_out(0.40) is True
    assert held_out(0.50) is False
    # halved midway and recovered by the end (GRPO at bound 4, seed 1: 89.8 -> 7.0 -> 54.7%)
    assert held_out(0.85, middle=0.07) is True


def test_plan_of_a_study_not_started_prices_cells_from_the_hints(study):
    path, _, _ = study
    st = study_mod.load_study(path)
    st.seconds_per_step = {"sao": 60.0, "grpo": 30.0}
    lines = study_mod.plan_text(st, study_mod.cells(st)).splitlines()
    # the shared stages first (the quickstart config's 200 SFT steps, a 12-update critic cap)
    assert (
        " ".join(lines[0].split())
        == "shared sft missing step 0/200 unknown until it logs two steps"
    )
    assert lines[1].split()[:5] == ["shared", "value_pretrain", "missing", "step", "0/12"]
    assert lines[2].split() == ["sao/seed0", "missing", "step", "0/4", "~4", "min", "(hint)"]
    assert lines[3].split()[-3:] == ["~2", "min", "(hint)"]  # grpo/seed0
    assert lines[-1].startswith("left: ~0.3 h")  # 4 SAO cells x 4 min + 2 GRPO cells x 2 min
    # an SFT under way is priced at its own rate: 3 steps 30 s apart, 197 left ~ 98.5 min
    sft = Path(st.out) / "_shared" / "sft"
    (sft / "sft").mkdir(parents=True)
    (sft / "cell.json").write_text("{}")
    recs = [{"step": k, "time/unix": 1000.0 + 30 * k} for k in (1, 2, 3)]
    (sft / "sft" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    first = study_mod.plan_text(st, study_mod.cells(st)).splitlines()[0].split()
    assert first[:5] == ["shared", "sft", "unfinished", "step", "3/200"] and first[5] == "~98"


def test_a_variant_runs_on_its_own_seeds(study):
    path, _, _ = study
    path.write_text(
        path.read_text().replace("algorithms: [sao]", "algorithms: [sao]\n    seeds: [1]")
    )
    names = [c.name for c in study_mod.cells(study_mod.load_study(path))]
    assert names == ["sao/seed0", "grpo/seed0", "sao/seed1", "grpo/seed1", "sao+k1/seed1"]
    path.write_text(path.read_text().replace("seeds: [1]", "seeds: [7]"))
    with pytest.raises(ValueError, match=r"variants.k1.seeds names \[7\], not in `seeds`"):
        study_mod.load_study(path)


def test_horizon_evaluation_of_finished_cells_and_the_start_once_each(study, monkeypatch):
    """`horizon_eval`: the RL start (the shared value pre-training's policy) and each finished
    cell of the covered groups evaluated once, as it finishes; a rerun evaluates nothing again;
    the report has the by-horizon table over seeds and names what is not evaluated."""
    path, out, _ = study
    monkeypatch.setenv("FAKE_CONFIG", str(ROOT / "examples/configs/hanoi_plan.yaml"))
    path.write_text(
        path.read_text()
        + "horizon_eval: {horizons: [50, 200], num_tasks: 4, groups: [sao, grpo]}\n"
        + "report_eval_keys: [eval/turns]\n"
    )
    calls = []

    def evaluate(hf_dir, job, horizons, num_tasks, work):
        assert (hf_dir / "config.json").exists() and job.tasks.train[0].name == "hanoi"
        calls.append(str(hf_dir.relative_to(out)))
        seed = 0 if "seed0" in str(hf_dir) else 1
        base = 0.2 if "value_pretrain" in str(hf_dir) else 0.6 + 0.1 * seed
        return {
            h: {"success_rate": base if h == 50 else base - 0.1, "illegal_move_rate": 0.01,
                "non_optimal_move_rate": 0.02} for h in horizons
        }  # fmt: skip

    real = study_mod.evaluate_horizons
    monkeypatch.setattr(
        study_mod, "evaluate_horizons", lambda st, cells: real(st, cells, evaluate=evaluate)
    )
    monkeypatch.setenv("FAKE_DIE_AT", "2")
    with pytest.raises(RuntimeError):
        study_mod.main([str(path), "--only", "*/seed1"])
    monkeypatch.delenv("FAKE_DIE_AT")
    assert calls == []  # nothing finished
    assert study_mod.main([str(path), "--only", "*/seed0"]) == 0
    # the start once (when the first cell finished), then each covered cell as it finished;
    # sao+k1 is not a covered group
    assert calls == [
        "_shared/value_pretrain/hf_policy", "sao/seed0/hf_policy_final",
        "grpo/seed0/hf_policy_final",
    ]  # fmt: skip
    st = study_mod.load_study(path)
    assert "horizon evaluations left: 2 of 5 policies" in study_mod.plan_text(
        st, study_mod.cells(st)
    )
    assert study_mod.main([str(path)]) == 0
    assert calls[3:] == ["sao/seed1/hf_policy_final", "grpo/seed1/hf_policy_final"]
    assert study_mod.main([str(path)]) == 0 and len(calls) == 5  # saved: never again
    table = study_mod.horizon_table(st, study_mod.cells(st))
    rows = {r.split(" | ")[0][2:]: r.split(" | ") for r in table.splitlines() if r.startswith("| ")}
    assert rows["the RL start"][1:3] == ["1", "0.200"]
    assert rows["sao"][1:3] == ["2", "0.650 ± 0.050"]  # seeds 0.6, 0.7
    assert rows["sao"][5] == "0.550 ± 0.050"  # H = 200: 0.1 less in the fake
    assert "Not evaluated" not in table
    saved = json.loads((out / "sao" / "seed0" / "horizon_eval.json").read_text())
    assert saved["key"] == {"horizons": [50, 200], "num_tasks": 4} and "commit" in saved
    # another task count is another measurement: every policy is missing again
    st.horizon_eval.num_tasks = 8
    assert "Not evaluated yet: sao/seed0, grpo/seed0" in study_mod.horizon_table(
        st, study_mod.cells(st)
    )
    # the report's held-out metric before -> after, over seeds: turns 5 -> 3, 4
    figs = [study_mod.figures(c) for c in study_mod.cells(st)]
    text = study_mod.report_text(st, figs, None)
    assert "| grpo | 5 ± 0 -> 3.5 ± 0.5 |" in text


def test_shared_runs_only_the_shared_stages(study):
    path, out, jobs = study
    assert study_mod.main([str(path), "--shared", "--only", "grpo/*"]) == 0
    assert [j["stages"] for j in jobs()] == ["[sft]"]  # GRPO cells need no critic
    path.write_text(path.read_text() + "shared_save_interval: 50\n")  # the next stage's only
    assert study_mod.main([str(path), "--shared"]) == 0
    assert [j["stages"] for j in jobs()] == ["[sft]", "[value_pretrain]"]
    assert not (out / "sao").exists()
    vp = json.loads((out / "_shared" / "value_pretrain" / "cell.json").read_text())
    assert vp["overrides"][-1] == "checkpoint.save_interval=50"


def test_a_study_starts_from_another_studys_shared_stages(study, tmp_path):
    path, out, jobs = study
    assert study_mod.main([str(path), "--shared"]) == 0
    other = tmp_path / "other.yaml"
    text = path.read_text().replace(f"out: {out}", f"out: {tmp_path / 'out2'}")
    other.write_text(text + f"shared_from: {out}\nrl_steps: 6\n".replace("rl_steps: 6\n", ""))
    assert study_mod.main([str(other), "--only", "sao/seed0"]) == 0
    assert [j["stages"] for j in jobs()] == ["[sft]", "[value_pretrain]", "[rl]"]  # no new SFT
    assert (tmp_path / "out2" / "sao" / "seed0" / "checkpoints" / "rl" / "step_00000000").is_dir()
    assert not (tmp_path / "out2" / "_shared" / "sft").exists()
    # other shared overrides: the shared stages' command differs, refused as a changed cell
    other.write_text(other.read_text() + "overrides: [rollout.max_staleness=4]\n")
    with pytest.raises(RuntimeError, match="shared SFT.*holds another job"):
        study_mod.main([str(other), "--only", "grpo/seed0"])


def test_stop_saves_the_running_job_and_starts_nothing_more(study, monkeypatch):
    """--stop: the job gets the study's stop file (SAO_STOP_FILE), saves after its step and
    exits 0; the runner marks the cell not done, starts no other job and cleans up; a rerun
    resumes the cell. A job that exits 0 short of rl_steps without a stop is not done either."""
    path, out, jobs = study
    st = study_mod.load_study(path)
    with pytest.raises(SystemExit, match="no running study"):
        study_mod.stop_study(st)
    monkeypatch.setenv("FAKE_STOP_AT", "3")
    assert study_mod.main([str(path)]) == 0
    assert [j["stages"] for j in jobs()] == ["[sft]", "[value_pretrain]", "[rl]"]
    cell = json.loads((out / "sao" / "seed0" / "cell.json").read_text())
    assert cell["attempts"][-1]["stopped"] and cell["attempts"][-1]["rl_steps_after"] == 3
    assert not (out / "sao" / "seed0" / "study_done.json").exists()
    assert sorted(p.name for p in out.iterdir()) == ["_shared", "sao"]  # no stop, runner files
    monkeypatch.delenv("FAKE_STOP_AT")
    monkeypatch.setenv("FAKE_EXIT0_AT", "1")
    with pytest.raises(RuntimeError, match=r"cell 1/1 grpo/seed0 exited 0 at RL step 1 of 4 "):
        study_mod.main([str(path), "--only", "grpo/seed0"])
    assert not (out / "grpo" / "seed0" / "study_done.json").exists()
    monkeypatch.delenv("FAKE_EXIT0_AT")
    assert study_mod.main([str(path)]) == 0
    cell = json.loads((out / "sao" / "seed0" / "cell.json").read_text())
    assert [(a["rl_steps_before"], a["stopped"]) for a in cell["attempts"]] == [
        (0, True),
        (3, False),
    ]
    assert all((c.run_dir / "study_done.json").exists() for c in study_mod.cells(st))
    # a live runner (this process stands in for it): --stop leaves the file the job reads
    (out / "runner.json").write_text(json.dumps({"pid": os.getpid(), "job": "cell 1/1 x"}))
    assert "stop asked" in study_mod.stop_study(st) and (out / "stop").exists()


@pytest.mark.parametrize("path", sorted((ROOT / "examples" / "studies").glob("*.yaml")), ids=str)
def test_every_shipped_study_file_resolves_its_cells(path):
    """Each study file loads and every cell's job config resolves with its overrides (a wrong
    key fails here, not hours into a study). A study on a model made by a command (the upcycled
    MoE) names that command in its header, and without the model its error names the folder."""
    st = study_mod.load_study(path)
    header = path.read_text()
    try:
        cells = study_mod.cells(st)
    except ValueError as e:
        missing = "SmolLM2-4x135M-top2"
        if missing in str(e) and not (ROOT / ".cache" / "models" / missing).exists():
            assert "no config.json there" in str(e)
            command = (
                "sao-convert upcycle --hf .cache/models/SmolLM2-135M-Instruct "
                f"--out .cache/models/{missing}"
            )
            assert command in header
            return
        raise
    assert cells and all(c.run_dir.is_relative_to(Path(st.out)) for c in cells)
    names = [c.name for c in cells]
    assert len(names) == len(set(names))


def test_a_finished_cell_is_recorded_and_outlives_its_run_folder(study, monkeypatch, tmp_path):
    """`runs/` is not committed and a machine can be replaced between sittings: a finished
    cell's record (in the repository) keeps it done and reportable when its folder is gone."""
    path, out, jobs = study
    assert study_mod.main([str(path), "--only", "sao/seed0,grpo/seed0"]) == 0
    st = study_mod.load_study(path)
    assert Path(st.records) == path.parent / "records" / "study"  # the default
    cells = {c.name: c for c in study_mod.cells(st)}
    rec = Path(st.records) / "sao" / "seed0"
    assert sorted(str(p.relative_to(rec)) for p in rec.rglob("*") if p.is_file()) == [
        "cell.json",
        "rl/eval.jsonl",
        "rl/eval_episodes/step_00000000.jsonl.gz",
        "rl/eval_episodes/step_00000004.jsonl.gz",
        "rl/metrics.jsonl.gz",
        "shared_start.json",
        "study_done.json",
    ]
    import gzip

    kept = gzip.decompress((rec / "rl/eval_episodes/step_00000000.jsonl.gz").read_bytes())
    plain = cells["sao/seed0"].run_dir / "rl/eval_episodes/step_00000000.jsonl"
    assert kept == plain.read_bytes()
    # an evaluation during RL stays in the run folder: the record keeps the first and the last
    (plain.parent / "step_00000002.jsonl").write_text(plain.read_text())
    study_mod.record_cell(cells["sao/seed0"])
    assert sorted(p.name for p in (rec / "rl/eval_episodes").iterdir()) == [
        "step_00000000.jsonl.gz",
        "step_00000004.jsonl.gz",
    ]
    assert not (Path(st.records) / "sao" / "seed1").exists()  # not run: not recorded
    before = {n: study_mod.figures(cells[n]) for n in ("sao/seed0", "grpo/seed0")}
    text_before = study_mod.report_text(st, list(before.values()), None)

    import shutil

    shutil.rmtree(out)  # the machine is replaced: the run folders are gone
    for name, f in before.items():
        c = cells[name]
        assert study_mod.state(c) == "done" and study_mod.source(c) == c.record_dir
        after = study_mod.figures(c)
        assert (after.before, after.after, after.steps) == (f.before, f.after, f.steps)
        assert after.episodes == f.episodes and after.ev_mean == f.ev_mean
        assert after.eval_last == f.eval_last and after.attempts == f.attempts
    assert study_mod.report_text(st, list(before.values()), None) == text_before
    n = len(jobs())
    assert study_mod.main([str(path), "--only", "sao/seed0,grpo/seed0"]) == 0
    assert len(jobs()) == n  # recorded cells are never rerun
    plan = study_mod.plan_text(st, study_mod.cells(st))
    row = next(x for x in plan.splitlines() if x.startswith("sao/seed0 "))
    assert row.split()[1:4] == ["done", "step", "4/4"]

    # a run folder that holds the cell again wins over the record
    c = cells["sao/seed0"]
    (c.run_dir).mkdir(parents=True)
    (c.run_dir / "cell.json").write_text((c.record_dir / "cell.json").read_text())
    assert study_mod.source(c) == c.run_dir and study_mod.state(c) == "done"


def test_mcnemar_exact_p_values():
    # 2 P(Binomial(n, 1/2) <= min(b, c)): (10, 2) -> 2 (1 + 12 + 66) / 4096
    assert study_mod.mcnemar(10, 2) == pytest.approx(2 * 79 / 4096, rel=1e-12)
    assert study_mod.mcnemar(2, 10) == study_mod.mcnemar(10, 2)
    assert study_mod.mcnemar(5, 0) == pytest.approx(2 / 32, rel=1e-12)
    assert study_mod.mcnemar(3, 3) == 1.0 and study_mod.mcnemar(0, 0) == 1.0


def test_report_compares_the_same_held_out_tasks(study):
    """Every evaluation plays the same tasks: the report pairs them (after vs before in each
    cell, and the first group against the others seed by seed), from run folders or records."""
    path, out, _ = study
    assert study_mod.main([str(path), "--only", "sao/seed0,grpo/seed0,grpo/seed1"]) == 0
    st = study_mod.load_study(path)
    text = study_mod.report_text(st, [study_mod.figures(c) for c in study_mod.cells(st)], None)
    # the fake's 4 tasks: before RL seed 1 solved; after, SAO {1, 2, 3}, GRPO seed 0 {1, 2},
    # GRPO seed 1 {4}
    expected = [
        "- sao/seed0, after RL vs before: +50.0 points on 4 tasks (2 solved only by the first, "
        "0 only by the second; exact McNemar p = 0.5)",
        "- grpo/seed0, after RL vs before: +25.0 points on 4 tasks (1 solved only by the first, "
        "0 only by the second; exact McNemar p = 1)",
        "- grpo/seed1, after RL vs before: +0.0 points on 4 tasks (1 solved only by the first, "
        "1 only by the second; exact McNemar p = 1)",
        "- seed 0, sao vs grpo after RL: +25.0 points on 4 tasks (1 solved only by the first, "
        "0 only by the second; exact McNemar p = 1)",
    ]
    lines = text.splitlines()
    i = lines.index(
        "Task by task (the same held-out tasks on both sides: a paired comparison, "
        "`rl/eval_episodes`):"
    )
    assert lines[i + 2 : i + 6] == expected
    import shutil

    shutil.rmtree(out)  # from the records (gzipped) alone: the same lines
    text = study_mod.report_text(st, [study_mod.figures(c) for c in study_mod.cells(st)], None)
    assert all(line in text.splitlines() for line in expected)
    # a cell without episode files (before logging.eval_episodes) is left out, not an error
    for rec in Path(st.records).glob("*/seed0/rl/eval_episodes"):
        shutil.rmtree(rec)
    text = study_mod.report_text(st, [study_mod.figures(c) for c in study_mod.cells(st)], None)
    assert [x for x in text.splitlines() if x.startswith("- ") and "McNemar" in x] == [expected[2]]


def test_write_refuses_to_drop_a_finished_cell_it_can_no_longer_read(study, monkeypatch, tmp_path):
    path, out, _ = study
    assert study_mod.main([str(path), "--only", "sao/seed0"]) == 0
    doc = tmp_path / "BENCHMARKS.md"
    monkeypatch.setattr(study_mod.benchlib, "DOC", doc)
    monkeypatch.setattr(
        study_mod.benchlib,
        "write_section",
        lambda h, body: doc.write_text(f"# B\n\n## {h}\n\n{body}\n"),
    )
    monkeypatch.setattr(study_mod, "plot", lambda *a: None)  # not into the repository's docs
    assert study_mod.main([str(path), "--report", "--write"]) == 0
    assert "| sao/seed0 | done | 4 of 4 |" in doc.read_text()
    st = study_mod.load_study(path)
    assert study_mod.lost_cells(st, study_mod.cells(st), doc) == []

    import shutil

    shutil.rmtree(out)
    shutil.rmtree(st.records)  # a cell finished before records were kept, on another machine
    written = doc.read_text()
    with pytest.raises(SystemExit) as err:
        study_mod.main([str(path), "--report", "--write"])
    msg = str(err.value)
    assert "reports sao/seed0 as done" in msg and st.records in msg and "--only 'sao/seed0'" in msg
    assert doc.read_text() == written  # nothing lost
    assert study_mod.main([str(path), "--report"]) == 0  # printing is still allowed


def test_a_missing_vllm_virtualenv_stops_the_study_before_its_first_job(study, monkeypatch):
    path, out, jobs = study
    monkeypatch.undo()  # the real preflight (and _command: nothing may run at all)
    monkeypatch.setenv("FAKE_LOG", str(path.parent / "jobs.jsonl"))
    text = path.read_text() + "overrides: [rollout.vllm_python=/nonexistent/venv/bin/python]\n"
    path.write_text(text)
    with pytest.raises(SystemExit) as err:
        study_mod.main([str(path)])
    msg = str(err.value)
    assert msg.startswith("test study: nothing started: rollout.vllm_python=")
    assert "/nonexistent/venv/bin/python" in msg and "make vllm" in msg
    assert jobs() == [] and not (out / "_shared").exists()


def test_a_redone_shared_start_must_match_the_recorded_one(study, monkeypatch, capsys):
    """A new machine redoes the shared stages (their weights are not committed): the study
    fingerprints each one when it finishes, records the fingerprint, and refuses to start cells
    from a redone stage whose figures differ from the recorded one."""
    path, out, jobs = study
    monkeypatch.setenv("FAKE_SFT_SECONDS", "0.3")
    assert study_mod.main([str(path), "--only", "sao/seed0,grpo/seed0"]) == 0
    st = study_mod.load_study(path)
    shared = Path(st.records) / "_shared"
    sft = json.loads((shared / "sft.json").read_text())
    vp = json.loads((shared / "value_pretrain.json").read_text())
    assert (sft["stage"], sft["steps"], sft["last"]) == ("sft", 2, {"sft/loss": 0.5})
    assert vp["last"] == {"value_pretrain/explained_variance": 0.125}  # not the clock
    assert len(sft["digest"]) == 64 and sft["digest"] != vp["digest"]
    # what redoing it costs (its attempts' seconds, summed from the stage's cell.json)
    attempts = json.loads((out / "_shared" / "sft" / "cell.json").read_text())["attempts"]
    assert sft["wall_s"] == round(sum(a["wall_s"] for a in attempts), 1) >= 0.3
    assert "recorded the shared sft's fingerprint" in capsys.readouterr().out
    # each cell says which start it came from: GRPO has no critic, so the SFT only
    rec = Path(st.records)
    said = json.loads((rec / "sao" / "seed0" / "shared_start.json").read_text())
    assert {k: v["digest"] for k, v in said.items()} == {
        "sft": sft["digest"],
        "value_pretrain": vp["digest"],
    }
    said = json.loads((rec / "grpo" / "seed0" / "shared_start.json").read_text())
    assert list(said) == ["sft"]
    cells = study_mod.cells(st)
    text = study_mod.report_text(st, [study_mod.figures(c) for c in cells], None)
    assert f"SFT `{sft['digest'][:12]}` (2 steps" in text and "2 finished cell(s) from it" in text
    assert f"value pre-training `{vp['digest'][:12]}`" in text
    assert "1 finished cell(s) from it" in text  # sao/seed0: grpo has no value pre-training

    import shutil

    shutil.rmtree(out)  # a new machine, the same kernels: the same start, the study goes on
    plan = study_mod.plan_text(st, cells).splitlines()  # priced at the recorded start's time
    assert f"~{sft['wall_s'] / 60:.0f} min (the recorded start's); must match" in plan[0]
    assert "min of shared stages" in plan[-1]
    older = {k: v for k, v in sft.items() if k != "wall_s"}  # a record that predates wall_s
    (shared / "sft.json").write_text(json.dumps(older, indent=1) + "\n")
    assert study_mod.main([str(path), "--only", "sao/seed1"]) == 0
    filled = json.loads((shared / "sft.json").read_text())  # the match gives it the new time
    assert filled["digest"] == sft["digest"] and filled["wall_s"] >= 0.3
    assert "recorded the shared sft's time" in capsys.readouterr().out
    sft = filled
    said = json.loads((rec / "sao" / "seed1" / "shared_start.json").read_text())
    assert said["sft"]["digest"] == sft["digest"]

    shutil.rmtree(out)  # another machine whose SFT comes out different
    monkeypatch.setenv("FAKE_SFT_LOSS", "0.9")
    n = len(jobs())
    with pytest.raises(RuntimeError) as err:
        study_mod.main([str(path), "--only", "grpo/seed1"])
    msg = str(err.value)
    assert "is not the start recorded in" in msg and "sft/loss 0.5 -> 0.45" in msg
    assert "grpo/seed0, sao/seed0, sao/seed1" in msg and f"git rm -r {shared / 'sft.json'}" in msg
    assert [j["stages"] for j in jobs()[n:]] == ["[sft]"]  # no cell started from it
    assert json.loads((shared / "sft.json").read_text()) == sft  # the record is untouched


def test_a_cell_finished_before_starts_were_fingerprinted_gets_its_start_inferred(study):
    path, out, _ = study
    assert study_mod.main([str(path), "--only", "grpo/seed0"]) == 0
    st = study_mod.load_study(path)
    cell = next(c for c in study_mod.cells(st) if c.name == "grpo/seed0")
    said = (cell.run_dir / "shared_start.json").read_text()
    (cell.run_dir / "shared_start.json").unlink()  # as an older runner left it
    study_mod.infer_shared_start(st, cell)  # begun after the SFT finished here: certain
    assert (cell.run_dir / "shared_start.json").read_text() == said
    (cell.run_dir / "shared_start.json").unlink()
    record = json.loads((cell.run_dir / "cell.json").read_text())
    record["attempts"][0]["start_utc"] = "2000-01-01 00:00:00"  # began before it: not certain
    (cell.run_dir / "cell.json").write_text(json.dumps(record))
    study_mod.infer_shared_start(st, cell)
    assert not (cell.run_dir / "shared_start.json").exists()
