"""JSON schemas compiled into the value nodes that the structured-output automaton walks.

A node says which JSON values are allowed at one place of the answer: any value (JSON
mode), an object with named properties, an array of items, a string, a number, one of a
fixed set of literal encodings (booleans, null, enum, const), or a union. `$ref` to
`#/$defs/...` / `#/definitions/...` resolves to the same node, so recursive schemas work.
Keywords that would constrain values in ways the automaton cannot enforce raise
InvalidOption naming the keyword (the HTTP layer answers 400).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from exl3cli.errors import InvalidOption

# "Infinitely long" for minimum lengths of recursive schemas that never bottom out.
UNREACHABLE = 10**6

# Keywords that only describe or document a value; they never restrict it.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id",
                          "$comment", "deprecated", "readOnly", "writeOnly", "$defs",
                          "definitions", "strict", "name"})
_SUPPORTED = frozenset({"type", "properties", "required", "additionalProperties", "items",
                        "enum", "const", "anyOf", "oneOf", "$ref", "minItems", "maxItems",
                        "minLength", "maxLength"}) | _ANNOTATIONS
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def encode_literal(value: Any) -> bytes:
    """The compact JSON text the model must write for a literal (enum/const) value."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


@dataclass(eq=False, repr=False)
class Node:
    """One place in the answer. Compared and hashed by identity (frames hold nodes)."""

    kind: str  # any | object | array | string | number | integer | literal | union
    properties: dict[str, Node] = field(default_factory=dict)
    required: frozenset[str] = frozenset()
    additional: Node | None = None  # the node for keys not in properties, None = none
    key_bytes: dict[str, bytes] = field(default_factory=dict)  # name -> encoded + '"'
    items: Node | None = None
    min_items: int = 0
    max_items: int | None = None
    min_length: int = 0
    max_length: int | None = None
    literals: tuple[bytes, ...] = ()
    alternatives: tuple[Node, ...] = ()
    _min_len: int | None = field(default=None, repr=False)
    _busy: bool = field(default=False, repr=False)

    def __repr__(self) -> str:
        return f"<Node {self.kind}>"

    @property
    def tracks_length(self) -> bool:
        return self.kind == "string" and (self.min_length > 0 or self.max_length is not None)

    def min_len(self) -> int:
        """Fewest bytes of any value this node accepts (UNREACHABLE if none is finite)."""
        if self._min_len is not None:
            return self._min_len
        if self._busy:  # a recursion that has not bottomed out yet
            return UNREACHABLE
        self._busy = True
        try:
            value = min(self._compute_min_len(), UNREACHABLE)
        finally:
            self._busy = False
        self._min_len = value
        return value

    def _compute_min_len(self) -> int:
        if self.kind in ("any", "number", "integer"):
            return 1
        if self.kind == "string":
            return 2 + self.min_length
        if self.kind == "literal":
            return min(len(lit) for lit in self.literals)
        if self.kind == "union":
            return min((alt.min_len() for alt in self.alternatives), default=UNREACHABLE)
        if self.kind == "array":
            assert self.items is not None
            count = self.min_items
            return 2 + count * self.items.min_len() + max(0, count - 1)
        return 2 + self.required_cost(frozenset(), first=True)

    def member_cost(self, name: str | None) -> int:
        """Bytes of `"name":<shortest value>` (without a leading comma)."""
        if name is None:
            assert self.additional is not None
            return 2 + 1 + self.additional.min_len()  # "":value
        return 1 + len(self.key_bytes[name]) + 1 + self.properties[name].min_len()

    def required_cost(self, seen: frozenset[str], first: bool) -> int:
        """Bytes to write every required property not in `seen`, commas included."""
        missing = [name for name in self.required if name not in seen]
        if not missing:
            return 0
        total = sum(1 + self.member_cost(name) for name in missing)
        return total - 1 if first else total


ANY = Node("any")
ANY_OBJECT = Node("object", additional=ANY)
ANY_ARRAY = Node("array", items=ANY)
ANY_STRING = Node("string")


def json_mode_root() -> Node:
    """`format: "json"`: an object whose values may be anything."""
    return ANY_OBJECT


class _Compiler:
    def __init__(self, root: dict[str, Any]):
        self.root = root
        self.refs: dict[str, Node] = {}

    def compile(self, schema: Any, where: str) -> Node:
        if schema is True or schema == {}:
            return ANY
        if not isinstance(schema, dict):
            raise InvalidOption(f"format: schema at {where} must be an object")
        unknown = sorted(k for k in schema if k not in _SUPPORTED)
        if unknown:
            raise InvalidOption(f"format: unsupported JSON schema keyword {unknown[0]!r} "
                                f"at {where}")
        if "$ref" in schema:
            return self._ref(schema["$ref"], where)
        if "const" in schema:
            return Node("literal", literals=(encode_literal(schema["const"]),))
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise InvalidOption(f"format: enum at {where} must be a non-empty list")
            return Node("literal", literals=tuple(dict.fromkeys(map(encode_literal, values))))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = schema[key]
                if not isinstance(options, list) or not options:
                    raise InvalidOption(f"format: {key} at {where} must be a non-empty list")
                rest = {k: v for k, v in schema.items() if k != key}
                alts = tuple(self.compile({**rest, **alt} if isinstance(alt, dict) else alt,
                                          f"{where}/{key}/{i}") for i, alt in enumerate(options))
                return alts[0] if len(alts) == 1 else Node("union", alternatives=alts)
        kind = schema.get("type")
        if isinstance(kind, list):
            if not kind:
                raise InvalidOption(f"format: type at {where} must not be empty")
            alts = tuple(self.compile({**schema, "type": k}, where) for k in kind)
            return alts[0] if len(alts) == 1 else Node("union", alternatives=alts)
        if kind is None:
            if "properties" in schema:
                kind = "object"
            elif "items" in schema:
                kind = "array"
            else:
                return ANY
        if kind not in _TYPES:
            raise InvalidOption(f"format: unknown type {kind!r} at {where}")
        return getattr(self, f"_{kind}")(schema, where)

    def _ref(self, ref: Any, where: str) -> Node:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise InvalidOption(f"format: only local $ref (#/...) is supported at {where}")
        if ref in self.refs:
            return self.refs[ref]
        target: Any = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise InvalidOption(f"format: $ref {ref!r} at {where} points nowhere")
            target = target[part]
        # A placeholder first, so a schema that refers to itself finds it.
        node = Node("union")
        self.refs[ref] = node
        compiled = self.compile(target, ref)
        if compiled is node:
            raise InvalidOption(f"format: $ref {ref!r} at {where} refers only to itself")
        node.__dict__.update({k: v for k, v in compiled.__dict__.items()
                              if not k.startswith("_")})
        return node

    def _object(self, schema: dict[str, Any], where: str) -> Node:
        props = schema.get("properties") or {}
        if not isinstance(props, dict):
            raise InvalidOption(f"format: properties at {where} must be an object")
        required = schema.get("required") or []
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise InvalidOption(f"format: required at {where} must be a list of names")
        missing = [r for r in required if r not in props]
        if missing:
            raise InvalidOption(f"format: required property {missing[0]!r} at {where} is "
                                "not in properties")
        extra = schema.get("additionalProperties", not props)
        additional = None
        if extra is True:
            additional = ANY
        elif isinstance(extra, dict):
            additional = self.compile(extra, f"{where}/additionalProperties")
        elif extra is not False:
            raise InvalidOption(f"format: additionalProperties at {where} must be a "
                                "boolean or a schema")
        properties = {name: self.compile(sub, f"{where}/properties/{name}")
                      for name, sub in props.items()}
        key_bytes = {name: encode_literal(name)[1:] for name in properties}
        return Node("object", properties=properties, required=frozenset(required),
                    additional=additional, key_bytes=key_bytes)

    def _array(self, schema: dict[str, Any], where: str) -> Node:
        items = self.compile(schema.get("items", True), f"{where}/items")
        low = _count(schema, "minItems", where, 0)
        high = _count(schema, "maxItems", where, None)
        if high is not None and high < low:
            raise InvalidOption(f"format: maxItems < minItems at {where}")
        return Node("array", items=items, min_items=low, max_items=high)

    def _string(self, schema: dict[str, Any], where: str) -> Node:
        low = _count(schema, "minLength", where, 0)
        high = _count(schema, "maxLength", where, None)
        if high is not None and high < low:
            raise InvalidOption(f"format: maxLength < minLength at {where}")
        if not low and high is None:
            return ANY_STRING
        return Node("string", min_length=low, max_length=high)

    def _number(self, schema: dict[str, Any], where: str) -> Node:
        return Node("number")

    def _integer(self, schema: dict[str, Any], where: str) -> Node:
        return Node("integer")

    def _boolean(self, schema: dict[str, Any], where: str) -> Node:
        return Node("literal", literals=(b"true", b"false"))

    def _null(self, schema: dict[str, Any], where: str) -> Node:
        return Node("literal", literals=(b"null",))


def _count(schema: dict[str, Any], key: str, where: str, default: int | None) -> int | None:
    value = schema.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidOption(f"format: {key} at {where} must be a non-negative integer")
    return value


def compile_schema(schema: dict[str, Any]) -> Node:
    """The root node for a JSON schema; InvalidOption names any unsupported keyword."""
    if not isinstance(schema, dict):
        raise InvalidOption("format: a JSON schema must be an object")
    try:
        root = _Compiler(schema).compile(schema, "#")
        finite = root.min_len() < UNREACHABLE
    except RecursionError:
        raise InvalidOption("format: the JSON schema is nested too deeply") from None
    if not finite:
        raise InvalidOption("format: no finite JSON value matches the schema")
    return root
