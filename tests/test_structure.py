"""evalkit's code stays in pieces a reader can hold: no module over MAX_MODULE_LINES lines and no function
(methods and nested functions included) whose body is over MAX_FUNCTION_LINES, counted from the first line of
its body (its docstring included) to the last, as `ast` gives them. The signature is not counted: a typer
command's lists its options there, one a line. Issue #50, item 5."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "evalkit"
MAX_MODULE_LINES = 350
MAX_FUNCTION_LINES = 60


def oversized(source: str, module: str) -> list[str]:
    """What in `source` (the module `module`, relative to evalkit/) is over the limits, one line each:
    the module itself, then each function by line number."""
    found = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{module}: {lines} lines (at most {MAX_MODULE_LINES})")
    functions = [node for node in ast.walk(ast.parse(source))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in sorted(functions, key=lambda node: node.lineno):
        length = node.end_lineno - node.body[0].lineno + 1
        if length > MAX_FUNCTION_LINES:
            found.append(f"{module}:{node.lineno} {node.name}: {length} lines (at most {MAX_FUNCTION_LINES})")
    return found


def test_no_module_and_no_function_of_evalkit_is_too_long():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 50  # the package itself, not an empty folder
    found = [line for path in modules
             for line in oversized(path.read_text(encoding="utf-8"), path.relative_to(PACKAGE).as_posix())]
    assert not found, "split these (issue #50):\n" + "\n".join(found)


def function(name: str, lines: int, indent: str = "", parameters: int = 0) -> str:
    """The source of a function `name` whose body spans `lines` lines, its signature `parameters` lines more."""
    signature = f"def {name}(\n" + "".join(f"    p{i}=0,\n" for i in range(parameters)) + "):\n" if parameters \
        else f"def {name}():\n"
    body = "".join(f"    x{i} = {i}\n" for i in range(lines))
    return textwrap.indent(signature + body, indent)


def test_the_checker_finds_a_long_module_and_long_functions_at_any_depth():
    too_long = MAX_FUNCTION_LINES + 1
    source = (function("long_function", too_long) + function("short_enough", MAX_FUNCTION_LINES)
              + "class Holder:\n" + function("long_method", too_long, "    ")
              + "def outer():\n" + function("long_nested", too_long, "    ") + "    return long_nested\n")
    source += "\n" * (MAX_MODULE_LINES + 1 - len(source.splitlines()))
    found = oversized(source, "dummy.py")
    assert found[0] == f"dummy.py: {MAX_MODULE_LINES + 1} lines (at most {MAX_MODULE_LINES})"
    assert [line.split()[1] for line in found[1:]] == ["long_function:", "long_method:", "outer:", "long_nested:"]
    assert f"long_nested: {too_long} lines" in found[-1] and f"outer: {too_long + 2} lines" in found[-2]
    assert oversized(source[:source.index("def short_enough")], "dummy.py") == [found[1]]  # a short module


def test_a_long_signature_is_not_counted():
    assert oversized(function("command", MAX_FUNCTION_LINES, parameters=40), "cli.py") == []
    assert oversized(function("command", too_long := MAX_FUNCTION_LINES + 1, parameters=40), "cli.py") == \
        [f"cli.py:1 command: {too_long} lines (at most {MAX_FUNCTION_LINES})"]
