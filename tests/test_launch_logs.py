"""The launch scripts print results, warnings and errors, not absl/JAX INFO lines."""

import pathlib
import re
import subprocess
import sys
import textwrap

LAUNCH = pathlib.Path(__file__).resolve().parents[1] / "launch"

# An absl app as the launch scripts are (app.run puts the root logger at INFO),
# run with and without the shared helper.
APP = textwrap.dedent('''
    import logging, sys
    sys.path.insert(0, {launch!r})
    if {quiet}:
        import bench_common
    from absl import app

    def main(argv):
        import jax.numpy as jnp
        jnp.ones(2).block_until_ready()
        logging.getLogger("jax._src.probe").info("info from jax")
        logging.getLogger("jax._src.probe").warning("warning from jax")
        print("result")

    app.run(main)
''')

# absl's format for an INFO record: "I1204 15:36:40.632858 1406... file.py:849] ..."
ABSL_INFO = re.compile(r"^I\d{4} \d\d:\d\d:\d\d", re.M)


def _run(quiet: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "JAX_LOGGING_LEVEL")}
    proc = subprocess.run([sys.executable, "-c", APP.format(launch=str(LAUNCH), quiet=quiet)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_bench_common_quiets_jax_info_under_absl_but_keeps_warnings():
    loud, quiet = _run(False), _run(True)
    print("without the helper:", loud.stderr, "with it:", quiet.stderr, sep="\n")
    assert "info from jax" in loud.stderr      # the noise is real without the helper
    assert quiet.stdout.strip() == "result"
    assert "info from jax" not in quiet.stderr and not ABSL_INFO.search(quiet.stderr), quiet.stderr
    assert quiet.stderr.count("warning from jax") == 1, quiet.stderr   # shown, and once (not by two handlers)


def test_every_jax_launch_script_imports_the_helper_before_jax():
    for path in sorted(LAUNCH.glob("*.py")):
        src = path.read_text()
        if path.name == "bench_common.py" or not re.search(r"\b(import jax|from jax|wmrl_jax)\b", src):
            continue
        helper = re.search(r"^(import bench_common\b|from bench_common import)", src, re.M)
        assert helper, f"{path.name} uses JAX but does not import bench_common (which quiets absl/JAX INFO logs)"
        first_jax = re.search(r"^\s*(import jax|from jax)", src, re.M)
        assert first_jax is None or helper.start() < first_jax.start(), f"{path.name}: import bench_common before jax"


def _train(*args, cwd=None):
    return subprocess.run([sys.executable, str(LAUNCH / "train.py"), *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_an_unknown_config_field_is_one_line_naming_the_closest_fields():
    # ml_collections alone: a 53-line chained traceback ending in `AttributeError: "'mdoe'"`.
    proc = _train(f"--config={LAUNCH.parent / 'configs' / 'tiny_cpu.py'}", "--config.rewards.mdoe=real")
    assert proc.returncode != 0
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert "--config.rewards.mdoe" in lines[0] and "did you mean rewards.mode" in lines[0], lines[0]


def test_an_invalid_config_value_is_one_line_before_any_compute():
    proc = _train(f"--config={LAUNCH.parent / 'configs' / 'tiny_cpu.py'}", "--config.steps=0")
    assert proc.returncode != 0
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert lines == ["train.py: config.steps: 0, expected an int >= 1"], lines


def test_transformers_is_imported_without_its_pytorch_notice():
    """Without torch (a plain `pip install -e .`), `import transformers` prints "PyTorch was not found. Models
    won't be available ..." on every run; our import of it does not. torch is hidden as a bare install lacks it."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    hide_torch = "import sys; sys.modules['torch'] = None; "
    bare = subprocess.run([sys.executable, "-c", hide_torch + "import transformers"], capture_output=True,
                          text=True, timeout=120, env=env)
    ours = subprocess.run([sys.executable, "-c", hide_torch + "from wmrl_jax.models.tokenizer import "
                           "import_transformers; import_transformers().AutoConfig"], capture_output=True, text=True,
                          timeout=120, env=env, cwd=LAUNCH.parent)
    assert "PyTorch was not found" in bare.stderr   # the notice is real without the helper
    assert ours.returncode == 0 and ours.stderr == "", ours.stderr
