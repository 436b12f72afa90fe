"""Writes that an interrupted process cannot leave half done: a file or a folder appears whole or not at all.

    files.write_atomic(path, lambda tmp: np.savez(tmp, **arrays))     # any writer that takes a path
    files.write_text_atomic(out / "eval.json", json.dumps(record))
    files.swap_into_place(staging, out_dir)                           # a folder written beside its final name

Each writes under a temporary name in the destination's folder (same file
system, so the rename is atomic) and renames onto the final name. Plain
standard library: the simulator and the sandbox keep their own copies of
the pattern (they import nothing of wmrl_jax).
"""

from __future__ import annotations

import os
import pathlib
import shutil
from typing import Callable


def write_atomic(path, write: Callable[[pathlib.Path], object]) -> pathlib.Path:
    """`write(tmp)` then rename `tmp` onto `path`; the temporary keeps `path`'s suffix (savez, savefig read it).

    A killed or failing writer leaves the previous file (or none) and no temporary behind."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text_atomic(path, text: str) -> pathlib.Path:
    """`text` at `path`, atomically (`write_atomic`)."""
    return write_atomic(path, lambda tmp: tmp.write_text(text))


def swap_into_place(staging, folder) -> pathlib.Path:
    """Move the complete folder `staging` to `folder`; an older `folder` is swapped out only then, and removed.

    Between the two renames the old folder sits at `<folder>.old`: a process killed there leaves the
    previous version under that name, never a mixture."""
    staging, folder = pathlib.Path(staging), pathlib.Path(folder)
    if folder.exists():
        old = folder.with_name(folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
        os.replace(staging, folder)
        shutil.rmtree(old)
    else:
        os.replace(staging, folder)
    return folder
