"""No module of flexoff passes 500 lines, and no function passes 60 unless it says why it cannot
be split.

A function's length runs from its ``def`` line (decorators excluded) to its last line; every
``def`` and ``async def`` counts, methods and nested functions too. A function longer than 60
lines passes only with a comment ``# long: <why it cannot be split>`` in its head: on a line from
the ``def`` line up to the first statement of its body that is not its docstring, e.g.::

    def kernel(...):
        # long: one compiled program; its steps share the block's offsets and masks
        ...

The comments are read with ``tokenize``, so the words ``# long:`` inside a string do not count.
Each offender is listed as ``path:line name N lines``.
"""

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flexoff"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60
WHY_LONG = re.compile(r"#\s*long:\s*\S")


def comment_lines(text: str) -> dict[int, str]:
    """Each comment of ``text`` by its line number."""
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return {token.start[0]: token.string for token in tokens if token.type == tokenize.COMMENT}


def head_end(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The last line of a function's head: the line before its first statement that is not its
    docstring (the function's last line where the docstring is all there is)."""
    body = node.body
    first = body[0]
    is_docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
        and isinstance(first.value.value, str)
    if not is_docstring:
        return first.lineno - 1
    return body[1].lineno - 1 if len(body) > 1 else node.end_lineno


def says_why_long(node: ast.FunctionDef | ast.AsyncFunctionDef, comments: dict[int, str]) -> bool:
    return any(WHY_LONG.match(comments.get(line, "")) for line in range(node.lineno, head_end(node) + 1))


def functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function in ``tree``, nested ones as ``outer.inner``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from functions(node, name + ".")
        else:
            yield from functions(node, prefix)


def offenders(root: Path) -> list[str]:
    """``path:line name N lines`` for each file of ``root`` over 500 lines and each function over
    60 lines without its why-comment; paths relative to ``root``'s parent."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        shown = path.relative_to(root.parent).as_posix()
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            found.append(f"{shown}:1 (file) {lines} lines")
        comments = comment_lines(text)
        for name, node in functions(ast.parse(text, str(path))):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES and not says_why_long(node, comments):
                found.append(f"{shown}:{node.lineno} {name} {length} lines")
    return found


def test_no_long_file_and_no_long_function_without_its_reason():
    found = offenders(PACKAGE)
    assert not found, "too long (split it, or say why not with '# long: <why>'):\n" + "\n".join(found)


def body(lines: int, indent: str = "    ") -> str:
    return "".join(f"{indent}x{i} = {i}\n" for i in range(lines))


def test_the_check_catches_a_long_function_and_a_long_file_and_accepts_a_reason(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    # 1 def line + 60 body lines: 61 lines, one over; the nested one and the method too.
    (package / "long_function.py").write_text(
        "import functools\n\n\n"
        "@functools.cache\n"
        "def too_long():\n" + body(60) + "\n\n"
        "def just_fits():\n" + body(59) + "\n\n"
        "class Holder:\n"
        "    async def method(self):\n" + body(60, " " * 8) + "\n\n"
        "def outer():\n"
        "    def inner():\n" + body(60, " " * 8) + "    return inner\n")
    (package / "sub" / "long_file.py").write_text("x = 1\n" * 501)
    (package / "sub" / "fits.py").write_text("x = 1\n" * 500)
    (package / "reasoned.py").write_text(
        "def with_reason():\n"
        '    """A docstring."""\n'
        "    # long: one compiled program, tested where it runs\n" + body(60) + "\n\n"
        "def reason_in_a_string():\n"
        '    """# long: a string, not a comment"""\n' + body(60) + "\n\n"
        "def reason_too_late():\n"
        "    x = 0\n"
        "    # long: below the first statement\n" + body(60) + "\n\n"
        "def reason_without_words():\n"
        "    # long:\n" + body(60))
    assert offenders(package) == [
        "pkg/long_function.py:5 too_long 61 lines",
        "pkg/long_function.py:131 Holder.method 61 lines",
        "pkg/long_function.py:194 outer 63 lines",
        "pkg/long_function.py:195 outer.inner 61 lines",
        "pkg/reasoned.py:66 reason_in_a_string 62 lines",
        "pkg/reasoned.py:130 reason_too_late 63 lines",
        "pkg/reasoned.py:195 reason_without_words 62 lines",
        "pkg/sub/long_file.py:1 (file) 501 lines",
    ]
