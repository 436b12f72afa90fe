"""Shared pieces of the sandbox tests: a light valid solution and a writable copy of a fixture task."""

import os
import pathlib
import shutil

import sandbox

FIX = pathlib.Path(__file__).parent / "fixtures"

# csv module only: a sandboxed python start costs ~0.3 s here, pandas/sklearn ~1 s more.
GOOD = '''
import csv, os
rows = list(csv.DictReader(open(os.path.join(os.environ["DATA_DIR"], "test.csv"))))
with open(os.environ["SUBMISSION_PATH"], "w") as f:
    f.write("id,Age\\n")
    for r in rows:
        f.write(f"{r['id']},{3 + 6 * float(r['Length'])}\\n")
print("wrote", len(rows), "rows")
'''


def copy_task(dst: pathlib.Path, name: str = "playground-series-s3e16") -> sandbox.Task:
    """A world-readable copy of a fixture competition (mounted directly, not staged)."""
    shutil.copytree(FIX / "mle-dojo" / name, dst)
    for d, _, _ in os.walk(dst):
        os.chmod(d, 0o755)
    return sandbox.load_task(dst)
