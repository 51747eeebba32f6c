"""The grouping of tests for pytest-xdist (`tests.conftest.xdist_groups`): tests that share an
engine, the cluster or a whole job run on one worker; the rest go by file."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import SHARED_RESOURCES, xdist_groups

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class FakeItem:
    nodeid: str
    fixturenames: tuple[str, ...]


def test_groups_join_shared_resources_and_split_the_rest_by_file():
    items = [
        FakeItem("tests/a/test_x.py::test_1", ("tmp_path",)),
        FakeItem("tests/a/test_x.py::test_2", ("engine_pool", "tmp_path")),
        FakeItem("tests/b/test_y.py::test_3", ("tiny_sft",)),
        FakeItem("tests/b/test_y.py::test_4", ("tiny_sft", "engine_pool")),  # joins the two
        FakeItem("tests/c/test_z.py::test_5[p0]", ("vllm_servers",)),
        FakeItem("tests/c/test_z.py::test_6", ()),
        FakeItem("tests/d/test_w.py::test_7", ("slurm_cluster",)),
    ]
    got = xdist_groups(items)
    assert got["tests/a/test_x.py::test_1"] == "tests/a/test_x.py"
    pool = got["tests/a/test_x.py::test_2"]
    assert pool in SHARED_RESOURCES
    assert got["tests/b/test_y.py::test_3"] == got["tests/b/test_y.py::test_4"] == pool
    assert got["tests/c/test_z.py::test_5[p0]"] == "vllm_servers"
    assert got["tests/c/test_z.py::test_6"] == "tests/c/test_z.py"
    assert got["tests/d/test_w.py::test_7"] == "slurm_cluster"


def test_a_test_using_two_resources_joins_groups_formed_before_and_after_it():
    items = [
        FakeItem("t1.py::a", ("vllm_servers",)),
        FakeItem("t2.py::b", ("slurm_cluster",)),
        FakeItem("t3.py::c", ("slurm_cluster", "vllm_servers")),
        FakeItem("t4.py::d", ("vllm_servers",)),
        FakeItem("t5.py::e", ("engine_pool",)),
    ]
    got = xdist_groups(items)
    assert got["t1.py::a"] == got["t2.py::b"] == got["t3.py::c"] == got["t4.py::d"]
    assert got["t5.py::e"] == "engine_pool" != got["t1.py::a"]


def test_two_workers_keep_each_group_on_one_worker():
    """`make test`'s flags on two files: each file's tests run on one worker, and the nodeids
    carry the group (pytest-xdist's loadgroup suffix; pytest 9.2 stopped reading the attribute
    xdist 3.8 sets, which split groups silently: setup.py pins pytest below it)."""
    files = ["tests/test_xdist_groups.py", "tests/envs/test_registry.py"]
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup",
         "--no-loadscope-reorder", "-v", "-p", "no:cacheprovider", "-k", "not two_workers",
         *files],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ran = re.findall(r"^\[(gw\d)\] \[ *\d+%\] PASSED (.+)@(\S+)\s*$", p.stdout, flags=re.M)
    assert len(ran) >= 12, p.stdout[-3000:]
    workers: dict[str, set[str]] = {}
    for worker, nodeid, group in ran:
        assert group == nodeid.split("::")[0]  # grouped by file (none uses a shared resource)
        workers.setdefault(group, set()).add(worker)
    assert set(workers) == set(files) and all(len(w) == 1 for w in workers.values()), workers
