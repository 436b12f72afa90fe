"""Where a rollout's outcome comes from: the real sandbox for anchor groups, the frozen world model otherwise.

One `RewardRouter` per step answers both questions the loop asks about a
program, with the same routing:

* `feedback(rows, solutions)` -- between turns, what the agent reads next:
  the sandbox's feedback for rows of anchor groups, the world model's
  prediction for the others (the world model is asked only for those);
* `score(episodes)` -- after the last turn, the rewards `correct_step` takes:
  the anchor groups' programs go to the sandbox pool *first*, and while they
  run (other processes) the world model scores every rollout, anchors
  included (their (world model, real) pairs feed the debiaser). Both are
  timed and their overlap is reported.

An outcome nobody could grade (a sandbox failure, an unparseable prediction)
is ungraded: `graded` False, never a reward of 0.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np

from wmrl_jax import world_model

UNKNOWN_FEEDBACK = "The outcome of the program is unknown."   # a world-model answer with no usable feedback


@dataclasses.dataclass
class Scores:
    """One step's rollout scores, [N, G], as `correct_step` takes them."""

    wm_rewards: np.ndarray
    wm_graded: np.ndarray
    real_rewards: np.ndarray
    real_graded: np.ndarray
    is_anchor: np.ndarray
    real_results: dict          # (group, rollout) -> ExecutionResult (or the exception the sandbox raised)
    wm_predictions: list        # flat, or [] when the world model was not asked
    times: dict                 # wm_s, sandbox_s, overlap_s


@dataclasses.dataclass
class RewardRouter:
    """Routes one step's programs: rows of anchor groups to `pool`, the rest to the world model `lm`.

    Row i of a step is rollout i % group_size of task i // group_size.
    `use_wm` False (the `real` arm, where every group is an anchor) never asks
    the world model.
    """

    tasks: Sequence
    group_size: int
    anchors: np.ndarray          # indices of the anchor groups
    pool: object                 # a sandbox.SandboxPool (or multihost.ProcessZeroPool)
    lm: object                   # the frozen world model (a chat.ChatModel)
    wm_config: world_model.WorldModelConfig
    use_wm: bool
    feedback_seed: int           # SeedStream.WM_FEEDBACK of this step
    scoring_seed: int            # SeedStream.WM_SCORING of this step

    def __post_init__(self):
        self.is_anchor = np.zeros(len(self.tasks), bool)
        self.is_anchor[np.asarray(self.anchors, int)] = True

    def task_of(self, row: int):
        return self.tasks[row // self.group_size]

    def is_real(self, row: int) -> bool:
        return bool(self.is_anchor[row // self.group_size])

    def feedback(self, rows: Sequence[int], solutions: Sequence[str | None]) -> list[str]:
        """The feedback each of `rows` reads next turn (`solutions` is indexed by row)."""
        real = [i for i in rows if self.is_real(i)]
        out = {}
        if real:
            results = self.pool.map([(self.task_of(i), solutions[i] or "") for i in real])
            out.update({i: r.feedback for i, r in zip(real, results)})
        rest = [i for i in rows if i not in out]
        if rest:
            preds = world_model.predict(self.lm, [self.task_of(i) for i in rest], [solutions[i] for i in rest],
                                        config=self.wm_config, seed=self.feedback_seed)
            out.update({i: p.feedback or UNKNOWN_FEEDBACK for i, p in zip(rest, preds)})
        return [out[i] for i in rows]

    def score(self, episodes: Sequence) -> Scores:
        """Real runs of the anchor groups' final programs (submitted first), overlapped with world-model scoring."""
        group_size = self.group_size
        t0 = time.perf_counter()
        futures, finished_at = {}, []
        for i, e in enumerate(episodes):
            if self.is_real(i):
                key = divmod(i, group_size)
                futures[key] = self.pool.submit(self.task_of(i), e.solution if e.solution is not None else "")
                futures[key].add_done_callback(lambda _: finished_at.append(time.perf_counter()))
        t_wm0 = time.perf_counter()
        preds = []
        if self.use_wm:
            preds = world_model.predict(self.lm, [self.task_of(i) for i in range(len(episodes))],
                                        [e.solution for e in episodes], config=self.wm_config,
                                        seed=self.scoring_seed)
        t_wm1 = time.perf_counter()
        real_results = {}
        for key, fut in futures.items():
            try:
                real_results[key] = fut.result()
            except Exception as exc:   # the sandbox itself broke: this rollout is ungraded, the run goes on
                real_results[key] = exc
        t_real_done = max(finished_at, default=t0)   # when the last sandbox finished, not when we looked
        shape = (len(self.tasks), group_size)
        wm_r, wm_g = np.zeros(shape, np.float32), np.zeros(shape, bool)
        real_r, real_g = np.zeros(shape, np.float32), np.zeros(shape, bool)
        for i, p in enumerate(preds):
            if p.reward is not None:
                wm_r[divmod(i, group_size)], wm_g[divmod(i, group_size)] = p.reward, True
        for key, r in real_results.items():
            reward = getattr(r, "reward", None)
            if reward is not None:
                real_r[key], real_g[key] = reward, True
        overlap = max(0.0, min(t_wm1, t_real_done) - max(t_wm0, t0)) if futures and self.use_wm else 0.0
        times = {"wm_s": t_wm1 - t_wm0, "sandbox_s": (t_real_done - t0) if futures else 0.0, "overlap_s": overlap}
        return Scores(wm_r, wm_g, real_r, real_g, self.is_anchor.copy(), real_results, preds, times)


__all__ = ["RewardRouter", "Scores", "UNKNOWN_FEEDBACK"]
