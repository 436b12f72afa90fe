"""`run_solution`: one untrusted solution, isolated, executed, graded, rewarded, explained.

The order matters for cost: text that holds no code, and code that does not
compile, are classified before anything is launched (`compile()` is the same
gate the world model uses). Only then does a sandbox start (see `isolation`),
and only a clean exit is graded — as in MLE-Dojo, a run that crashed after
writing a submission is a runtime error.

The contract callers rely on: `run_solution` never raises because of what the
code does; an outcome we could not establish (the sandbox or the grader broke)
is status "unknown" with reward None, never 0.0.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import os
import pathlib
import re
import shutil
import signal
import tempfile
import threading
from typing import Mapping

from sandbox import grading, isolation
from sandbox.tasks import Task

# The shipped task suite, answers included: in a non-editable install it sits
# inside site-packages, which the sandbox mounts for the interpreter.
_EMBEDDED_SUITE = pathlib.Path(__file__).resolve().parent / "suite" / "embedded"

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.S)


@dataclasses.dataclass(frozen=True)
class ExecutionResult:
    """Outcome of one real execution.

    status: "malformed" | "syntax_err" | "runtime_err" | "ran_no_sub" | "valid" | "unknown".
    reward: the ladder (0.0 / 0.1 / 0.2 / 0.5 + 0.5*pos); None only for "unknown".
    raw_score: the metric value of a valid submission (else None).
    position_score: MLE-Dojo position score in [0, 1] of a valid submission (else None).
    error_type: exception class name ("TimeoutError" for the time limit), or the
      grader's error class for an invalid submission.
    error_line: line of solution.py where the error was raised (1-based), if known.
    feedback: the text the agent reads next turn (MLE-Dojo style, trimmed).
    wall_s / cpu_s: wall-clock and CPU seconds of the sandboxed process tree.
    isolation: what was actually enforced (backend, namespaces, rlimits, uid).
    """

    task_id: str
    code_sha256: str
    status: str
    reward: float | None
    raw_score: float | None = None
    position_score: float | None = None
    error_type: str | None = None
    error_line: int | None = None
    feedback: str = ""
    wall_s: float = 0.0
    cpu_s: float = 0.0
    isolation: Mapping[str, object] = dataclasses.field(default_factory=dict)
    positions: Mapping[str, dict] | None = None
    cached: bool = False

    def __repr__(self) -> str:
        # One short line; the feedback (kilobytes of logs) and isolation details stay in the fields.
        def num(x):
            return "None" if x is None else repr(round(float(x), 4))

        error = "" if self.error_type is None else f", error={self.error_type}" + (
            f" at line {self.error_line}" if self.error_line is not None else "")
        return (f"ExecutionResult(task={self.task_id!r}, status={self.status!r}, reward={num(self.reward)}, "
                f"raw_score={num(self.raw_score)}, position={num(self.position_score)}{error}, "
                f"wall_s={self.wall_s:.2f}, cpu_s={self.cpu_s:.2f}, feedback={len(self.feedback)} chars"
                + (", cached" if self.cached else "") + ")")


def code_sha256(code) -> str:
    data = code.encode("utf-8", errors="surrogatepass") if isinstance(code, str) else repr(code).encode()
    return hashlib.sha256(data).hexdigest()


def extract_code(text) -> str | None:
    """The Python program in `text`, or None when there is none.

    Plain code is returned as is; a Markdown answer yields its last ```python
    block (else its last fenced block) — the agent's final program.
    """
    if not isinstance(text, str) or "\x00" in text:
        return None
    if "```" in text:
        blocks = _FENCE.findall(text)
        py = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
        chosen = py or [body for lang, body in blocks if not lang]
        text = chosen[-1] if chosen else ""
    return text if text.strip() else None


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why the sandbox launches nothing: no program ("malformed"), or one `compile()` rejects ("syntax_err")."""

    status: str                # "malformed" | "syntax_err"
    error_type: str            # "MalformedResponse", or the compile error's class ("SyntaxError", ...)
    error_line: int | None     # the compile error's line, when it has one
    detail: str                # "SyntaxError: message" for syntax_err; "" for malformed

    def feedback(self, max_chars: int = 3000) -> str:
        """The text the agent reads next turn: exactly what `run_solution` returns for this program."""
        # A refused program never ran, so no time limit appears in its text (timeout_s is unused).
        return grading.execution_feedback(status=self.status, wall_s=0.0, stdout="", stderr=self.detail, grade=None,
                                          error_type=self.error_type, timeout_s=0.0, max_chars=max_chars)


def check_before_launch(code) -> tuple[str | None, Refusal | None]:
    """(the program, None) when it may launch; else (the program or None, why not).

    The sandbox's deterministic checks, shared with the world model's gate
    (`wmrl_jax.world_model.gate`) so that both classify such code alike: no
    program in the answer (`extract_code`), or a program `compile()` rejects.
    """
    program = extract_code(code)
    if program is None:
        return None, Refusal("malformed", "MalformedResponse", None, "")
    try:
        compile(program, "solution.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:   # ValueError: e.g. source with null bytes
        return program, Refusal("syntax_err", type(e).__name__, getattr(e, "lineno", None), f"{type(e).__name__}: {e}")
    return program, None


_TB_FRAME = re.compile(r'File "[^"]*solution\.py", line (\d+)')
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::(?:\s|$)|$)")


def parse_traceback(stderr: str) -> tuple[str | None, int | None]:
    """(exception class name, solution.py line) of the last traceback in `stderr`."""
    at = stderr.rfind("Traceback (most recent call last):")
    if at < 0:
        return None, None
    block = stderr[at:]
    frames = _TB_FRAME.findall(block)
    line = int(frames[-1]) if frames else None
    for text in reversed(block.splitlines()[1:]):
        if not text or text[0].isspace() or text.startswith(("During handling", "The above exception")):
            continue
        m = _EXC_LINE.match(text)
        if m:
            return m.group(1).rsplit(".", 1)[-1], line
    return None, line


_SIGNAL_ERRORS = {
    signal.SIGXCPU: "CPUTimeLimitExceeded",
    signal.SIGXFSZ: "FileSizeLimitExceeded",
    signal.SIGSEGV: "SegmentationFault",
    signal.SIGABRT: "Aborted",
    signal.SIGKILL: "Killed",
}

# Staged world-readable copies of task data whose folders the run's uid cannot read.
_STAGED: dict[str, str] = {}
_STAGE_LOCK = threading.Lock()
_STAGED_ROOTS: list[str] = []


def _world_readable(root: pathlib.Path) -> bool:
    for dirpath, dirnames, filenames in os.walk(root):
        if os.stat(dirpath).st_mode & 0o005 != 0o005:
            return False
        for f in filenames:
            if os.stat(os.path.join(dirpath, f)).st_mode & 0o004 == 0:
                return False
    return True


def mountable_data_dir(task: Task) -> str:
    """`task.public_dir`, or a world-readable staged copy (the run's uid is unprivileged)."""
    src = str(task.public_dir)
    with _STAGE_LOCK:
        if src in _STAGED and os.path.isdir(_STAGED[src]):
            return _STAGED[src]
        if _world_readable(task.public_dir):
            _STAGED[src] = src
            return src
        stage_root = os.path.join(tempfile.gettempdir(), f"wmrl-sandbox-data-{os.getpid()}")
        if not _STAGED_ROOTS:
            atexit.register(shutil.rmtree, stage_root, True)
            _STAGED_ROOTS.append(stage_root)
        dst = os.path.join(stage_root, hashlib.sha1(src.encode()).hexdigest()[:16])
        if not os.path.isdir(dst):
            shutil.copytree(src, dst + ".part", dirs_exist_ok=True)
            for dirpath, _, filenames in os.walk(dst + ".part"):
                os.chmod(dirpath, 0o755)
                for f in filenames:
                    os.chmod(os.path.join(dirpath, f), 0o644)
            os.chmod(os.path.dirname(dst), 0o755)
            os.replace(dst + ".part", dst)
        _STAGED[src] = dst
        return dst


def _result(task, sha, status, *, raw=None, grade=None, error_type=None, error_line=None, feedback="",
            iso=None) -> ExecutionResult:
    pos = grade.position_score if grade is not None and grade.valid else None
    return ExecutionResult(
        task_id=task.task_id, code_sha256=sha, status=status, reward=grading.ladder_reward(status, pos),
        raw_score=grade.raw_score if grade is not None and grade.valid else None, position_score=pos,
        error_type=error_type, error_line=error_line, feedback=feedback,
        wall_s=raw.wall_s if raw else 0.0, cpu_s=raw.cpu_s if raw else 0.0,
        isolation=dict(iso or (raw.isolation if raw else {})),
        positions=grade.positions if grade is not None and grade.valid else None,
    )


def run_solution(task: Task, code, *, timeout_s: float = 600.0, memory_mb: int = 4096, cpus: int = 1,
                 limits: isolation.Limits | None = None, scratch_dir: str | None = None,
                 feedback_chars: int = 3000) -> ExecutionResult:
    """Execute `code` for `task` in a fresh sandbox and grade it.

    Args:
      task: from `load_task`.
      code: the solution (plain Python, or a Markdown answer holding a ```python block).
      timeout_s: wall-clock limit (the paper's sandbox cap is 600 s).
      memory_mb: address-space limit per process.
      cpus: threads for OMP/BLAS/loky; CPU-time budget is timeout_s * cpus.
      limits: full `isolation.Limits` (overrides the three above).
      scratch_dir: where run folders are created (default: the system temp dir).
      feedback_chars: budget of the feedback text.
    Returns:
      ExecutionResult; never raises because of the code's behaviour.
    """
    if not isinstance(task, Task):
        raise TypeError(f"task: expected a sandbox.Task (from load_task), got {type(task).__name__}")
    limits = limits or isolation.Limits(timeout_s=timeout_s, memory_mb=memory_mb, cpus=cpus)
    sha = code_sha256(code)
    program, refusal = check_before_launch(code)
    if refusal is not None:
        return _result(task, sha, refusal.status, error_type=refusal.error_type, error_line=refusal.error_line,
                       feedback=refusal.feedback(max_chars=feedback_chars))

    run_dir = tempfile.mkdtemp(prefix="wmrl-run-", dir=scratch_dir)
    try:
        try:
            data_dir = mountable_data_dir(task)
            raw = isolation.run_python(program, data_dir=data_dir, run_dir=run_dir, limits=limits,
                                       hidden=(str(task.root), str(_EMBEDDED_SUITE)))
        except Exception as e:   # the sandbox, not the code, failed
            return _result(task, sha, "unknown", error_type=type(e).__name__,
                           feedback=grading.execution_feedback(status="unknown", wall_s=0.0, stdout="",
                                                               stderr=f"{type(e).__name__}: {e}", grade=None,
                                                               error_type=None, timeout_s=limits.timeout_s))
        try:
            return _classify(task, sha, raw, run_dir, limits, feedback_chars)
        except Exception as e:   # grading broke on something unforeseen: unscored, not zero
            return _result(task, sha, "unknown", raw=raw, error_type=type(e).__name__,
                           feedback=grading.execution_feedback(status="unknown", wall_s=raw.wall_s, stdout="",
                                                               stderr=f"{type(e).__name__}: {e}", grade=None,
                                                               error_type=None, timeout_s=limits.timeout_s))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _classify(task, sha, raw: isolation.RawRun, run_dir: str, limits: isolation.Limits,
              feedback_chars: int) -> ExecutionResult:
    def feedback(status, grade=None, error_type=None):
        return grading.execution_feedback(status=status, wall_s=raw.wall_s, stdout=raw.stdout, stderr=raw.stderr,
                                          grade=grade, error_type=error_type, timeout_s=limits.timeout_s,
                                          max_chars=feedback_chars)

    infra = isolation.infrastructure_failure(raw)
    if infra:
        return _result(task, sha, "unknown", raw=raw, error_type="SandboxError",
                       feedback=grading.execution_feedback(status="unknown", wall_s=raw.wall_s, stdout="",
                                                           stderr=infra, grade=None, error_type=None,
                                                           timeout_s=limits.timeout_s))
    if raw.timed_out:
        _, line = parse_traceback(raw.stderr)
        return _result(task, sha, "runtime_err", raw=raw, error_type="TimeoutError", error_line=line,
                       feedback=feedback("runtime_err", error_type="TimeoutError"))
    if raw.exit_code != 0:
        error_type, line = parse_traceback(raw.stderr)
        if error_type is None:
            if raw.signal is not None:
                error_type = _SIGNAL_ERRORS.get(raw.signal, f"Signal{raw.signal}")
            else:
                error_type = "SystemExit"
        return _result(task, sha, "runtime_err", raw=raw, error_type=error_type, error_line=line,
                       feedback=feedback("runtime_err", error_type=error_type))
    grade = grading.grade_submission(task, os.path.join(run_dir, "work", "submission.csv"))
    if grade.infrastructure_error:
        return _result(task, sha, "unknown", raw=raw, grade=None, error_type="GraderError",
                       feedback=grading.execution_feedback(status="unknown", wall_s=raw.wall_s, stdout="",
                                                           stderr=grade.infrastructure_error, grade=None,
                                                           error_type=None, timeout_s=limits.timeout_s))
    status = "valid" if grade.valid else "ran_no_sub"
    return _result(task, sha, status, raw=raw, grade=grade, error_type=None if grade.valid else grade.error_type,
                   feedback=feedback(status, grade=grade))


__all__ = ["ExecutionResult", "code_sha256", "extract_code", "mountable_data_dir", "parse_traceback", "run_solution"]
