"""Issue 17's size rule, checked: no function over 80 lines and no class over 200 in lora_kernels/ (Python, by
the AST) or csrc/ (C++/CUDA function bodies, by brace matching)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION, MAX_CLASS = 80, 200


def test_python_functions_and_classes_are_short():
    long = []
    for path in sorted((ROOT / "lora_kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, long


# A function definition: a line ending in ')' or ') const' etc. followed by '{', at namespace or class depth.
_SIGNATURE = re.compile(r"^[A-Za-z_].*\)\s*(const)?\s*(noexcept)?\s*\{\s*$")


def _function_lengths(text: str):
    """(line, length) of each function body whose opening line looks like a signature ending in '{'."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not _SIGNATURE.match(line.strip()) or line.strip().startswith(("if", "for", "while", "switch", "} else")):
            continue
        depth = 0
        for j in range(i, len(lines)):
            depth += lines[j].count("{") - lines[j].count("}")
            if depth == 0:
                yield i + 1, j - i + 1
                break


def test_cpp_functions_are_short():
    long = []
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.suffix not in (".cu", ".cuh", ".cpp", ".h"):
            continue
        for line, length in _function_lengths(path.read_text()):
            if length > MAX_FUNCTION:
                long.append(f"{path.relative_to(ROOT)}:{line} ({length} lines)")
    assert not long, long
