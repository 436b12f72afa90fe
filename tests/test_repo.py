"""Repository contracts: the README's commands and snippet, CI, design citations, import hygiene."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "README.md must open with a ```bash block holding the two commands"
    lines = [l.strip() for l in block.group(1).splitlines() if l.strip()]
    assert len(lines) == 2, f"README.md's first block must hold exactly two commands, got {lines}"
    return lines


def test_readme_test_command_is_what_ci_runs():
    _, test_cmd = _readme_commands()
    ci = (ROOT / ".ci" / "run").read_text()
    m = re.search(r'^TEST_CMD="(.*)"$', ci, re.M)
    assert m, ".ci/run must define TEST_CMD"
    assert m.group(1) == test_cmd, f".ci/run runs {m.group(1)!r}, README says {test_cmd!r}"
    assert "pytest" in test_cmd
    # The README's command leaves out the end-to-end tests marked slow; CI runs them after it.
    slow = re.search(r'^SLOW_CMD="(.*)"$', ci, re.M)
    assert "-m 'not slow'" in test_cmd and slow and "-m slow" in slow.group(1), \
        "the README's command deselects the slow tests, so .ci/run must run them (SLOW_CMD, -m slow)"
    assert re.search(r'^run_tests "\$TEST_CMD"$', ci, re.M) and re.search(r'^run_tests "\$SLOW_CMD"$', ci, re.M)


def test_readme_main_command_names_an_existing_script():
    main_cmd, _ = _readme_commands()
    scripts = re.findall(r"python (launch/\S+\.py)", main_cmd)
    assert scripts, f"main command {main_cmd!r} runs no launch/ script"
    for s in scripts:
        assert (ROOT / s).is_file(), f"README's main command runs {s}, which does not exist"


def test_pure_modules_import_only_jax_chex_numpy():
    """`losses` and `corrections` are importable by other JAX projects with jax/chex only."""
    code = (
        "import sys, wmrl_jax.losses, wmrl_jax.corrections\n"
        "bad = [m for m in ('torch', 'transformers', 'sandbox', 'flax', 'optax', 'orbax',"
        " 'pandas', 'sklearn', 'wmrl_jax.models', 'wmrl_jax.sampling') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"pure modules pulled in: {out.stdout.strip()}"


def test_sandbox_never_imports_jax():
    for path in (ROOT / "sandbox").rglob("*.py"):
        src = path.read_text()
        assert not re.search(r"^\s*(import jax|from jax)", src, re.M), f"{path} imports jax"


def _design_headings():
    text = (ROOT / "docs" / "design.md").read_text()
    return {m.group(1).strip() for m in re.finditer(r"^#{2,4} (.+)$", text, re.M)}


def test_design_citations_name_existing_sections():
    """`docs/design.md, "Section"` in any source file names a heading of docs/design.md."""
    headings = _design_headings()
    assert {"Semantics of the corrections", "Calibration fit", "Online debiaser", "Inverse-variance weight",
            "Order within a step", "Advantages", "Anchor schedule", "Reward ladder", "Position score", "avg@8",
            "Paper hyper-parameters"} <= headings, sorted(headings)
    cited = []
    for path in [*ROOT.glob("wmrl_jax/**/*.py"), *ROOT.glob("sandbox/**/*.py"), *ROOT.glob("launch/*.py"),
                 *ROOT.glob("tests/*.py"), ROOT / "README.md"]:
        if path.name == "test_repo.py":   # its own docstring shows the form
            continue
        text = path.read_text()
        for m in re.finditer(r'docs/design\.md,?\s+"([^"\n]+)"((?:\s+and\s+"[^"\n]+")*)', text):
            for name in [m.group(1), *re.findall(r'"([^"\n]+)"', m.group(2))]:
                cited.append((path.relative_to(ROOT), name))
    assert cited, "no docstring cites docs/design.md"
    missing = [(str(p), name) for p, name in cited if name not in headings]
    assert not missing, f"citations of sections docs/design.md does not have: {missing}; headings: {sorted(headings)}"


def test_readme_sandbox_snippet_runs_as_written(tmp_path):
    """The `import sandbox` lines of "Using the pieces", run verbatim from another folder."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Using the pieces\n+```python\n(.*?)```", text, re.S)
    assert block, "README.md: no ```python block under '## Using the pieces'"
    start = block.group(1).find("import sandbox, sandbox.suite")
    assert start >= 0, "README.md's 'Using the pieces' block has no `import sandbox, sandbox.suite` line"
    snippet = block.group(1)[start:]
    assert "DATA_DIR" in snippet and "SUBMISSION_PATH" in snippet and "bubblewrap" in snippet
    out = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    task_line, result_line = out.stdout.strip().splitlines()
    print(task_line, result_line, sep="\n")
    assert task_line.startswith("Task(name='iris_species', layout='mle-dojo', metric='accuracy'"), task_line
    assert "status='valid'" in result_line and len(result_line) < 250, result_line


def test_markdown_relative_links_resolve():
    """Every relative link in README.md and docs/*.md names a file of the repository (anchors aside)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    checked, broken = 0, []
    for page in pages:
        for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue   # http(s):, mailto:, same-page anchors
            path = (page.parent / target.split("#", 1)[0]).resolve()
            checked += 1
            if not (path.is_relative_to(ROOT) and path.exists()):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert checked, "no relative links found: the pattern no longer matches the pages"
    assert not broken, f"relative links to files that do not exist: {broken}"


def test_docs_reference_nothing_outside_the_repository():
    """README.md and docs/ name no file outside the repository (the project's notes live elsewhere)."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        for bad in ("shared/", "MISSION.md", "DESIGN.md"):
            assert bad not in text, f"{page.relative_to(ROOT)} names {bad!r}, which is not in the repository"


# Imported by the code but deliberately not in `dependencies`, and where each comes from instead.
_NOT_DEPENDENCIES = {
    "ray": "the [ray] extra (sandbox.backend='ray'; imported only when that backend is built)",
    "mledojo": "sandbox/mledojo_shim, put on the solution's path inside the sandbox",
}
# Needed at run time by a dependency that does not declare it: transformers' apply_chat_template
# (wmrl_jax/chat.py) raises ImportError without jinja2, and only the [test] extra's torch brought it in.
_UNDECLARED_BY_DEPENDENCIES = {"jinja2"}


def _declared(requirements) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def _third_party_imports(paths) -> dict[str, str]:
    """{top-level module: a file importing it} over every import statement (module level or lazy) of
    `paths` (files, or folders searched recursively); our own packages and launch/'s helpers excluded."""
    import ast

    # simulator/ is ours too (the same distribution; wmrl_jax.vla.demos reads its Episode files).
    ours = {"wmrl_jax", "sandbox", "simulator", "configs", *(p.stem for p in (ROOT / "launch").glob("*.py"))}
    found = {}
    for path in paths:
        path = ROOT / path
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            for node in ast.walk(ast.parse(file.read_text(), str(file))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in ours:
                        found.setdefault(top, str(file.relative_to(ROOT)))
    return found


def test_every_import_of_the_package_is_a_declared_dependency():
    """`pip install -e .` alone runs the README's first command: each third-party module that wmrl_jax/,
    sandbox/, configs/, launch/train.py or launch/eval.py imports belongs to a distribution in
    `dependencies`, not only to the [test] extra (which installs torch, and torch installs jinja2)."""
    import importlib.metadata
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _declared(project["dependencies"])
    assert _UNDECLARED_BY_DEPENDENCIES <= declared, (
        f"pyproject dependencies lack {sorted(_UNDECLARED_BY_DEPENDENCIES - declared)}: needed at run time by "
        "transformers' chat templates, which do not declare them")
    assert "ray" in _declared(project["optional-dependencies"]["ray"])
    dists = importlib.metadata.packages_distributions()
    imports = _third_party_imports(["wmrl_jax", "sandbox", "configs", "launch/train.py", "launch/eval.py"])
    missing = []
    for top, where in sorted(imports.items()):
        if top in _NOT_DEPENDENCIES:
            continue
        names = {d.lower().replace("_", "-") for d in dists.get(top, [])}
        assert names, f"{where} imports {top!r}, which no installed distribution provides"
        if not names & declared:
            missing.append(f"{top} ({where}; distribution {sorted(names)})")
    assert not missing, f"imported but not in pyproject's dependencies: {missing}; declared: {sorted(declared)}"
