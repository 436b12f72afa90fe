"""HF checkpoint folders <-> `Model`: config via transformers, tensors via each family's table.

Loading never builds the model on one device first: every param leaf is
created with `jax.make_array_from_callback` under its NamedSharding, and the
callback reads (memory-mapped) only the HF tensors of the shard it is asked
for. safetensors are read and written with a small built-in codec (the
format is a JSON header + raw little-endian bytes) so that bf16 works with
numpy (`ml_dtypes`) and nothing routes through torch or one accelerator.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from wmrl_jax.models import sharding as shd
from wmrl_jax.models.family import HfTensor, Model, get_family
from wmrl_jax.models.tokenizer import import_transformers

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(bool),
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsFile:
    """Lazy reader of one .safetensors file: `shape(key)`, `get(key)` (a memory-mapped numpy view)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        self.entries = header
        self._data_start = 8 + header_len
        self._mmap = None

    def keys(self):
        return self.entries.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.entries[key]["shape"])

    def get(self, key: str) -> np.ndarray:
        entry = self.entries[key]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"tensor {key} in {self.path}: dtype {entry['dtype']} not supported")
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        start, end = entry["data_offsets"]
        raw = self._mmap[self._data_start + start : self._data_start + end]
        return raw.view(_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], np.dtype, Any]]) -> None:
    """Streams tensors to `path`: (key, shape, dtype, thunk returning the numpy array) each.

    The header is computed from shapes first, so only one tensor is ever on
    the host at a time.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, shape, dtype, _ in tensors:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        header[key] = {"dtype": _DTYPE_NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for key, shape, dtype, thunk in tensors:
            array = np.ascontiguousarray(thunk(), dtype=dtype)
            if array.shape != tuple(shape):
                raise ValueError(f"tensor {key}: shape {array.shape}, expected {tuple(shape)}")
            f.write(array.tobytes())


def _open_checkpoint(path: Path) -> dict[str, SafetensorsFile]:
    """key -> reader, from model.safetensors or a sharded set with its index."""
    if (path / INDEX_FILE).exists():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        readers = {name: SafetensorsFile(path / name) for name in sorted(set(weight_map.values()))}
        for key, name in weight_map.items():
            if key not in readers[name].entries:
                raise ValueError(f"{INDEX_FILE} maps tensor {key} to {name}, which does not contain it")
        return {key: readers[name] for key, name in weight_map.items()}
    if (path / SINGLE_FILE).exists():
        reader = SafetensorsFile(path / SINGLE_FILE)
        return {key: reader for key in reader.keys()}
    raise FileNotFoundError(f"{path}: expected {SINGLE_FILE} or {INDEX_FILE}")


def _read_model_type(path: Path) -> str:
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{config_file}: no config.json (expected an HF checkpoint folder)")
    model_type = json.loads(config_file.read_text()).get("model_type")
    get_family(model_type)  # unsupported model_type -> clear error before transformers sees it
    return model_type


def _expand(entry: HfTensor, expected: dict) -> list[str]:
    """The HF keys of one entry: slice i of a stacked leaf is entry.layer_key(i), i < its leading dim."""
    if not entry.stacked:
        return [entry.key]
    return [entry.layer_key(i) for i in range(_get_path(expected, entry.path).shape[0])]


def _get_path(tree: dict, path: tuple[str, ...]):
    for name in path:
        tree = tree[name]
    return tree


def _set_path(tree: dict, path: tuple[str, ...], value) -> None:
    for name in path[:-1]:
        tree = tree.setdefault(name, {})
    tree[path[-1]] = value


def load_hf(path, *, dtype: Any = "float32", mesh: jax.sharding.Mesh | None = None) -> Model:
    """Loads an HF checkpoint folder into a `Model` with params in `dtype`, sharded over `mesh` if given."""
    transformers = import_transformers()

    path = Path(path)
    _read_model_type(path)
    hf_config = transformers.AutoConfig.from_pretrained(path).to_dict()
    family = get_family(hf_config["model_type"])
    config = family.config_from_hf(hf_config)
    dtype = jnp.dtype(dtype)
    table = family.hf_table(config)
    axes = family.param_axes(config)
    expected = jax.eval_shape(lambda: family.init_params(config, jax.random.key(0), dtype))
    files = _open_checkpoint(path)

    ignore = [re.compile(p) for p in getattr(family, "hf_ignore", lambda c: ())(config)]
    wanted = {key: entry.hf_shape for entry in table for key in _expand(entry, expected)}
    missing = [f"{k} (expected shape {wanted[k]})" for k in sorted(wanted.keys() - files.keys())]
    if missing:
        raise ValueError(f"{path}: missing tensor(s): {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    unexpected = [
        f"{k} (shape {files[k].shape(k)})"
        for k in sorted(files.keys() - wanted.keys())
        if not any(p.search(k) for p in ignore)
    ]
    if unexpected:
        raise ValueError(
            f"{path}: unexpected tensor(s): {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}; "
            f"the {hf_config['model_type']!r} table has no such key"
        )
    skipped = sorted(files.keys() - wanted.keys())
    if skipped:
        print(f"load_hf: ignoring {len(skipped)} tensor(s) not used by the text model, e.g. {skipped[0]}")
    for entry in table:
        for key in _expand(entry, expected):
            if files[key].shape(key) != entry.hf_shape:
                raise ValueError(f"tensor {key}: shape {files[key].shape(key)}, expected {entry.hf_shape}")

    params: dict = {}
    # No progress bar: the micro-world's 27 tensors load in well under a second, and a bar closed with
    # leave=False still left "load_hf:   0%|" and a line of spaces in every non-terminal log.
    for entry in table:
        want = _get_path(expected, entry.path)
        shape = ((want.shape[0],) if entry.stacked else ()) + entry.param_shape
        if tuple(want.shape) != shape:
            raise ValueError(f"family table for {entry.key}: param {entry.path} shape {shape}, init gives {want.shape}")
        if mesh is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        else:
            sharding = shd.named_sharding(mesh, _get_path(axes, entry.path), shape)
        _set_path(params, entry.path, jax.make_array_from_callback(shape, sharding, _reader(entry, files, dtype, shape[0])))
    return Model(config=config, params=params, family=family, mesh=mesh)


def _reader(entry: HfTensor, files: dict, dtype, num_layers: int):
    """make_array_from_callback callback: converts only the HF tensors this shard covers."""

    def convert(key: str) -> np.ndarray:
        hf = files[key].get(key)
        return hf.reshape(entry.view).transpose(entry.perm)

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        if not entry.stacked:
            return np.asarray(convert(entry.key)[index], dtype=dtype)
        layers = range(*index[0].indices(num_layers))
        return np.stack([np.asarray(convert(entry.layer_key(i))[index[1:]], dtype=dtype) for i in layers])

    return callback


def save_hf(model: Model, path, *, max_shard_bytes: int | None = None, tokenizer=None) -> Path:
    """Writes `model` as an HF folder (config.json + safetensors) that transformers loads.

    Tensors are written in the params' dtype, one at a time from the devices;
    with `max_shard_bytes` a sharded set + index is written instead of one
    file. A `tokenizer` (e.g. from `load_tokenizer`) is saved alongside, so
    the folder serves as is.
    """
    transformers = import_transformers()

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    family, config, params = model.family, model.config, model.params
    hf_kwargs = dict(family.config_to_hf(config))
    model_type = hf_kwargs.pop("model_type")
    leaves = jax.tree.leaves(params)
    dtype = np.dtype(leaves[0].dtype)
    hf_config = transformers.AutoConfig.for_model(model_type, **hf_kwargs)
    hf_config.dtype = str(jnp.dtype(dtype).name)
    hf_config.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)

    tensors = []
    for entry in family.hf_table(config):
        leaf = _get_path(params, entry.path)
        inverse = tuple(np.argsort(entry.perm))
        layers = range(leaf.shape[0]) if entry.stacked else [None]
        for i in layers:
            key = entry.layer_key(i) if entry.stacked else entry.key

            def thunk(leaf=leaf, i=i, inverse=inverse, entry=entry):
                value = np.asarray(jax.device_get(leaf if i is None else leaf[i]))
                return value.transpose(inverse).reshape(entry.hf_shape)

            tensors.append((key, entry.hf_shape, np.dtype(leaf.dtype), thunk))
    shards = _split(tensors, max_shard_bytes)
    if len(shards) == 1:
        write_safetensors(path / SINGLE_FILE, shards[0])
        (path / INDEX_FILE).unlink(missing_ok=True)
        return path
    weight_map, total = {}, 0
    for n, shard in enumerate(tqdm(shards, desc="save_hf", leave=False)):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(path / name, shard)
        for key, shape, dt, _ in shard:
            weight_map[key] = name
            total += math.prod(shape) * np.dtype(dt).itemsize
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (path / SINGLE_FILE).unlink(missing_ok=True)
    return path


def _split(tensors: list, max_bytes: int | None) -> list[list]:
    if max_bytes is None:
        return [tensors]
    shards, current, size = [], [], 0
    for t in tensors:
        nbytes = math.prod(t[1]) * np.dtype(t[2]).itemsize
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += nbytes
    return shards + [current]
