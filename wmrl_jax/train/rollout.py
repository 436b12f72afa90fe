"""The rollout layout: the weights generation reads, laid out for decoding rather than for the update.

The update keeps float32 masters and Adam moments sharded over every device
(`fsdp x tensor`, `config.mesh`): right for the update, whose big matmuls hide
a per-layer all-gather. Decoding from that layout gathers every layer's
weights again for every new token -- the all-gathers sit inside the compiled
decode loop (`tests/test_rollout.py` counts them in the HLO) -- so decode is
bound by the links, not by the FLOPs (docs/scaling.md, "The bill").

The rollout layout (`config.rollout.layout = "rollout"`) is a second mesh
over the same devices, `data = devices / g, fsdp = 1, tensor = g` with
`g = config.rollout.tensor`: each group of g devices holds the whole model in
the model's dtype, tensor-parallel within the group (heads, MLP width and
vocabulary over g, by the same rules table, `models.sharding.RULES`; g = 1
is plain replication), and the rows of a batch are spread over the groups.
The weights stay whole inside a group, so the decode loop reads them in
place: no weight all-gather in the loop, only the tensor axis's
all-reduces of activations.

* Once a step the loop reshards the trained masters into this layout and
  casts them to the model's dtype (`Resharder`, one jitted program whose
  output shardings are the rollout layout's): one all-gather per weight a
  step instead of one per weight per token.
* The frozen copy (reference policy and world model) is placed in this
  layout once, when the run starts (`place`), and stays there: the world
  model generates from it, and the update reads it as it is (its jit takes
  the argument's sharding; inside a group nothing is gathered).

`config.rollout.layout = "train"` generates on the training mesh instead, as
before (no second layout, the per-token gathers). `launch/plan.py` chooses
`rollout.tensor` for a config (`train.plan.choose_rollout_layout`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from wmrl_jax.models.sharding import make_mesh, tree_shardings

LAYOUTS = ("rollout", "train")


def rollout_mesh_shape(rollout, device_count: int) -> tuple[int, int, int] | None:
    """(data, fsdp, tensor) = (devices / g, 1, g) of `config.rollout`'s layout; None for layout "train".

    Raises ValueError naming the field for a layout other than `LAYOUTS` or a
    group size that does not divide the devices.
    """
    layout = rollout.get("layout", "rollout")
    if layout not in LAYOUTS:
        raise ValueError(f"config.rollout.layout: {layout!r}, expected one of {LAYOUTS}")
    if layout == "train":
        return None
    g = rollout.get("tensor", 1)
    if isinstance(g, bool) or not isinstance(g, int) or g < 1 or device_count % g:
        raise ValueError(f"config.rollout.tensor: {g!r}, expected a positive int dividing the {device_count} "
                         f"devices (the tensor-parallel group of the rollout layout; 1 = replicated)")
    return device_count // g, 1, g


def rollout_mesh(rollout, devices) -> Any:
    """The rollout layout's mesh over `devices` (a list), or None (layout "train", or a single device)."""
    if len(devices) == 1:
        return None
    shape = rollout_mesh_shape(rollout, len(devices))
    return None if shape is None else make_mesh(shape, devices=devices)


def rollout_shardings(mesh, family, model_config, params) -> Any:
    """NamedSharding per leaf of `params` (arrays or ShapeDtypeStructs) in the rollout layout on `mesh`."""
    return tree_shardings(mesh, family.param_axes(model_config), params)


def place(params, mesh, family, model_config, dtype) -> Any:
    """`params` in `dtype`, placed in the rollout layout on `mesh` (None: cast only). Used once, for the frozen copy.

    Arrays that span several processes' devices (a multi-host run) go
    through the same jitted program as the per-step reshard; others (e.g.
    params on one device) are cast and `device_put`.
    """
    resharder = Resharder(family, model_config, mesh, dtype)
    if mesh is None or not all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(params)):
        return resharder(params)
    cast = jax.jit(resharder._fn)(params)
    return jax.device_put(cast, rollout_shardings(mesh, family, model_config, cast))


@dataclasses.dataclass
class Resharder:
    """params (training layout, e.g. float32 masters over fsdp x tensor) -> the rollout layout in `dtype`.

    One jitted program: a cast and the collectives that move every shard to
    the devices that hold it in the rollout layout (XLA picks them from the
    input and output shardings). Called once per step, before sampling;
    `trace` gives the program for planning (`train.plan`).
    """

    family: Any
    model_config: Any
    mesh: Any            # the rollout mesh (None: one device, or layout "train" -- only the cast)
    dtype: Any

    def __post_init__(self):
        self._jitted = {}

    def __repr__(self) -> str:
        where = "one device / training mesh (cast only)" if self.mesh is None else \
            f"mesh {dict(self.mesh.shape)}"
        return f"Resharder({self.family.__name__.rsplit('.', 1)[-1]}, dtype={jnp.dtype(self.dtype).name}, {where})"

    def _fn(self, params):
        return jax.tree.map(lambda x: x.astype(self.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)

    def _jit(self, params):
        if self.mesh is None:
            return jax.jit(self._fn)
        structure = jax.tree.structure(params)
        if structure not in self._jitted:
            out = jax.eval_shape(self._fn, params)
            self._jitted[structure] = jax.jit(self._fn, out_shardings=rollout_shardings(
                self.mesh, self.family, self.model_config, out))
        return self._jitted[structure]

    def __call__(self, params):
        return self._jit(params)(params)

    def trace(self, params):
        """The jitted reshard traced on `params` (ShapeDtypeStructs with the training layout's shardings)."""
        return self._jit(params).trace(params)


def generation_model(lm, params, mesh):
    """`lm` (a chat.ChatModel) reading `params` on `mesh`: what the agent or the world model generates with.

    `sampling.generate` splits rows over the model's mesh and keeps the
    params' shardings, so a model carrying the rollout mesh and params in the
    rollout layout decodes in it.
    """
    model = dataclasses.replace(lm.model, params=params, mesh=mesh if mesh is not None else lm.model.mesh)
    return dataclasses.replace(lm, model=model)


__all__ = ["LAYOUTS", "Resharder", "generation_model", "place", "rollout_mesh", "rollout_mesh_shape",
           "rollout_shardings"]
