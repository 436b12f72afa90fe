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
