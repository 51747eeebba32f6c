"""Plan a job before it queues: layout rules and per-rank memory on a target cluster.

`sao-plan` (sao_megatron/cli/plan.py) loads a config as `sao-train` does and calls
`make_plan`; nothing here builds a model or touches torch.distributed.
"""

from sao_megatron.plan.layout import ClusterTarget, check_layout
from sao_megatron.plan.report import Plan, format_plan, make_plan, plan_json

__all__ = ["ClusterTarget", "Plan", "check_layout", "format_plan", "make_plan", "plan_json"]
