"""Host-side LIBERO simulation for the VLA track (issue #30), no JAX import.

Like `sandbox/` for code, this package is the real environment a policy is
scored in: the LIBERO benchmark's tasks (`suites`), simulator processes
stepped in parallel for a batched policy (`pool`), and recorded rollouts
(`episode`). See docs/vla.md.

    import simulator
    with simulator.SimPool("libero_10", workers=2, camera_size=128) as pool:
        episodes = simulator.run_episodes(pool, policy_fn, [(0, 0), (0, 1)])
"""

from simulator.episode import Episode, success_rate
from simulator.pool import SimPool, run_episodes
from simulator.suites import (INSTALL_HINT, LIBERO_SUITES, MAX_STEPS, TaskInfo, get_task, init_state, list_suites,
                              list_tasks, require_benchmark)

__all__ = ["Episode", "INSTALL_HINT", "LIBERO_SUITES", "MAX_STEPS", "SimPool", "TaskInfo", "get_task", "init_state",
           "list_suites", "list_tasks", "require_benchmark", "run_episodes", "success_rate"]
