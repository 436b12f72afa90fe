"""`Episode`: one recorded LIBERO rollout, saveable as a compressed `.npz`.

The contract the rest of the project relies on (as for the sandbox's
"unknown" executions): an episode whose outcome could not be established (its
simulator process crashed, hung or raised) has status "unknown", `success`
None and a `reason`; it is excluded from success rates, never counted as a
failure.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import numpy as np

STATUSES = ("running", "success", "failure", "unknown")


@dataclasses.dataclass
class Episode:
    """One rollout from a benchmark initial state.

    status: "success" (the task's goal predicates held), "failure" (max_steps policy steps without
      success), "unknown" (no outcome: see `reason`), or "running".
    steps: policy steps executed (the settle steps after reset are not counted).
    actions: float32 [steps, 7] as executed (delta end-effector pose + gripper, see docs/vla.md).
    proprio: float32 [steps + 1, 8] before each action and after the last: end-effector position (m, 3),
      orientation as an axis-angle vector (rad, 3), the two gripper finger positions (m, 2).
    frames: camera name -> uint8 [F, H, W, 3], upright; frame f shows the scene at step frame_steps[f].
    frame_steps: int32 [F].
    wall_s: seconds from the start of the reset to the episode's end, as seen by the simulator process.
    """

    suite: str
    task_id: int
    task_name: str
    instruction: str
    init_state_index: int
    status: str = "running"
    reason: str = ""
    steps: int = 0
    wall_s: float = 0.0
    actions: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 7), np.float32))
    proprio: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 8), np.float32))
    frames: dict = dataclasses.field(default_factory=dict)
    frame_steps: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0,), np.int32))

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"Episode.status {self.status!r}: expected one of {STATUSES}")

    @property
    def success(self) -> bool | None:
        """True / False for a finished episode; None while running or when the outcome is unknown."""
        return {"success": True, "failure": False}.get(self.status)

    def save(self, path) -> pathlib.Path:
        """Write a compressed `.npz` (the suffix is added when missing); returns the path written.

        Atomic: written beside `path` under a temporary name, then renamed onto it, so an interrupted save
        leaves no half-written episode."""
        path = pathlib.Path(path)
        if path.suffix != ".npz":
            path = path.with_name(path.name + ".npz")
        meta = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("actions", "proprio", "frames", "frame_steps")}
        arrays = {"actions": self.actions, "proprio": self.proprio, "frame_steps": self.frame_steps,
                  **{f"frames/{cam}": v for cam, v in self.frames.items()}}
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")
        try:
            np.savez_compressed(tmp, meta=np.array(json.dumps(meta)), **arrays)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    @classmethod
    def load(cls, path) -> "Episode":
        with np.load(pathlib.Path(path), allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            frames = {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith("frames/")}
            return cls(**meta, actions=z["actions"], proprio=z["proprio"], frames=frames,
                       frame_steps=z["frame_steps"])

    def __repr__(self) -> str:
        frames = ", ".join(f"{cam} {v.shape[0]}x{v.shape[1]}x{v.shape[2]}" for cam, v in self.frames.items())
        reason = f", reason={self.reason!r}" if self.reason else ""
        return (f"Episode({self.suite}[{self.task_id}] init {self.init_state_index}, status={self.status!r}, "
                f"steps={self.steps}, wall_s={self.wall_s:.1f}, frames=[{frames}]{reason})")


def success_rate(episodes) -> tuple[float | None, int, int]:
    """(success rate over episodes with a known outcome or None if there are none, n known, n unknown).

    Unknown and still-running episodes are excluded, never counted as failures."""
    known = [e.success for e in episodes if e.success is not None]
    unknown = sum(e.status == "unknown" for e in episodes)
    return (float(np.mean(known)) if known else None), len(known), unknown
