"""Hostile solutions: each behaviour is contained, and the next run is unaffected."""

import ast
import hashlib
import os
import pathlib
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import warnings

import pytest

import sandbox
from helpers_sandbox import FIX, GOOD, copy_task
from sandbox import isolation, runner


@pytest.fixture(scope="module")
def crab(tmp_path_factory):
    return copy_task(tmp_path_factory.mktemp("iso") / "playground-series-s3e16")


@pytest.fixture(scope="module")
def baseline(crab):
    r = sandbox.run_solution(crab, GOOD, timeout_s=60)
    assert r.status == "valid", r.feedback
    return r


def _next_run_ok(crab, baseline):
    r = sandbox.run_solution(crab, GOOD, timeout_s=60)
    assert r.status == "valid" and r.raw_score == baseline.raw_score, r.feedback


def _digest(folder):
    h = hashlib.sha256()
    for p in sorted(pathlib.Path(folder).rglob("*")):
        h.update(str(p.relative_to(folder)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def _processes_with(token):
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


def _wait_gone(predicate, seconds=3.0):
    deadline = time.time() + seconds
    while time.time() < deadline and predicate():
        time.sleep(0.05)
    return not predicate()


def test_data_dir_is_read_only_and_survives_deletion(crab, baseline):
    before = _digest(crab.root)
    code = '''
import os, shutil
d = os.environ["DATA_DIR"]
errs = []
for attempt in (lambda: shutil.rmtree(d), lambda: open(os.path.join(d, "train.csv"), "w").write("x"),
                lambda: os.remove(os.path.join(d, "test.csv")), lambda: os.rename(d, d + "2")):
    try:
        attempt()
    except OSError as e:
        errs.append(type(e).__name__)
print("blocked", len(errs))
'''
    r = sandbox.run_solution(crab, code, timeout_s=60)
    assert r.status == "ran_no_sub" and "blocked 4" in r.feedback, r.feedback
    assert _digest(crab.root) == before
    _next_run_ok(crab, baseline)


def test_each_run_gets_a_fresh_working_dir(crab, baseline):
    r = sandbox.run_solution(crab, "import os\nopen('left_behind.txt', 'w').write('x')\nprint('cwd', os.getcwd())\n",
                             timeout_s=60)
    assert "cwd /sandbox/work" in r.feedback
    r = sandbox.run_solution(crab, "import os\nprint('listing', sorted(os.listdir('.')))\n", timeout_s=60)
    assert "listing []" in r.feedback, r.feedback


def test_private_answers_and_host_files_are_invisible(crab, baseline):
    probes = [str(crab.answer_path), str(crab.root / "data" / "private"), str(FIX), "/work", "/root/.bashrc",
              "/etc/passwd", "/etc/hostname", "/root/.pyenv/version", "/tmp/pytest-of-root"]
    code = f'''
import os
seen = [p for p in {probes!r} if os.path.exists(p)]
print("visible", seen)
print("roots", sorted(os.listdir("/")))
'''
    r = sandbox.run_solution(crab, code, timeout_s=60)
    assert "visible []" in r.feedback, r.feedback
    roots = set(ast.literal_eval(re.search(r"roots (\[.*?\])", r.feedback).group(1)))
    # The sandbox's own mounts, the host's system folders, and whatever top-level
    # folders the interpreter lives under (/root for pyenv, /opt for conda, ...)
    # — derived here from sys and the file system, not from the sandbox's code.
    own = {"dev", "etc", "proc", "sandbox", "tmp", "usr"}
    system = {top for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32") if os.path.exists("/" + top)}
    python = {p.split("/")[1] for p in (sys.prefix, sys.base_prefix, sys.executable,
                                         os.path.realpath(sys.executable), os.path.realpath(sys.prefix))}
    assert own <= roots and roots <= own | system | python, (sorted(roots), sorted(own | system | python))


def test_submission_symlink_to_the_answers_scores_nothing(crab, baseline):
    # Even knowing the host path of the answers, a link to it is not graded as a submission.
    code = f"import os\nos.symlink({str(crab.answer_path)!r}, os.environ['SUBMISSION_PATH'])\n"
    r = sandbox.run_solution(crab, code, timeout_s=60)
    assert (r.status, r.reward) == ("ran_no_sub", 0.2) and "regular file" in r.feedback, r.feedback


def test_no_network_not_even_host_loopback(crab, baseline):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.3)
    port = srv.getsockname()[1]
    code = f'''
import socket
import subprocess
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("CONNECTED")
except OSError as e:
    print("refused", type(e).__name__)
'''
    try:
        r = sandbox.run_solution(crab, code, timeout_s=60)
        assert "refused" in r.feedback and "CONNECTED" not in r.feedback, r.feedback
        with pytest.raises(socket.timeout):
            srv.accept()   # nothing ever reached the host's server
    finally:
        srv.close()
    _next_run_ok(crab, baseline)


def test_no_writes_outside_the_working_dir(crab, baseline):
    token = secrets.token_hex(8)
    host_tmp = pathlib.Path("/tmp") / f"wmrl-escape-{token}"
    code = f'''
import os
ok = []
for path in ("/tmp/wmrl-escape-{token}", "/usr/escape-{token}", "/escape-{token}", "/sandbox/escape-{token}",
             "/etc/escape-{token}"):
    try:
        open(path, "w").write("x")
        ok.append(path)
    except OSError:
        pass
print("written", ok)
'''
    r = sandbox.run_solution(crab, code, timeout_s=60)
    # Only the sandbox's private /tmp takes writes; the host's /tmp does not see them.
    assert f"written ['/tmp/wmrl-escape-{token}']" in r.feedback, r.feedback
    assert not host_tmp.exists()
    _next_run_ok(crab, baseline)


DAEMON = '''
import os, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "{token}-a"],
                 start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(120)", "{token}-b"])
    os._exit(0)
import time
time.sleep(0.5)
print("spawned")
'''


@pytest.mark.parametrize("tail,status", [("", "ran_no_sub"), ("time.sleep(60)\n", "runtime_err")])
def test_daemons_die_when_the_run_returns_or_times_out(crab, baseline, tail, status):
    token = "wmrl-daemon-" + secrets.token_hex(6)
    r = sandbox.run_solution(crab, DAEMON.format(token=token) + tail, timeout_s=3)
    assert r.status == status, r.feedback
    assert _wait_gone(lambda: _processes_with(token)), f"survivors: {_processes_with(token)}"
    _next_run_ok(crab, baseline)


def test_fork_storm_is_capped_and_cleaned_up(crab, baseline):
    code = '''
import os, time
n = 0
t = time.time()
while time.time() - t < 30:
    try:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
    except OSError:
        time.sleep(0.01)
'''
    limits = isolation.Limits(timeout_s=2.5, max_procs=24)
    r = sandbox.run_solution(crab, code, limits=limits)
    assert r.status == "runtime_err" and r.error_type == "TimeoutError"
    uid = r.isolation["uid"]
    assert uid is not None and r.isolation["nproc_enforced"]
    assert _wait_gone(lambda: isolation._pids_of_uid(uid)), "processes of the run's uid survived"
    _next_run_ok(crab, baseline)


def test_memory_limit(crab, baseline):
    r = sandbox.run_solution(crab, "x = bytearray(1024 * 1024 * 1024)\nprint(len(x))\n", timeout_s=60, memory_mb=300)
    assert (r.status, r.error_type, r.error_line) == ("runtime_err", "MemoryError", 1), r.feedback
    _next_run_ok(crab, baseline)


def test_file_size_and_open_file_limits(crab, baseline):
    limits = isolation.Limits(timeout_s=60, max_file_mb=2, max_open_files=40)
    r = sandbox.run_solution(crab, "open('big.bin', 'wb').write(b'x' * (8 << 20))\n", limits=limits)
    assert r.status == "runtime_err" and r.error_type == "OSError" and "File too large" in r.feedback, r.feedback
    r = sandbox.run_solution(crab, "fs = [open('f%d' % i, 'w') for i in range(200)]\n", limits=limits)
    assert r.status == "runtime_err" and "Too many open files" in r.feedback, r.feedback
    _next_run_ok(crab, baseline)


def test_rlimits_and_thread_caps_are_in_force(crab):
    code = '''
import os
print(open("/proc/self/limits").read())
print("threads", [os.environ[k] for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "LOKY_MAX_CPU_COUNT")])
print("uid", os.getuid(), "pid", os.getpid())
'''
    limits = isolation.Limits(timeout_s=30, memory_mb=1500, cpus=2, max_procs=50, max_file_mb=7, max_open_files=77)
    r = sandbox.run_solution(crab, code, limits=limits, feedback_chars=20000)
    soft = dict(re.findall(r"^(Max [a-z ]+?)\s{2,}(\S+)", r.feedback, re.M))
    assert soft["Max address space"] == str(1500 << 20)
    assert soft["Max cpu time"] == "61"                # timeout * cpus + 1
    assert soft["Max processes"] == "50"
    assert soft["Max file size"] == str(7 << 20)
    assert soft["Max open files"] == "77"
    assert soft["Max core file size"] == "0"
    assert "threads ['2', '2', '2', '2']" in r.feedback
    # An unprivileged, per-run uid, in its own pid namespace (init, the timing shell, then python).
    uid, pid = map(int, re.search(r"uid (\d+) pid (\d+)", r.feedback).groups())
    assert uid == r.isolation["uid"] and uid != 0 and pid <= 3


def test_blas_and_joblib_see_the_cpu_cap(crab):
    # What sklearn's n_jobs=-1 and numpy's BLAS will actually use, not just the env vars.
    code = """
import joblib, numpy, threadpoolctl
print("joblib", joblib.cpu_count(), "effective", joblib.effective_n_jobs(-1))
print("blas", sorted({p["num_threads"] for p in threadpoolctl.threadpool_info()}))
"""
    r = sandbox.run_solution(crab, code, timeout_s=120, cpus=2)
    assert "joblib 2 effective 2" in r.feedback and "blas [2]" in r.feedback, r.feedback


def test_unreadable_task_data_is_staged(crab, baseline, tmp_path):
    dst = tmp_path / "private-perms"
    shutil.copytree(crab.root, dst)
    os.chmod(dst / "data" / "public", 0o700)
    task = sandbox.load_task(dst)
    assert runner.mountable_data_dir(task) != str(task.public_dir)
    r = sandbox.run_solution(task, GOOD, timeout_s=60)
    assert r.status == "valid" and r.raw_score == baseline.raw_score


def test_without_bwrap_a_process_prints_one_line_saying_what_is_lost(crab):
    """Several runs (a training step's pool) print the fallback's warning once, on one line."""
    code = ("import sys, sandbox\n"
            "task = sandbox.load_task(sys.argv[1])\n"
            "for _ in range(3):\n"
            "    r = sandbox.run_solution(task, sys.argv[2], timeout_s=60)\n"
            "    print(r.status, r.isolation['backend'])\n")
    proc = subprocess.run([sys.executable, "-c", code, str(crab.root), GOOD], capture_output=True, text=True,
                          timeout=300, cwd=pathlib.Path(__file__).resolve().parents[1],
                          env={**os.environ, "WMRL_SANDBOX_NO_BWRAP": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:3] == ["valid rlimits-only"] * 3, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "WITHOUT namespaces" in lines[0] and "network" in lines[0] and lines[0].endswith(
        "Install it: apt-get install bubblewrap"), lines[0]


def test_fallback_without_bwrap_warns_and_still_contains(crab, baseline, monkeypatch):
    monkeypatch.setenv("WMRL_SANDBOX_NO_BWRAP", "1")
    monkeypatch.setattr(isolation, "_NO_BWRAP_WARNED", __import__("threading").Event())   # warned once a process
    before = _digest(crab.root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = sandbox.run_solution(crab, GOOD + "\nimport shutil\nshutil.rmtree(os.environ['DATA_DIR'])\n",
                                 timeout_s=60)
    assert any("WITHOUT namespaces" in str(w.message) for w in caught)
    assert r.isolation["backend"] == "rlimits-only" and r.isolation["network"] == "host"
    assert r.status == "valid", r.feedback          # it deleted a private copy
    assert _digest(crab.root) == before
    r = sandbox.run_solution(crab, "import time\ntime.sleep(30)\n", timeout_s=1)
    assert r.error_type == "TimeoutError" and r.isolation["backend"] == "rlimits-only"
    monkeypatch.delenv("WMRL_SANDBOX_NO_BWRAP")
    _next_run_ok(crab, baseline)
