"""The calculator tool's function (tool_workflow's `calculator`, workflows/tool_use.py): arithmetic read with
`ast.parse` and computed node by node, never evaluated as Python. Standard-library imports only: a tool worker
process loads this file alone (workflows/tool_workers.py), in milliseconds.

    calculate("37 + 58 - 12") -> "83";  calculate("7 / 2") -> "3.5";  calculate("__import__('os')") -> ValueError
"""

from __future__ import annotations

import ast
import operator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression of numbers, + - * / and parentheses, read with `ast.parse` and
    computed node by node (never evaluated as Python): "37 + 58 - 12" -> "83", "7 / 2" -> "3.5"."""
    if len(expression) > 200:
        raise ValueError("the expression is longer than 200 characters")

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except SyntaxError as e:
        raise ValueError(f"not an expression: {expression!r}") from e
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"
