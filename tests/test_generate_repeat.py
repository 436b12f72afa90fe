"""`sampling.generate` called again and again with equal shapes: no recompilation, no growth.

A training run calls `generate` thousands of times with the same bucketed
shapes. Each call must reuse the one compiled program: a retrace per call
would cost seconds, and each XLA:CPU compile maps fresh code pages that are
never unmapped (a slow leak that shows in /proc/self/maps). The check runs in
a fresh interpreter, so that nothing compiled by other tests counts: a tiny
Qwen3 and a tiny Qwen3.5 (random init, no checkpoint), a few warm-up calls,
then many calls with what may change between calls of one bucket (prompt
lengths and ids, seeds, the EOS id), counting

* backend compilations (a `jax.monitoring` listener on the compile event),
* the sampler's jit cache (`sampling._sample_jit._cache_size()`),
* /proc/self/maps lines and resident memory (VmRSS).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

CALLS = 150  # per family, after the warm-up

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import jax
    from wmrl_jax import models, sampling
    from wmrl_jax.models import qwen3, qwen35

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
    )

    def probe():
        with open("/proc/self/maps") as f:
            maps = sum(1 for _ in f)
        with open("/proc/self/status") as f:
            rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return {"compiles": len(compiles), "jit_cache": sampling._sample_jit._cache_size(), "maps": maps, "rss_mb": rss_kb / 1024}

    tiny = {
        "qwen3": qwen3.Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=8),
        "qwen35": qwen35.config_from_hf(dict(
            model_type="qwen3_5_text", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention"] * 2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_conv_kernel_dim=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    }
    calls, warmup = int(sys.argv[1]), 5
    rng = np.random.default_rng(0)
    report = {}
    for name, config in tiny.items():
        model = models.init(config, jax.random.key(0))

        def call(i):
            # 3 prompts of 5..16 tokens: always the (4, 16) bucket; new ids, seed and EOS id every call.
            prompts = [rng.integers(3, 64, size=rng.integers(5, 17)).tolist() for _ in range(3)]
            return sampling.generate(model, prompts, max_new_tokens=8, temperature=0.7, top_k=20, top_p=0.9,
                                     eos_ids=(int(rng.integers(0, 64)),), seed=i)

        for i in range(warmup):
            call(i)
        after_warmup = probe()
        for i in range(warmup, warmup + calls):
            out = call(i)
            assert all(1 <= len(t) <= 8 for t in out.tokens)
        report[name] = {"after_warmup": after_warmup, "end": probe()}
    print("REPORT " + json.dumps(report))
    """
)


def test_repeated_generate_neither_recompiles_nor_grows():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("XLA_FLAGS", None)  # one CPU device, as a plain run has
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(CALLS)], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("REPORT "))[len("REPORT ") :])
    for name, r in report.items():
        warm, end = r["after_warmup"], r["end"]
        assert warm["compiles"] >= 1, f"{name}: the compile listener saw nothing ({r})"
        assert end["compiles"] == warm["compiles"], f"{name}: {CALLS} equal-shape calls compiled again ({r})"
        assert end["jit_cache"] == warm["jit_cache"], f"{name}: the sampler's jit cache grew ({r})"
        # A compiled program maps new code pages; a handful of lines may come and go with malloc arenas.
        assert end["maps"] - warm["maps"] <= 8, f"{name}: /proc/self/maps grew by {end['maps'] - warm['maps']} lines ({r})"
        # Each call's arrays are tiny (KBs); 150 calls leaking even one small buffer each stays under this,
        # but a leaked executable or cache per call does not.
        assert end["rss_mb"] - warm["rss_mb"] < 16, f"{name}: RSS grew {end['rss_mb'] - warm['rss_mb']:.1f} MB ({r})"
