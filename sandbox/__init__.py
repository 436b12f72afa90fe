"""Host-side sandbox: isolated execution, grading, task formats. No JAX here.

Public API (the contract other modules use):

    task = load_task("path/to/competition")            # MLE-Dojo or DSBench layout
    result = run_solution(task, code, timeout_s=600)    # -> ExecutionResult (status, reward, feedback, ...)
    pool = SandboxPool(workers=4)                       # concurrent runs, cache, counters
    pool = make_pool("ray", ray_address="auto")         # the same, each run a Ray task (sandbox.ray_pool)
    position_score(score, task.leaderboards, task.higher_is_better)
    avg_at_k({task_id: [attempt, ...]}, categories)     # the paper's avg@8

Rewards follow the ladder of docs/design.md, "Reward ladder" (REWARD_LADDER);
"unknown" (infrastructure failure) has reward None, never 0.
"""

from sandbox.grading import (
    REWARD_LADDER,
    REWARD_MALFORMED,
    REWARD_RAN_NO_SUB,
    REWARD_RUNTIME_ERR,
    REWARD_SYNTAX_ERR,
    REWARD_VALID_BASE,
    REWARD_VALID_SPAN,
    STATUSES,
    grade_submission,
    ladder_reward,
)
from sandbox.backends import BACKENDS, make_pool
from sandbox.isolation import Limits
from sandbox.pool import SandboxPool
from sandbox.ray_pool import RayPool   # imports Ray only when a RayPool is made (the [ray] extra)
from sandbox.runner import ExecutionResult, extract_code, run_solution
from sandbox.scoring import AvgAtK, avg_at_k, board_position, position_score
from sandbox.tasks import Task, TaskFormatError, load_task

__all__ = [
    "AvgAtK", "ExecutionResult", "Limits", "REWARD_LADDER", "REWARD_MALFORMED", "REWARD_RAN_NO_SUB",
    "REWARD_RUNTIME_ERR", "REWARD_SYNTAX_ERR", "REWARD_VALID_BASE", "REWARD_VALID_SPAN", "STATUSES",
    "BACKENDS", "RayPool", "SandboxPool", "Task", "TaskFormatError", "avg_at_k", "board_position", "extract_code",
    "grade_submission", "ladder_reward", "load_task", "make_pool", "position_score", "run_solution",
]

