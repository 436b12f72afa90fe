"""Test session set-up.

8 simulated CPU devices for the sharding tests: XLA reads the flag once, when
the backend starts, so it is set here before anything imports jax. Tests that
do not shard still run on device 0 as usual.
"""

import os

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import importlib.util  # noqa: E402  (after the XLA flag above)
import pathlib  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def launch_script(monkeypatch):
    """load(name) -> the module launch/<name>.py, imported as `python launch/<name>.py` runs it (launch/ on the path).

    The absl flags a script defines are removed again after the test: scripts share flag names (`--seeds`,
    `--out`), and a test process (an xdist worker) runs many test files one after another.
    """
    from absl import flags

    launch = pathlib.Path(__file__).resolve().parents[1] / "launch"
    monkeypatch.syspath_prepend(str(launch))  # the scripts import bench_common from beside them
    defined = set(flags.FLAGS)

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, launch / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    yield load
    for name in set(flags.FLAGS) - defined:
        delattr(flags.FLAGS, name)
