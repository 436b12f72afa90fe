"""A scripted expert for LIBERO tasks from privileged simulator state (issue #30), no JAX import.

The benchmark ships no demonstrations, so the VLA's supervised start needs a
generator. This one reads what a policy never sees: the task's parsed BDDL
goal (`env.env.parsed_problem["goal_state"]`), object poses and collision
geometry from MuJoCo, and the goal predicates themselves. It drives the
robot through the benchmark's own OSC_POSE controller with the 7-d actions a
policy emits (delta position, delta rotation, gripper), so a recorded
sequence replays through `SimPool` as a policy's would.

* `plan(goal)` (`task_goal(bddl_file)` reads a task's goal): the goal's
  predicates -> an ordered list of `Skill`s ("pick_place" for In / On,
  "open", "close", "turn_on"); pure, no simulator.
* `Expert(env).run(init_state)`: resets like `SimPool`'s worker (initial
  state, then the settle steps), executes the plan and returns an
  `ExpertResult` (success, actions as float32 [T, 7], where it failed).

Grasps come from the object's collision geoms (`simulator/scene.py`,
`choose_grasp`): across the narrower side of what the open gripper spans,
by the wall of a cup or bowl, by the handle of a solid object that has one.
Placing carries the object (not the hand) over the target and lowers it
until it rests before opening. `turn_on` twists a knob's fin; `close`
pushes a drawer or door along its joint. docs/vla.md ("Scripted expert
demonstrations") has the details and the measured success per task.

Deterministic given (task, initial state): the env is seeded as the worker
seeds it, every action is cast to float32 before it is stepped (as the pool
sends actions), and no decision reads a clock or a random number.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# The settle steps after an initial state is set, and their no-op action, as the pool's worker runs them.
from simulator._worker import SETTLE_ACTION
from simulator.pool import SETTLE_STEPS
from simulator.scene import FINGER_BELOW_EEF, Grasp, Scene, axis_angle, choose_grasp, quat_to_matrix, rotvec

OPEN, CLOSE = -1.0, 1.0
GAIN_POS = 12.0        # action per metre of error: the cap (1.0, ~1.1 cm per step) from ~8 cm away
GAIN_ROT = 2.0         # action per radian of orientation error (1.0 asks for 0.5 rad)
FULL_OPENING = 0.08     # m: between the open fingers
# One policy step of "close" moves the fingers 1 cm closer together (robosuite's Panda gripper: 0.01 of its
# [-1, 1] command per 500 Hz substep, 25 substeps per step); action 0 holds them where they are.
CLOSE_PER_STEP = 0.01
PRESHAPE_MARGIN = 0.015 # m: fingers opened this much wider than what they take (neighbours stay untouched)
# Leaning the hand: none up to TILT_FROM metres (horizontal) from the shoulder, MAX_TILT_DEG from
# TILT_FROM + TILT_RAMP on (the Panda's elbow straightens at ~0.6 m for objects on the table).
MAX_TILT_DEG, TILT_FROM, TILT_RAMP = 40.0, 0.5, 0.15
CLEARANCE = 0.05        # m: the carried object's bottom clears obstacles on its path by this much
PUSH_STANDOFF = 0.05    # m: the hand comes down this far before the face it pushes
PUSH_BUDGET = 120       # steps of pushing a drawer or door shut
PUSH_LEAN_DEG = 30.0    # the hand leans this much into a push
PUSH_LEAD = 0.1         # m: the push servoes this far past the contact point (full speed)
STALL_STEPS = 8         # a phase ends when the hand moved < 2 mm over this many steps


@dataclasses.dataclass(frozen=True)
class Skill:
    """One step of a plan. kind: "pick_place" (obj into / onto target, relation "in" or "on"), "open",
    "close", "turn_on" (obj: the region or fixture acted on; target and relation empty)."""

    kind: str
    obj: str
    target: str = ""
    relation: str = ""

    def __str__(self) -> str:
        return f"{self.kind}({self.obj}{', ' + self.relation + ' ' + self.target if self.target else ''})"


@dataclasses.dataclass
class ExpertResult:
    """success: the task's goal held; steps: policy steps (settle steps not counted); actions: float32
    [steps, 7] as stepped; failed_at: the skill and phase that ran out of steps or could not start ("" on
    success); log: one line per finished phase."""

    success: bool
    steps: int
    actions: np.ndarray
    failed_at: str = ""
    log: list = dataclasses.field(default_factory=list)


def plan(goal) -> list[Skill]:
    """The goal's predicates (lists such as ["in", "akita_black_bowl_1", "white_cabinet_1_bottom_region"],
    any case) -> skills in execution order.

    Order: a container that must end closed and receive an object is opened first and closed last; a
    fixture to turn on is turned on first (before a pot placed on the stove can block its knob); objects
    are placed in the goal's order.
    """
    goal = [tuple(str(a) for a in g) for g in goal]
    places, closes, opens, turn_ons = [], [], [], []
    for g in goal:
        pred = g[0].lower()
        if pred in ("in", "on") and len(g) == 3:
            places.append(Skill("pick_place", g[1], g[2], pred))
        elif pred == "close" and len(g) == 2:
            closes.append(g[1])
        elif pred == "open" and len(g) == 2:
            opens.append(Skill("open", g[1]))
        elif pred == "turnon" and len(g) == 2:
            turn_ons.append(Skill("turn_on", g[1]))
        else:
            raise ValueError(f"goal predicate {g!r}: the expert handles In, On (binary) and Open, Close, "
                             f"TurnOn (unary)")
    # A closed goal container that receives an object: open it, fill it, close it. "microwave_1" receives
    # objects through its "microwave_1_heating_region"; "white_cabinet_1_bottom_region" is itself the target.
    filled = [c for c in closes if any(p.target == c or p.target.startswith(c + "_") for p in places)]
    return ([Skill("open", c) for c in filled] + opens + turn_ons + places
            + [Skill("close", c) for c in closes])


def task_goal(bddl_file: str) -> list:
    """The goal predicates of a task's BDDL file, as the env parses them (no scene is built)."""
    from libero.libero.envs.bddl_utils import robosuite_parse_problem

    return robosuite_parse_problem(bddl_file)["goal_state"]


def physics_env(bddl_file: str, max_steps: int = 520):
    """The benchmark's env without renderer or cameras (~10x the steps/s), built and seeded as
    `SimPool`'s worker builds its env, so a sequence found here replays there."""
    from libero.libero.envs.env_wrapper import ControlEnv

    env = ControlEnv(bddl_file_name=bddl_file, horizon=SETTLE_STEPS + max_steps + 10, ignore_done=True,
                     use_camera_obs=False, has_offscreen_renderer=False)
    env.seed(0)
    return env


# ---------------------------------------------------------------------------------------- execution
class _Stop(Exception):
    """The episode ends here: the task succeeded, or the step budget ran out."""


class Expert:
    """Runs `plan(goal)` in one env. `env`: a LIBERO env built with ignore_done=True (`ControlEnv` without
    cameras for the search, any env for checks); max_steps: the policy-step budget (LIBERO-Long: 520)."""

    def __init__(self, env, max_steps: int = 520, seed: int = 0):
        self.env, self.max_steps, self.seed = env, max_steps, seed
        self.scene = Scene(env)

    # -------------------------------------------------------------- episode
    def run(self, init_state) -> ExpertResult:
        self.env.seed(self.seed)   # as the pool's worker does before every reset: the start is the state's alone
        self.env.reset()
        self.obs = self.env.set_init_state(np.asarray(init_state))
        for _ in range(SETTLE_STEPS):
            self.obs, _, _, _ = self.env.step(SETTLE_ACTION)
        self.actions, self.log, self.phase = [], [], "start"
        self.r_down = quat_to_matrix(self.obs["robot0_eef_quat"])   # the initial, pointing-down hand
        self.yaw0 = float(np.arctan2(*self.scene.finger_axis()[1::-1]))
        self.shoulder = self.scene.sim.data.get_body_xpos("robot0_link2").copy()
        self.r_goal = self.r_down   # the hand orientation every action servos to
        skills = plan(self.scene.goal)
        self.skills = skills
        try:
            for skill in skills:
                self.phase = str(skill)
                getattr(self, "_" + skill.kind)(skill)
            self._idle()
        except _Stop:
            pass
        success = bool(self.env.check_success())
        return ExpertResult(success=success, steps=len(self.actions),
                            actions=np.asarray(self.actions, np.float32).reshape(-1, 7),
                            failed_at="" if success else self.phase, log=self.log)

    def _step(self, action) -> None:
        a = np.asarray(action, np.float32)   # as SimPool sends it: the replay steps the same float64 values
        self.obs, _, _, _ = self.env.step(a.astype(np.float64))
        self.actions.append(a)
        if self.env.check_success() or len(self.actions) >= self.max_steps:
            if len(self.actions) >= self.max_steps:
                self.phase += " (step budget)"
            raise _Stop

    def _idle(self) -> None:
        """Nothing left to do but the goal does not hold yet: wait, hand open, until the budget ends."""
        self.phase += " -> every skill done, goal not met"
        while True:
            self._step([0, 0, 0, 0, 0, 0, OPEN])

    # -------------------------------------------------------------- motion primitives
    @property
    def eef(self) -> np.ndarray:
        return np.asarray(self.obs["robot0_eef_pos"], np.float64)

    def _action(self, target, gripper: float) -> np.ndarray:
        a = np.zeros(7)
        a[:3] = np.clip(GAIN_POS * (np.asarray(target) - self.eef), -1, 1)
        a[3:6] = np.clip(GAIN_ROT * rotvec(self.r_goal @ quat_to_matrix(self.obs["robot0_eef_quat"]).T), -1, 1)
        a[6] = gripper
        return a

    def _move(self, name: str, target_fn, gripper: float, tol: float, budget: int) -> bool:
        """Servo the grip site to target_fn() (re-read each step) until within tol metres; False if the
        phase's budget ran out first or the hand stalled (moved < 2 mm in 8 steps: blocked, or at the
        arm's reach)."""
        trail = []
        for _ in range(budget):
            target = target_fn()
            if np.linalg.norm(target - self.eef) < tol:
                self.log.append(f"{self.phase}: {name} ({len(self.actions)})")
                return True
            trail.append(self.eef)
            if len(trail) > STALL_STEPS and np.linalg.norm(trail[-1] - trail[-1 - STALL_STEPS]) < 0.002:
                self.log.append(f"{self.phase}: {name} stalled {np.linalg.norm(target - self.eef) * 100:.1f} cm "
                                f"short ({len(self.actions)})")
                return False
            self._step(self._action(target, gripper))
        self.log.append(f"{self.phase}: {name} budget ({len(self.actions)})")
        return False

    def _hold(self, gripper: float, steps: int) -> None:
        target = self.eef.copy()
        for _ in range(steps):
            self._step(self._action(target, gripper))

    def _orient(self, finger_yaw: float, point) -> None:
        """Hand pointing down, yawed so the fingers close along world direction finger_yaw (the smaller
        turn from the start, either way round), and leaned forward about that direction when `point` is
        far from the shoulder: the stretched arm then reaches low objects it could not reach upright."""
        yaw = (finger_yaw - self.yaw0 + np.pi / 2) % np.pi - np.pi / 2
        r = axis_angle([0, 0, 1], yaw) @ self.r_down
        reach = np.linalg.norm(np.asarray(point)[:2] - self.shoulder[:2])
        tilt = np.deg2rad(MAX_TILT_DEG) * np.clip((reach - TILT_FROM) / TILT_RAMP, 0.0, 1.0)
        if tilt > 0:
            u = np.array([np.cos(finger_yaw), np.sin(finger_yaw), 0.0])
            out = np.r_[np.asarray(point)[:2] - self.shoulder[:2], 0.0]
            # the sign that swings the fingertips (the hand frame's z axis) away from the shoulder
            approach = r[:, 2]
            sign = 1.0 if (axis_angle(u, tilt) @ approach) @ out > (axis_angle(u, -tilt) @ approach) @ out else -1.0
            r = axis_angle(u, sign * tilt) @ r
        self.r_goal = r

    def _lower_until_rest(self, gripper: float, speed: float = 0.5, budget: int = 80) -> None:
        """Move straight down at `speed` (action units, ~0.5 cm per step at 0.5) until the hand stops
        descending: what it holds, or its fingers, rest on something."""
        still, xy = 0, self.eef[:2].copy()
        for _ in range(budget):
            z = self.eef[2]
            a = self._action(np.r_[xy, z], gripper)
            a[2] = -speed
            self._step(a)
            still = still + 1 if z - self.eef[2] < 0.001 else 0
            if still >= 2:
                break
        self.log.append(f"{self.phase}: rested ({len(self.actions)})")

    # -------------------------------------------------------------- skills
    def _carry_height(self, start_xy, end_xy, held: str | None, skip=()) -> float:
        """Grip-site z at which the held object (or the bare fingers) clears everything near the straight
        path from start_xy to end_xy."""
        s = self.scene
        # how far the held object (or the fingertips) hangs below the grip site
        drop = self.eef[2] - s.extent(held)[0][2] if held is not None else FINGER_BELOW_EEF
        top = -np.inf
        seg = np.asarray(end_xy) - np.asarray(start_xy)
        for name in s.objects():
            if name == held or name in skip:
                continue
            lo, hi = s.extent(name)
            if hi[2] - lo[2] > 0.5:   # the table, a wall: not an obstacle to go over
                continue
            centre = (lo[:2] + hi[:2]) / 2
            t = np.clip((centre - start_xy) @ seg / max(seg @ seg, 1e-9), 0, 1)
            radius = np.linalg.norm(hi[:2] - lo[:2]) / 2
            if np.linalg.norm(start_xy + t * seg - centre) < radius + 0.08:
                top = max(top, hi[2])
        table = min(s.extent(n)[0][2] for n in s.objects())
        return max(top, table + 0.12) + CLEARANCE + drop

    def _pick_place(self, skill: Skill) -> None:
        s, obj = self.scene, skill.obj
        grasp = choose_grasp(s, obj, self.shoulder[:2])
        self.log.append(f"{self.phase}: grasp {grasp.kind}")
        goal = [skill.relation, obj, skill.target]
        grasp_at = lambda: s.pos(obj) + grasp.offset   # noqa: E731
        self._orient(grasp.finger_yaw, grasp_at())
        hover = self._carry_height(self.eef[:2], grasp_at()[:2], None, skip=(obj,))
        hover = max(hover, grasp_at()[2] + 0.08)
        self._move("up", lambda: np.r_[self.eef[:2], hover], OPEN, 0.02, 60)
        # pre-shape: close the open fingers to the object's width plus a margin, then hold them (action 0)
        preshape = int(round((FULL_OPENING - grasp.width - PRESHAPE_MARGIN) / CLOSE_PER_STEP))
        if preshape > 0:
            self._move("preshape", lambda: np.r_[grasp_at()[:2], hover], CLOSE, 0.0, preshape)
        hand = 0.0 if preshape > 0 else OPEN
        self._move("above", lambda: np.r_[grasp_at()[:2], hover], hand, 0.01, 100)
        self._move("down", grasp_at, hand, 0.006, 80)
        self._hold(CLOSE, 15)
        # lift straight up, then carry the object's origin over the target
        spot = self._spot(skill)
        target = s.pos(skill.target) + spot
        carry = self._carry_height(self.eef[:2], target[:2], obj, skip=(skill.target,))
        self._move("lift", lambda: np.r_[self.eef[:2], carry], CLOSE, 0.02, 80)
        self.log.append(f"{self.phase}: lifted to object z {s.pos(obj)[2]:.3f}")
        slot = self._slot_axis(skill, grasp)
        if slot is not None:   # a narrow region (the caddy's compartments): the object's length along it
            self._orient(slot + np.pi / 2, target)
        over = lambda: np.r_[(s.pos(skill.target) + spot)[:2] + (self.eef - s.pos(obj))[:2], carry]   # noqa: E731
        self._move("carry", over, CLOSE, 0.01, 140)
        self._lower_until_rest(CLOSE)
        self._hold(OPEN, 12)
        self._move("retreat", lambda: np.r_[self.eef[:2], carry], OPEN, 0.03, 40)
        if not s.holds(goal):
            self.log.append(f"{self.phase}: placed but {goal} does not hold")

    def _spot(self, skill: Skill) -> np.ndarray:
        """Where in an "on" target region this object goes, from the region's centre (world, [3]): objects
        sharing a region (task 8's two moka pots on the stove) are set side by side along the world axis
        they are narrower along, so that each origin ends inside the region."""
        s = self.scene
        mates = [k for k in self.skills if k.kind == "pick_place" and k.relation == "on" and k.target == skill.target]
        region = s.inner.object_sites_dict.get(skill.target)
        if len(mates) < 2 or region is None or not hasattr(region, "size"):
            return np.zeros(3)
        lo, hi = s.extent(skill.obj)
        axis = int(np.argmin((hi - lo)[:2]))
        half = np.abs(np.asarray(region.size, np.float64))[axis]
        spacing = min((hi - lo)[axis] + 0.01, 2 * (half - 0.01) / (len(mates) - 1))   # apart, origins inside
        spot = np.zeros(3)
        spot[axis] = (mates.index(skill) - (len(mates) - 1) / 2) * spacing
        return spot

    def _slot_axis(self, skill: Skill, grasp: Grasp) -> float | None:
        """World yaw of the long side of an "in" target region narrower than the held object is long, else
        None. Regions are boxes aligned with the world axes when they are checked (`in_box`)."""
        region = self.scene.inner.object_sites_dict.get(skill.target)
        if skill.relation != "in" or region is None or not hasattr(region, "size"):
            return None
        half = np.abs(self.scene.sim.data.get_site_xmat(skill.target) @ np.asarray(region.size))
        if 2 * min(half[:2]) >= grasp.length:
            return None
        return 0.0 if half[0] > half[1] else np.pi / 2

    def _turn_on(self, skill: Skill) -> None:
        """Grip the knob's fin from above and twist the hand about the knob's hinge until the benchmark
        says the fixture is on (the stove: hinge joint at >= 0.5 rad)."""
        s, goal = self.scene, ["turnon", skill.obj]
        if s.holds(goal):
            return
        joint = s.inner.get_object(skill.obj).joints[0]
        jid = s.sim.model.joint_name2id(joint)
        body = int(s.model.jnt_bodyid[jid])
        geoms = [g for g in s._geoms[skill.obj] if s.model.geom_bodyid[g] == body]
        centres, halves = [], []
        r_k, p_k = s.data.xmat[body].reshape(3, 3), s.data.xpos[body]
        for g in geoms:   # the knob's geoms in the knob's frame
            r_g = s.data.geom_xmat[g].reshape(3, 3)
            centres.append(r_k.T @ (s.data.geom_xpos[g] + r_g @ s.model.geom_aabb[g][:3] - p_k))
            halves.append(np.abs(r_k.T @ r_g) @ s.model.geom_aabb[g][3:])
        c, h = np.array(centres), np.array(halves)
        top = (c + h)[:, 2].max()
        fin = (c + h)[:, 2] > top - 0.02   # the grip fin stands above the dial
        lo, hi = (c - h)[fin].min(0), (c + h)[fin].max(0)
        narrow = int(np.argmin((hi - lo)[:2]))
        grip = p_k + r_k @ np.r_[((lo + hi) / 2)[:2], top - 0.012]
        self._orient(float(np.arctan2(*r_k[:2, narrow][::-1])), grip)
        up_sign = np.sign(r_k[2] @ s.model.jnt_axis[jid])   # a positive angle turns counter-clockwise from above
        hover = self._carry_height(self.eef[:2], grip[:2], None)
        self._move("up", lambda: np.r_[self.eef[:2], max(hover, self.eef[2])], OPEN, 0.02, 60)
        self._move("above", lambda: np.r_[grip[:2], hover], OPEN, 0.01, 100)
        self._move("down", lambda: grip, OPEN, 0.006, 80)
        self._hold(CLOSE, 10)
        qadr = s.model.jnt_qposadr[jid]
        for _ in range(12):   # ~0.1 rad of hand yaw a step
            if s.holds(goal):
                break
            self.r_goal = axis_angle([0, 0, 1], up_sign * 0.12) @ self.r_goal
            self._hold(CLOSE, 3)
        self.log.append(f"{self.phase}: knob at {s.data.qpos[qadr]:.2f} rad ({len(self.actions)})")
        self._hold(OPEN, 8)
        self._move("retreat", lambda: np.r_[self.eef[:2], hover], OPEN, 0.03, 40)

    def _joint(self, name: str) -> int:
        """The MuJoCo joint id of a region's or fixture's articulation (drawer slide, door hinge)."""
        s = self.scene
        site = s.inner.object_sites_dict.get(name)
        joints = site.joints if site is not None else s.inner.get_object(name).joints
        return s.sim.model.joint_name2id(joints[0])

    def _moving_part(self, jid: int) -> tuple[np.ndarray, np.ndarray]:
        """Where to push a drawer or door so its joint angle grows (towards "closed" in LIBERO's drawers and
        microwave): (contact point, unit push direction), world frame, from the moving body's collision
        geoms: a drawer's front face, or a door's free edge (0.8 of the way from the hinge)."""
        s = self.scene
        body = int(s.model.jnt_bodyid[jid])
        r, x = s.data.xmat[body].reshape(3, 3), s.data.xpos[body]
        axis_w = r @ s.model.jnt_axis[jid]
        geoms = [g for g in range(s.model.ngeom) if s.model.geom_bodyid[g] == body
                 and (s.model.geom_contype[g] or s.model.geom_conaffinity[g])]
        c = np.array([r.T @ (s.data.geom_xpos[g] + s.data.geom_xmat[g].reshape(3, 3) @ s.model.geom_aabb[g][:3] - x)
                      for g in geoms])
        h = np.array([np.abs(r.T @ s.data.geom_xmat[g].reshape(3, 3)) @ s.model.geom_aabb[g][3:] for g in geoms])
        lo, hi = (c - h).min(0), (c + h).max(0)
        centre = (lo + hi) / 2
        if s.model.jnt_type[jid] == 2:   # slide: push the face that leads when closing... from behind it
            push = axis_w / np.linalg.norm(axis_w)
            local = r.T @ push
            k = int(np.argmax(np.abs(local)))
            face = centre.copy()
            face[k] = (lo if local[k] > 0 else hi)[k]   # the face on the side we push from
            return x + r @ face, push
        # hinge: the free edge is the door-frame end farthest from the hinge line
        pivot = s.model.jnt_pos[jid]
        axis = s.model.jnt_axis[jid] / np.linalg.norm(s.model.jnt_axis[jid])
        best = None
        for k in range(3):
            if abs(axis[k]) > 0.5:
                continue
            for end in (lo[k], hi[k]):
                point = centre.copy()
                point[k] = pivot[k] + 0.8 * (end - pivot[k])
                d = point - pivot
                dist = np.linalg.norm(d - (d @ axis) * axis)
                if best is None or dist > best[0]:
                    best = (dist, point)
        p_w = x + r @ best[1]
        tangent = np.cross(axis_w, p_w - (x + r @ pivot))
        return p_w, tangent / np.linalg.norm(tangent)

    def _close(self, skill: Skill) -> None:
        """Push the drawer or door shut with the closed hand, following it as it moves."""
        s, goal = self.scene, ["close", skill.obj]
        if s.holds(goal):
            return
        jid = self._joint(skill.obj)
        point, push = self._moving_part(jid)
        # the palm is long along the finger axis: keep that axis across the push, the palm clear of the front
        self._orient(float(np.arctan2(push[1], push[0])) + np.pi / 2, self.eef)
        # and lean the fingertips into the push: the forearm then stays low and clear of the cabinet's top
        u = np.array([-push[1], push[0], 0.0]) / max(np.linalg.norm(push[:2]), 1e-9)
        lean = [axis_angle(u, a) for a in (np.deg2rad(PUSH_LEAN_DEG), -np.deg2rad(PUSH_LEAN_DEG))]
        self.r_goal = max(lean, key=lambda r: (r @ self.r_goal)[:, 2] @ push) @ self.r_goal
        table = min(s.extent(n)[0][2] for n in s.objects())
        contact_z = max(point[2], table + FINGER_BELOW_EEF + 0.02)
        start = np.r_[(point - PUSH_STANDOFF * push)[:2], contact_z]
        hover = self._carry_height(self.eef[:2], start[:2], None)
        self._hold(CLOSE, 6)
        self._move("up", lambda: np.r_[self.eef[:2], max(hover, self.eef[2])], CLOSE, 0.02, 60)
        self._move("above", lambda: np.r_[start[:2], hover], CLOSE, 0.01, 120)
        self._move("down", lambda: start, CLOSE, 0.008, 80)
        for _ in range(PUSH_BUDGET):
            if s.holds(goal):
                break
            point, push = self._moving_part(jid)
            target = np.r_[(point + PUSH_LEAD * push)[:2], contact_z]
            self._step(self._action(target, CLOSE))
        self.log.append(f"{self.phase}: pushed, joint at {s.data.qpos[s.model.jnt_qposadr[jid]]:.3f} "
                        f"({len(self.actions)})")
        back = np.r_[(self.eef - PUSH_STANDOFF * push)[:2], self.eef[2]]
        self._move("back off", lambda: back, CLOSE, 0.02, 20)

    def _open(self, skill: Skill) -> None:
        if not self.scene.holds(["open", skill.obj]):
            self.phase = f"{skill} (opening is not built yet)"
            raise _Stop
