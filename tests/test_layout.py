"""The layout: run.py is the method, read top to bottom, each section under the ruler its docstring
names, nothing used above its definition; the tools beside it (egg/) never import it nor read its
objects; bench.py and the scripts import it; importing run.py does nothing."""

import ast
import re
import subprocess
import sys

from helpers import ROOT

SOURCE = (ROOT / "run.py").read_text()
PACKAGE = sorted((ROOT / "egg").glob("*.py"))


def bound_inside(node: ast.AST) -> set[str]:
    """Names a function or class binds itself: its arguments, assignments, loop targets, imports,
    comprehension variables, and (a class) its fields."""
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.arg):
            names.add(sub.arg)
        elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
            names.add(sub.id)
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in sub.names}
        elif isinstance(sub, (ast.FunctionDef, ast.ClassDef)) and sub is not node:
            names.add(sub.name)
    return names


def test_nothing_is_used_above_its_definition_except_from_main():
    tree = ast.parse(SOURCE)
    defined = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.setdefault(node.name, node.lineno)
        for target in getattr(node, "targets", [getattr(node, "target", None)]):
            for name in ast.walk(target) if target is not None else ():
                if isinstance(name, ast.Name):
                    defined.setdefault(name.id, node.lineno)
    early = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name != "main":
            local = bound_inside(node)
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Name)
                    and sub.id not in local
                    and defined.get(sub.id, 0) > node.lineno
                ):
                    early.add(
                        f"{node.name} (line {node.lineno}) uses {sub.id} (line {defined[sub.id]})"
                    )
    assert not early, sorted(early)


def test_each_section_the_docstring_names_is_under_its_ruler_in_that_order():
    listed = re.search(r"one ruler per section: (.*?)\. Importing", SOURCE, re.S).group(1)
    sections = [name.strip().removeprefix("and ") for name in listed.replace("\n", " ").split(",")]
    rulers = re.findall(r"^# -{90,}\n# ([^.:]+)[.:]", SOURCE, re.M)
    assert [r.lower() for r in rulers] == [s.lower() for s in sections]


def imported(path) -> set[str]:
    """The top-level names of every module a file imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_dependencies_point_one_way_and_the_docstrings_name_the_files():
    """Nothing run.py imports imports it (under python run.py the file is __main__: an import of run
    would load a second copy); bench.py imports it. egg/__init__.py names every module of the
    package, run.py's docstring the files beside it."""
    for path in PACKAGE:
        assert not imported(path) & {"run", "bench", "compare"}, path.name
        # nor does it read run.py's flags or configuration field by field: they reach it as values
        assert not re.findall(r"\b(?:args|cfg)\.\w+", path.read_text()), path.name
    assert "run" in imported(ROOT / "bench.py") and "egg" in imported(ROOT / "run.py")
    listing = ast.get_docstring(ast.parse((ROOT / "egg" / "__init__.py").read_text()))
    assert all(path.name in listing for path in PACKAGE if path.name != "__init__.py")
    docstring = ast.get_docstring(ast.parse(SOURCE))
    assert all(
        name in docstring for name in ("egg/", "bench.py", "compare.py", "scripts/", "baselines/")
    )


def test_importing_run_does_nothing():
    """No output, no JAX backend started, nothing written."""
    code = "import run, jax._src.xla_bridge as b; print(sorted(b._backends))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert (result.returncode, result.stdout, result.stderr) == (0, "[]\n", ""), result.stderr[
        -2000:
    ]


def test_ci_runs_exactly_the_test_command_the_readme_gives():
    readme = (ROOT / "README.org").read_text()
    command = re.search(r"\* Tests\n\n#\+begin_src sh\n.*?\n(.*?)\n#\+end_src", readme, re.S).group(
        1
    )
    assert command.strip() in (ROOT / ".ci" / "run").read_text().splitlines()
