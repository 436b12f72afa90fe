"""Logical axis names → device mesh axes: one rules table, used for params, caches and activations.

Every weight and activation dimension carries a logical name ("embed",
"heads", "mlp", ...). `RULES` maps each name onto zero or more mesh axes of a
`Mesh` with axes ("data", "fsdp", "tensor"):

* "fsdp" shards the model width of every weight (ZeRO-3 style: gathered per
  layer inside the scan) and, with "data", the batch of activations;
* "tensor" shards heads, MLP width and vocabulary (Megatron style), so the
  attention and MLP matmuls need one all-reduce each.

A dimension whose size does not divide the product of its mesh axes falls
back to fewer axes (then to replicated) instead of failing: tiny test models
(2 KV heads on 4 tensor shards) and odd batch sizes still run, only less
sharded. Mesh axes the mesh does not have are ignored.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical name -> mesh axes (in order; later ones dropped first when a size does not divide).
RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "length": (),
    "layers": (),  # scanned over: must stay whole on every device
    "embed": ("fsdp",),
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "norm": (),
    "cache_length": (),
    # Qwen3.5 linear-attention dims (gated DeltaNet)
    "conv_channels": ("tensor",),
    "conv_kernel": (),
    "value_heads": ("tensor",),
    "key_dim": (),
    "value_dim": (),
}


def make_mesh(shape: Sequence[int], axes: Sequence[str] = MESH_AXES, devices=None) -> Mesh:
    """A Mesh of `shape` over the first prod(shape) devices, axes named `axes` (Auto axis types).

    e.g. make_mesh((1, 2, 4)) → data 1 × fsdp 2 × tensor 4 on 8 devices;
    make_mesh((2, 4), ("fsdp", "tensor")) is the same without a data axis.
    """
    shape, axes = tuple(int(s) for s in shape), tuple(axes)
    if len(shape) != len(axes):
        raise ValueError(f"make_mesh: shape {shape} has {len(shape)} dims, axes {axes} has {len(axes)}")
    unknown = set(axes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"make_mesh: unknown mesh axes {sorted(unknown)}; expected names from {MESH_AXES}")
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(shape)
    if need > len(devices):
        raise ValueError(f"make_mesh: shape {shape} needs {need} devices, only {len(devices)} available")
    grid = np.asarray(devices[:need], dtype=object).reshape(shape)
    return Mesh(grid, axes, axis_types=(AxisType.Auto,) * len(axes))


def logical_to_spec(
    logical_axes: Sequence[str | None], shape: Sequence[int], mesh_shape: dict[str, int], rules: dict | None = None
) -> PartitionSpec:
    """PartitionSpec for an array of `shape` whose dims carry `logical_axes`.

    Each mesh axis is used at most once per array; a dim keeps the longest
    prefix of its rule's axes whose size product divides it.
    """
    rules = RULES if rules is None else rules
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match array rank {len(shape)} (shape {tuple(shape)})")
    used: set[str] = set()
    spec = []
    for name, size in zip(logical_axes, shape):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise KeyError(f"logical axis {name!r} has no sharding rule; known: {sorted(rules)}")
        chosen: list[str] = []
        product = 1
        for axis in rules[name]:
            if axis not in mesh_shape or axis in used:
                continue
            if size % (product * mesh_shape[axis]):
                break
            chosen.append(axis)
            product *= mesh_shape[axis]
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*spec)


def named_sharding(mesh: Mesh, logical_axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, shape, dict(mesh.shape)))


def is_axes(x: Any) -> bool:
    """The `is_leaf` of a logical-axes tree (`param_axes`, `cache_axes`): a tuple of names is one leaf."""
    return isinstance(x, tuple)


def tree_shardings(mesh: Mesh, axes_tree: Any, shapes_tree: Any) -> Any:
    """NamedSharding per leaf; `axes_tree` has a tuple of logical names where `shapes_tree` has an array/ShapeDtypeStruct."""
    return jax.tree.map(
        lambda axes, x: named_sharding(mesh, axes, x.shape),
        axes_tree,
        shapes_tree,
        is_leaf=is_axes,
    )


def shard_params(params: Any, axes_tree: Any, mesh: Mesh) -> Any:
    """device_put every leaf of `params` with the NamedSharding its logical axes give on `mesh`."""
    return jax.device_put(params, tree_shardings(mesh, axes_tree, params))


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Activation sharding constraint from logical names under the current mesh (`jax.set_mesh`).

    A no-op without a mesh, so single-device code paths stay unchanged.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, x.shape, dict(mesh.shape)))


def logical_to_sharding(axes_tree: Any, mesh: Mesh, shapes_tree: Any = None) -> Any:
    """NamedSharding per leaf of a logical-axes tree (e.g. `family.cache_axes(config)`).

    Pass `shapes_tree` (arrays or `jax.eval_shape` output of the same
    structure) to get the divisibility fallback of `logical_to_spec`; without
    it every rule applies in full and a dim its mesh axes do not divide fails
    when the array is placed.
    """
    if shapes_tree is not None:
        return tree_shardings(mesh, axes_tree, shapes_tree)
    mesh_shape = dict(mesh.shape)
    huge = math.prod(mesh_shape.values()) * 2**20  # divisible by any mesh axis product
    return jax.tree.map(
        lambda axes: NamedSharding(mesh, logical_to_spec(axes, [huge] * len(axes), mesh_shape)),
        axes_tree,
        is_leaf=is_axes,
    )
