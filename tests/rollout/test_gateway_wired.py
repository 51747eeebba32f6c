"""The wired RolloutManager runs agent environments itself (the `run_episode` hook) and reports
`episodes/<status>` counts; failed agents never reach a batch."""

from sao_megatron.rollout.gateway import AgentEnvironment
from sao_megatron.rollout.manager import RolloutManager, agent_tasks
from tests.rollout.fakes import FakeEngineClient
from tests.rollout.test_gateway import calc, formatter, smollm2_tok_dir  # noqa: F401 (fixtures)


def test_manager_runs_agents_and_counts_statuses(
    formatter,  # noqa: F811 (the imported fixture)
    one_fake_engine,
    tmp_path,
):
    async def flaky(task, client):
        if task["seed"] % 3 == 0:
            raise RuntimeError("agent crashed")
        return await calc.run(task, client)

    def make_task(seed):
        return {**calc.make_task(seed), "seed": seed}

    cfg = one_fake_engine(max_concurrent_episodes=4, request_timeout_s=5.0, step_timeout_s=5.0)
    tasks = agent_tasks("calc", lambda: AgentEnvironment(flaky, make_task))
    with RolloutManager(
        cfg, formatter, tasks, client_factory=FakeEngineClient, run_dir=tmp_path
    ) as m:
        batch = m.get_batch(train_version=0, timeout=300)
        stats = m.stats()
    assert len(batch) == 4
    assert all(t.status == "completed" and int(t.task_id.rsplit(":", 1)[1]) % 3 for t in batch)
    for t in batch:
        assert t.nodes[0].action_token_ids[-1] == formatter.end_of_turn_id
        t.validate()
    assert stats["rollout/failed_groups"] >= 1
    assert stats["episodes/agent_error"] >= 1 and stats["episodes/completed"] >= 4
    assert stats["episodes/engine_error"] == stats["episodes/timeout"] == 0
