"""run.py's shape: it reads top to bottom, each section under the ruler its docstring names."""

import ast
import re

from helpers import ROOT

SOURCE = (ROOT / "run.py").read_text()


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
                if isinstance(sub, ast.Name) and sub.id not in local and defined.get(sub.id, 0) > node.lineno:
                    early.add(f"{node.name} (line {node.lineno}) uses {sub.id} (line {defined[sub.id]})")
    assert not early, sorted(early)


def test_each_section_the_docstring_names_is_under_its_ruler_in_that_order():
    listed = re.search(r"one ruler per section: (.*?)\. Importing", SOURCE, re.S).group(1)
    sections = [name.strip().removeprefix("and ") for name in listed.replace("\n", " ").split(",")]
    rulers = re.findall(r"^# -{90,}\n# ([^.:]+)[.:]", SOURCE, re.M)
    assert [r.lower() for r in rulers] == [s.lower() for s in sections]


def test_ci_runs_exactly_the_test_command_the_readme_gives():
    readme = (ROOT / "README.org").read_text()
    command = re.search(r"\* Tests\n\n#\+begin_src sh\n.*?\n(.*?)\n#\+end_src", readme, re.S).group(1)
    assert command.strip() in (ROOT / ".ci" / "run").read_text().splitlines()
