"""The sandbox runs whatever the host interpreter's prefix: a venv under /tmp, or
one reached through a symlink from an unusual folder.

Each case makes a real venv (`--system-site-packages --without-pip`: well under
a second, nothing installed) and runs `sandbox.run_solution` on an embedded task
in a subprocess started by that venv's python, exactly as a user of that venv
would. Before the interpreter was mounted after the private /tmp, a /tmp venv
gave status "unknown" ("setpriv: failed to execute .../bin/python: No such file").
"""

import json
import os
import pathlib
import shutil
import subprocess
import sysconfig
import tempfile
import venv

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

# The sample submission is a valid one (no pandas import: ~1 s less per run).
# It reports the interpreter it runs under and whether it can write into the venv.
SOLUTION = '''
import os, shutil, sys
shutil.copy(os.path.join(os.environ["DATA_DIR"], "sample_submission.csv"), os.environ["SUBMISSION_PATH"])
try:
    open(os.path.join(sys.prefix, "escape.txt"), "w").write("x")
    print("venv writable")
except OSError as e:
    print("venv read-only", type(e).__name__)
print("prefix", sys.prefix)
'''

DRIVER = f'''
import json, sys
import sandbox, sandbox.suite
task = sandbox.load_task(sandbox.suite.suite_dir() / "iris_species")
r = sandbox.run_solution(task, {SOLUTION!r}, timeout_s=60)
print(json.dumps({{"status": r.status, "reward": r.reward, "feedback": r.feedback,
                  "backend": r.isolation.get("backend"), "host_prefix": sys.prefix}}))
'''


def _make_venv(folder: pathlib.Path) -> None:
    venv.EnvBuilder(system_site_packages=True, with_pip=False, symlinks=True).create(folder)
    # system_site_packages reaches the *base* interpreter's packages; when the tests themselves run in a
    # venv (where this repo's dependencies were installed), a .pth file adds that venv's too.
    purelib = sysconfig.get_paths()["purelib"]
    inner = sysconfig.get_paths(vars={"base": str(folder), "platbase": str(folder)})["purelib"]
    pathlib.Path(inner, "outer_env.pth").write_text(purelib + "\n")
    os.chmod(folder, 0o755)


def _run_driver(python: pathlib.Path) -> dict:
    # cwd and PYTHONPATH: this checkout's `sandbox`, not whichever one is installed.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([str(python), "-c", DRIVER], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def var_tmp_folder():
    """A folder outside /tmp and outside the system mounts (cleaned up after)."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="wmrl-venv-", dir="/var/tmp"))
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _check(result: dict, venv_path: pathlib.Path) -> None:
    assert result["backend"] == "bwrap", result
    assert (result["status"], result["reward"] is not None) == ("valid", True), result["feedback"]
    # Inside the sandbox, python ran as the venv's interpreter, by the same path as on the host.
    assert f"prefix {result['host_prefix']}\n" in result["feedback"] + "\n", result["feedback"]
    assert os.path.realpath(result["host_prefix"]) == os.path.realpath(venv_path)
    # The venv is mounted read-only: the solution still cannot write outside its work dir.
    assert "venv read-only" in result["feedback"], result["feedback"]
    assert not (pathlib.Path(venv_path) / "escape.txt").exists()


def test_venv_under_tmp(tmp_path):
    assert str(tmp_path).startswith("/tmp/"), tmp_path   # the case that used to break
    folder = tmp_path / "venv"
    _make_venv(folder)
    _check(_run_driver(folder / "bin" / "python"), folder)


@pytest.mark.parametrize("link_kind", ["absolute", "relative"])
def test_venv_reached_through_a_symlink_outside_tmp(var_tmp_folder, link_kind):
    real = var_tmp_folder / "real"
    real.mkdir(mode=0o755)
    _make_venv(real / "venv")
    link = var_tmp_folder / "link"
    link.symlink_to(real if link_kind == "absolute" else "real")
    python = link / "venv" / "bin" / "python"
    result = _run_driver(python)
    _check(result, real / "venv")
    assert result["host_prefix"].startswith(str(link)), result["host_prefix"]   # python kept the linked path


def test_answers_shipped_inside_an_installed_package_stay_hidden(tmp_path):
    """A non-editable install puts the embedded suite, answers included, in
    site-packages, which the sandbox mounts for the interpreter: the task's
    folder and the whole suite must still be invisible to the solution."""
    folder = tmp_path / "venv"
    _make_venv(folder)
    site = next((folder / "lib").glob("python3*/site-packages"))
    shutil.copytree(REPO / "sandbox", site / "sandbox", ignore=shutil.ignore_patterns("__pycache__"))
    suite = site / "sandbox" / "suite" / "embedded"
    probes = [str(suite / "iris_species" / "data" / "private" / "test_answer.csv"),
              str(suite / "wine_cultivar" / "data" / "private" / "test_answer.csv")]
    driver = f'''
import json, sandbox, sandbox.suite
task = sandbox.load_task(sandbox.suite.suite_dir() / "iris_species")
code = ("import os\\nprint('visible', [p for p in {probes!r} if os.path.exists(p)])\\n"
        "print('suite', os.listdir({str(suite)!r}))\\n")
r = sandbox.run_solution(task, code, timeout_s=60)
print(json.dumps({{"module": sandbox.__file__, "status": r.status, "feedback": r.feedback}}))
'''
    # Not from the checkout: the venv's own copy of the package is the one imported.
    proc = subprocess.run([str(folder / "bin" / "python"), "-c", driver], cwd=tmp_path, capture_output=True,
                          text=True, timeout=180, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["module"].startswith(str(site)), result["module"]
    assert result["status"] == "ran_no_sub", result["feedback"]
    assert "visible []" in result["feedback"] and "suite []" in result["feedback"], result["feedback"]


def test_symlink_chain_is_recorded_in_resolution_order(tmp_path):
    from sandbox import isolation

    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "python3.11").write_text("")
    (tmp_path / "a" / "b" / "python").symlink_to("python3.11")
    (tmp_path / "l1").symlink_to(tmp_path / "a")
    (tmp_path / "l2").symlink_to("l1/b/python")
    links, real = isolation._resolve_links(str(tmp_path / "l2"))
    base = os.path.realpath(tmp_path)
    assert real == f"{base}/a/b/python3.11"
    assert links[-2:] == [(f"{base}/l1", str(tmp_path / "a")), (f"{base}/a/b/python", "python3.11")]
    assert links[-3] == (f"{base}/l2", "l1/b/python")
