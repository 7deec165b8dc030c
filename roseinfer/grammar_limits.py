"""Depth limits checked before llguidance sees a grammar.

llguidance walks a grammar's rule references and a JSON Schema's `$ref`s recursively on the
calling thread's stack: a chain a few thousand rules long (a 100 KB Lark or GBNF grammar, or a
`$defs` chain of a thousand objects, about 70 KB) overflows an 8 MiB thread stack and kills the
whole process with SIGSEGV. Its Python GBNF converter also takes time quadratic in the number of
rules (3 s for 1,000, 70 s for 4,000). So, before any of it runs:

- a JSON Schema may be at most MAX_SCHEMA_DEPTH levels deep, counting its nested objects and
  lists and each `$ref` followed (a recursive reference is a cycle, not depth);
- a GBNF grammar may have at most MAX_GBNF_RULES rules;
- a Lark grammar's references from `start` may chain at most MAX_RULE_DEPTH rules deep, and a
  JSON Schema inlined in it with `%json` obeys the schema limit.

Each limit sits well below where llguidance crashes here (a `$ref` chain of objects: between 600
and 1,000 definitions, each 3-4 levels; a Lark chain: between 2,000 and 2,500 rules).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Hashable
from typing import Any

from roseinfer.errors import InvalidRequestError

MAX_SCHEMA_DEPTH = 1000
MAX_RULE_DEPTH = 500
MAX_GBNF_RULES = 500

_LARK_RULE = re.compile(r"^[ \t]*[?!]?([A-Za-z_][A-Za-z_0-9]*)(?:\.-?\d+)?[ \t]*:", re.MULTILINE)
_GBNF_RULE = re.compile(r"^[ \t]*[A-Za-z0-9_-]+[ \t]*::=", re.MULTILINE)
# What cannot hold a rule reference: strings, regexes, comments.
_LARK_LITERALS = re.compile(r'"(?:\\.|[^"\\\n])*"i?|/(?:\\.|[^/\\\n])+/[imslux]*|//[^\n]*')
_NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


def check_json_schema(schema: Any, param: str) -> None:
    depth = json_schema_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(
            f"{param} is {depth} levels deep counting its $refs (at most {MAX_SCHEMA_DEPTH})", param=param)


def check_gbnf(text: str, param: str) -> None:
    rules = len(_GBNF_RULE.findall(text))
    if rules > MAX_GBNF_RULES:
        raise InvalidRequestError(f"{param} has {rules} GBNF rules (at most {MAX_GBNF_RULES})", param=param)


def check_lark(text: str, param: str) -> None:
    for schema in _inline_schemas(text):
        check_json_schema(schema, param)
    depth = lark_rule_depth(text)
    if depth > MAX_RULE_DEPTH:
        raise InvalidRequestError(
            f"{param}: its rules reference each other {depth} deep (at most {MAX_RULE_DEPTH})", param=param)


def json_schema_depth(schema: Any) -> int:
    """The deepest path through the schema's objects and lists, following local `$ref`s (a ref
    back into the path is a cycle: not followed); stops counting past MAX_SCHEMA_DEPTH."""
    nodes: dict[int, Any] = {id(schema): schema}

    def edges(key: int) -> list[int]:
        node = nodes[key]
        children = list(node.values()) if isinstance(node, dict) else node
        if isinstance(node, dict) and isinstance(node.get("$ref"), str):
            children = [*children, _resolve(schema, node["$ref"])]
        found = [child for child in children if isinstance(child, dict | list)]
        nodes.update((id(child), child) for child in found)
        return [id(child) for child in found]

    if not isinstance(schema, dict | list):
        return 0
    return _longest_path(id(schema), edges, MAX_SCHEMA_DEPTH)


def lark_rule_depth(text: str) -> int:
    """How deep rule references chain from `start` (a reference back into the chain is a cycle:
    not counted); stops counting past MAX_RULE_DEPTH."""
    bodies: dict[str, list[str]] = {}
    current: str | None = None
    for line in _LARK_LITERALS.sub(" ", text).splitlines():
        match = _LARK_RULE.match(line)
        if match:
            current = match.group(1)
            bodies.setdefault(current, []).append(line[match.end():])
        elif current is not None:
            bodies[current].append(line)
    refs = {name: sorted({word for part in body for word in _NAME.findall(part) if word in bodies})
            for name, body in bodies.items()}
    root = "start" if "start" in refs else next(iter(refs), None)
    return 0 if root is None else _longest_path(root, refs.__getitem__, MAX_RULE_DEPTH)


def _longest_path(root: Hashable, edges: Callable[[Hashable], list], limit: int) -> int:
    """The longest path from `root` (in nodes) of a depth-first walk that drops edges back into
    the path; iterative, linear in the graph's size, and it stops once a path passes `limit`."""
    below: dict[Hashable, int] = {}  # a finished node's longest path downwards
    on_path = {root}
    stack: list[tuple[Hashable, list]] = [(root, list(edges(root)))]
    while stack:
        node, pending = stack[-1]
        if pending:
            child = pending.pop()
            if child not in on_path and child not in below:
                on_path.add(child)
                stack.append((child, list(edges(child))))
                if len(stack) > limit:
                    return len(stack)
            continue
        stack.pop()
        on_path.discard(node)
        below[node] = 1 + max((below.get(child, 0) for child in edges(node) if child not in on_path), default=0)
    return below[root]


def _inline_schemas(text: str) -> list[Any]:
    """The JSON Schemas of llguidance's `%json { ... }` in a Lark grammar."""
    schemas = []
    decoder = json.JSONDecoder()
    for match in re.finditer(r"%json\s*", text):
        try:
            schemas.append(decoder.raw_decode(text, match.end())[0])
        except ValueError:
            continue  # llguidance reports the syntax error itself
    return schemas


def _resolve(schema: Any, ref: str) -> Any:
    """A local JSON pointer's target (`#`, `#/$defs/a`), or None where it leads nowhere."""
    if ref == "#":
        return schema
    if not ref.startswith("#/"):
        return None  # remote and anchor references: llguidance resolves or refuses them itself
    node = schema
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
