"""Privileged views of a LIBERO scene for the scripted expert (`simulator/expert.py`), no JAX import.

`Scene` reads what a policy never sees from a benchmark env: object and
region poses, the collision geoms of an object as boxes (world or body
frame), the goal predicates as the benchmark evaluates them. `choose_grasp`
turns an object's geoms into a top-down grasp (where the grip site goes, the
finger axis, the width to close on); the rotation helpers are the small
conversions the servo needs (robosuite's quaternions are (x, y, z, w)).
"""

from __future__ import annotations

import dataclasses

import numpy as np

MAX_OPENING = 0.075    # m: widest part the open Panda fingers (8 cm) close on with some margin
FINGER_BELOW_EEF = 0.015   # m: the fingertips reach this far below the grip site (robot0_eef_pos)


def quat_to_matrix(q) -> np.ndarray:
    """Quaternion (x, y, z, w), robosuite's order -> 3x3 rotation matrix."""
    x, y, z, w = np.asarray(q, np.float64) / np.linalg.norm(q)
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
                     [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
                     [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)]])


def rotvec(m: np.ndarray) -> np.ndarray:
    """Rotation matrix -> axis * angle (rad)."""
    angle = np.arccos(np.clip((np.trace(m) - 1) / 2, -1.0, 1.0))
    if angle < 1e-6:
        return np.zeros(3)
    axis = np.array([m[2, 1] - m[1, 2], m[0, 2] - m[2, 0], m[1, 0] - m[0, 1]]) / (2 * np.sin(angle))
    return axis * angle


def axis_angle(axis, angle: float) -> np.ndarray:
    """Rotation matrix about a unit axis (Rodrigues)."""
    x, y, z = np.asarray(axis, np.float64) / np.linalg.norm(axis)
    k = np.array([[0, -z, y], [z, 0, -x], [-y, x, 0]])
    return np.eye(3) + np.sin(angle) * k + (1 - np.cos(angle)) * k @ k


class Scene:
    """Privileged read-only views of a LIBERO env (`ControlEnv` or `OffScreenRenderEnv`): object poses,
    collision boxes, regions, goal predicates. Positions are world frame, metres."""

    def __init__(self, env):
        self.env = env
        self.inner = env.env
        # body -> the body ids of its subtree, for every object and fixture
        parents = self.model.body_parentid
        self._subtree = {}
        for name, root in self.inner.obj_body_id.items():
            ids = []
            for b in range(self.model.nbody):
                p = b
                while p > 0 and p != root:
                    p = parents[p]
                if p == root:
                    ids.append(b)
            self._subtree[name] = set(ids)
        self._geoms = {name: [g for g in range(self.model.ngeom)
                              if self.model.geom_bodyid[g] in ids
                              and (self.model.geom_contype[g] or self.model.geom_conaffinity[g])]
                       for name, ids in self._subtree.items()}

    # robosuite rebuilds the MjSim on a hard reset: read it anew every time (ids stay: same model)
    @property
    def sim(self):
        return self.inner.sim

    @property
    def model(self):
        return self.inner.sim.model._model

    @property
    def data(self):
        return self.inner.sim.data._data

    @property
    def goal(self) -> list:
        return self.inner.parsed_problem["goal_state"]

    def holds(self, predicate) -> bool:
        """One goal predicate (as in `goal`), evaluated by the benchmark itself."""
        return bool(self.inner._eval_predicate(predicate))

    def pos(self, name: str) -> np.ndarray:
        """Body origin of an object or fixture, or a region's site position."""
        if name in self.inner.obj_body_id:
            return self.data.xpos[self.inner.obj_body_id[name]].copy()
        return self.sim.data.get_site_xpos(name).copy()

    def rot(self, name: str) -> np.ndarray:
        return self.data.xmat[self.inner.obj_body_id[name]].reshape(3, 3).copy()

    def boxes(self, name: str, frame: str = "world") -> tuple[np.ndarray, np.ndarray]:
        """Collision geoms of an object's subtree as axis-aligned boxes: (centres [G, 3], half sizes [G, 3]),
        in the world frame or the object's body frame ("body")."""
        r_b, p_b = (self.rot(name), self.pos(name)) if frame == "body" else (np.eye(3), np.zeros(3))
        centres, halves = [], []
        for g in self._geoms[name]:
            r_g = self.data.geom_xmat[g].reshape(3, 3)
            aabb = self.model.geom_aabb[g]   # centre and half sizes in the geom's frame
            centres.append(r_b.T @ (self.data.geom_xpos[g] + r_g @ aabb[:3] - p_b))
            halves.append(np.abs(r_b.T @ r_g) @ aabb[3:])
        return np.array(centres).reshape(-1, 3), np.array(halves).reshape(-1, 3)

    def extent(self, name: str, frame: str = "world") -> tuple[np.ndarray, np.ndarray]:
        """(lo [3], hi [3]) of an object's collision geoms."""
        c, h = self.boxes(name, frame)
        return (c - h).min(0), (c + h).max(0)

    def objects(self) -> list[str]:
        return list(self.inner.objects_dict) + list(self.inner.fixtures_dict)

    def finger_axis(self) -> np.ndarray:
        """World direction (unit, horizontal) from one fingertip to the other."""
        d = (self.sim.data.get_body_xpos("gripper0_finger_joint1_tip")
             - self.sim.data.get_body_xpos("gripper0_finger_joint2_tip"))
        d[2] = 0.0
        return d / np.linalg.norm(d)


@dataclasses.dataclass
class Grasp:
    """Where the grip site goes to take an object: offset from the object's origin (world frame, at the
    time it is chosen), yaw of the finger axis (world, rad), the width the fingers close on and the
    object's length across them (m), and a description for logs."""

    offset: np.ndarray
    finger_yaw: float
    width: float
    length: float   # m: the object's horizontal size across the finger axis
    kind: str


def choose_grasp(scene: Scene, name: str, shoulder_xy) -> Grasp:
    """A top-down grasp from the object's collision geometry (see the module docstring); shoulder_xy:
    where the arm reaches from."""
    r_b, p_b = scene.rot(name), scene.pos(name)
    c, h = scene.boxes(name, "body")
    # reorder the body axes so the last one points up (the assets model some objects lying on a side)
    up = int(np.argmax(np.abs(r_b[2])))
    order = [i for i in range(3) if i != up] + [up]
    sign = np.array([1.0, 1.0, np.sign(r_b[2, up])])
    r_b, c, h = r_b[:, order] * sign, c[:, order] * sign, h[:, order]
    lo, hi = (c - h).min(0), (c + h).max(0)
    lo_w, hi_w = scene.extent(name)
    size = hi - lo
    narrow = int(np.argmin(size[:2]))
    if size[1 - narrow] <= MAX_OPENING:   # both sides fit (a can): fingers across the reach direction,
        out = p_b[:2] - shoulder_xy           # so that leaning forward (see `Expert._orient`) helps
        narrow = int(np.argmin(np.abs(out @ r_b[:2, :2]) / np.linalg.norm(out)))
    if size[narrow] <= MAX_OPENING:   # across the narrower side, at the middle of the footprint
        point = r_b @ ((lo + hi) / 2)
        height = hi_w[2] - lo_w[2]
        z = max(lo_w[2] + FINGER_BELOW_EEF + min(0.01, height / 3), hi_w[2] - 0.035)
        axis = r_b[:, narrow]
        width, length = size[narrow], size[1 - narrow]
        kind = f"across {size[narrow] * 100:.1f} cm"
    else:   # by the wall: the footprint's longer axis runs through the handle, if there is one
        long_ax = int(np.argmax(size[:2]))
        bottom = c[:, 2] - h[:, 2] < lo[2] + 0.005
        centre = c[bottom].mean(0) if bottom.any() else (lo + hi) / 2   # the base: the cup without its handle
        reach_hi, reach_lo = hi[long_ax] - centre[long_ax], centre[long_ax] - lo[long_ax]
        side = -1.0 if reach_hi > reach_lo + 0.01 else 1.0   # away from the handle (the longer reach)
        if abs(reach_hi - reach_lo) <= 0.01:   # symmetric (a bowl): a wall across the reach direction (the
            out = p_b[:2] - shoulder_xy           # forward lean then helps), on the side with more room
            long_ax = int(np.argmin(np.abs(out @ r_b[:2, :2])))
            ends = [p_b + r_b[:, long_ax] * (hi if sgn > 0 else lo)[long_ax] for sgn in (1.0, -1.0)]
            room = [min((np.linalg.norm(e[:2] - scene.pos(o)[:2]) for o in scene.objects()
                         if o != name and np.ptp(np.stack(scene.extent(o)), axis=0)[2] < 0.5), default=1.0)
                    for e in ends]
            side = 1.0 if room[0] >= room[1] else -1.0
        # hollow (a cup) if no geom covers the base's centre above half the height
        covers = np.all(np.abs(c[:, :2] - centre[:2]) <= h[:, :2], axis=1) & (c[:, 2] + h[:, 2] > lo[2] + size[2] / 2)
        handled = abs(reach_hi - reach_lo) > 0.01
        if covers.any() and handled:   # solid with a handle (a moka pot): the handle's outermost geom
            reach = c[:, long_ax] - side * h[:, long_ax]
            k = int(np.argmin(side * reach))
            thin = 1 - long_ax
            point = r_b @ np.r_[c[k, :2], 0.0]
            z = (r_b @ c[k])[2] + p_b[2] + h[k, 2] - 0.015
            axis = r_b[:, thin]
            width, length = 2 * h[k, thin], size[long_ax]
            kind = "handle"
        else:   # the outermost wall geom on that side (tall: a wall, not the base), its centre between the fingers
            tall = (h[:, 2] * 2 > 0.5 * size[2])
            reach = side * (c[:, long_ax] + side * h[:, long_ax])
            k = int(np.argmax(np.where(tall, reach, -np.inf)))
            point = r_b @ np.r_[c[k, :2], 0.0]
            z = hi_w[2] - 0.03
            axis = r_b[:, long_ax]
            width, length = 2 * h[k, long_ax], size[1 - long_ax]
            kind = f"wall, {'handle opposite' if handled else 'symmetric'}"
    offset = np.array([point[0], point[1], z - p_b[2]])
    return Grasp(offset=offset, finger_yaw=float(np.arctan2(axis[1], axis[0])), width=float(width),
                 length=float(length), kind=kind)
