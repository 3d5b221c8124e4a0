"""A byte-level pushdown recogniser for JSON values shaped by schema nodes.

A configuration is a stack (a tuple, bottom first) of immutable frames; `step(stack,
byte)` returns every stack the byte can lead to (none: the byte is not allowed). Several
stacks can be alive at once (unions, a number that may continue or end), so callers
track a frozenset of them. Frames are plain tuples so they hash fast and can key caches:

  ("E",)                                  after the root value (nothing more may follow)
  ("V", node, ws)                         a value of `node` is expected; ws = blanks so far
  ("O", node, phase, seen, key, pos, ws)  inside an object (see the O_* phases)
  ("A", node, phase, count, ws)           inside an array
  ("S", node, esc, length)                inside a string (esc: 1 after "\\", 10+k: k hex
                                          digits of "\\u" still due, a tuple: part-way
                                          through a UTF-8 character)
  ("N", integer, phase, digits)           inside a number
  ("L", literals, pos)                    part-way through one of some literal encodings

Whitespace runs are bounded (MAX_WS) and nesting is bounded (MAX_DEPTH), so the model
cannot stall forever on blanks or brackets. `distance(stack)` is the fewest bytes that
complete the value, which lets the caller keep every answer finishable within budget.
"""

from __future__ import annotations

from exl3cli.engine.grammar.schema import ANY_ARRAY, ANY_OBJECT, ANY_STRING, Node

Stack = tuple

MAX_WS = 16
MAX_DEPTH = 32
MAX_INT_DIGITS = 16
MAX_FRAC_DIGITS = 16
MAX_EXP_DIGITS = 2

WHITESPACE = frozenset(b" \t\n\r")
DIGITS = frozenset(b"0123456789")
QUOTE, BACKSLASH, COLON, COMMA = ord('"'), ord("\\"), ord(":"), ord(",")
LBRACE, RBRACE, LBRACKET, RBRACKET = ord("{"), ord("}"), ord("["), ord("]")
SIMPLE_ESCAPES = frozenset(b'"\\/bfnrt')
HEX = frozenset(b"0123456789abcdefABCDEF")

# Object phases: after "{", after ",", inside a key, before ":", after a member's value.
O_FIRST, O_KEY, O_INKEY, O_COLON, O_NEXT = range(5)
# Array phases: after "[", after an item.
A_FIRST, A_NEXT = range(2)
# Number phases; N_COMPLETE may end the number.
N_MINUS, N_ZERO, N_INT, N_DOT, N_FRAC, N_EXP, N_EXP_SIGN, N_EXP_DIGITS = range(8)
N_COMPLETE = frozenset({N_ZERO, N_INT, N_FRAC, N_EXP_DIGITS})

ROOT_END = ("E",)


def initial_stack(root: Node) -> Stack:
    return (ROOT_END, ("V", root, 0))


def step(stack: Stack, byte: int) -> list[Stack]:
    """Every stack reachable from `stack` by reading `byte`."""
    top = stack[-1]
    rest = stack[:-1]
    kind = top[0]
    if kind == "S":
        return _string(rest, top, byte)
    if kind == "V":
        if byte in WHITESPACE:
            return [rest + (("V", top[1], top[2] + 1),)] if top[2] < MAX_WS else []
        return _start_value(rest, top[1], byte)
    if kind == "O":
        return _object(rest, top, byte)
    if kind == "A":
        return _array(rest, top, byte)
    if kind == "N":
        return _number(rest, top, byte)
    if kind == "L":
        return _literal(rest, top, byte)
    return []  # "E": nothing may follow the root value


def _start_value(rest: Stack, node: Node, byte: int) -> list[Stack]:
    """The stacks after the first byte of a value of `node`."""
    kind = node.kind
    if kind == "union":
        out: list[Stack] = []
        for alt in node.alternatives:
            out.extend(_start_value(rest, alt, byte))
        return out
    if kind == "any":
        if byte == LBRACE:
            return _start_value(rest, ANY_OBJECT, byte)
        if byte == LBRACKET:
            return _start_value(rest, ANY_ARRAY, byte)
        if byte == QUOTE:
            return _start_value(rest, ANY_STRING, byte)
        if byte in DIGITS or byte == ord("-"):
            return _start_number(rest, False, byte)
        return _literal_after(rest, tuple(lit for lit in (b"true", b"false", b"null")
                                          if lit[0] == byte), 1)
    if kind == "object":
        if byte != LBRACE or len(rest) >= MAX_DEPTH:
            return []
        return [rest + (("O", node, O_FIRST, frozenset(), None, 0, 0),)]
    if kind == "array":
        if byte != LBRACKET or len(rest) >= MAX_DEPTH:
            return []
        return [rest + (("A", node, A_FIRST, 0, 0),)]
    if kind == "string":
        return [rest + (("S", node, 0, 0),)] if byte == QUOTE else []
    if kind in ("number", "integer"):
        return _start_number(rest, kind == "integer", byte)
    if kind == "literal":
        return _literal_after(rest, tuple(lit for lit in node.literals if lit[0] == byte), 1)
    return []


def _literal_after(rest: Stack, literals: tuple[bytes, ...], pos: int) -> list[Stack]:
    """`pos` bytes of `literals` matched: pop when none can go on, else keep matching."""
    if not literals:
        return []
    if all(len(lit) == pos for lit in literals):
        return [rest]
    return [rest + (("L", literals, pos),)]


def _literal(rest: Stack, top: tuple, byte: int) -> list[Stack]:
    _, literals, pos = top
    longer = tuple(lit for lit in literals if len(lit) > pos and lit[pos] == byte)
    out = _literal_after(rest, longer, pos + 1)
    if any(len(lit) == pos for lit in literals):  # a complete literal may also end here
        out.extend(step(rest, byte))
    return out


def _utf8_lead(byte: int) -> tuple[int, int, int] | None:
    """(continuation bytes due, allowed range of the next one) after a UTF-8 lead
    byte; None if the byte cannot start a character. Overlong forms and surrogates
    are excluded, so the text always decodes without replacement characters."""
    if 0xC2 <= byte <= 0xDF:
        return (1, 0x80, 0xBF)
    if byte == 0xE0:
        return (2, 0xA0, 0xBF)
    if byte == 0xED:
        return (2, 0x80, 0x9F)
    if 0xE1 <= byte <= 0xEF:
        return (2, 0x80, 0xBF)
    if byte == 0xF0:
        return (3, 0x90, 0xBF)
    if 0xF1 <= byte <= 0xF3:
        return (3, 0x80, 0xBF)
    if byte == 0xF4:
        return (3, 0x80, 0x8F)
    return None


def _string(rest: Stack, top: tuple, byte: int) -> list[Stack]:
    _, node, esc, length = top
    tracked = node.tracks_length
    limit = node.max_length
    full = limit is not None and length >= limit
    if esc == 0:
        if byte == QUOTE:
            return [rest] if length >= node.min_length else []
        if byte < 0x20 or full:
            return []  # raw control characters are not allowed in JSON strings
        if byte == BACKSLASH:
            return [rest + (("S", node, 1, length),)]
        counted = length + 1 if tracked else 0
        if byte < 0x80:
            return [rest + (top,)] if not tracked else [rest + (("S", node, 0, counted),)]
        lead = _utf8_lead(byte)
        return [rest + (("S", node, lead, counted),)] if lead else []
    if isinstance(esc, tuple):  # inside a multi-byte UTF-8 character
        due, low, high = esc
        if not low <= byte <= high:
            return []
        after = 0 if due == 1 else (due - 1, 0x80, 0xBF)
        return [rest + (("S", node, after, length),)]
    done_length = length + 1 if tracked else 0
    if esc == 1:
        if byte in SIMPLE_ESCAPES:
            return [rest + (("S", node, 0, done_length),)]
        return [rest + (("S", node, 14, length),)] if byte == ord("u") else []
    if byte not in HEX:
        return []
    if esc == 11:
        return [rest + (("S", node, 0, done_length),)]
    return [rest + (("S", node, esc - 1, length),)]


def _start_number(rest: Stack, integer: bool, byte: int) -> list[Stack]:
    if byte == ord("-"):
        return [rest + (("N", integer, N_MINUS, 0),)]
    if byte == ord("0"):
        return [rest + (("N", integer, N_ZERO, 1),)]
    if byte in DIGITS:
        return [rest + (("N", integer, N_INT, 1),)]
    return []


def _number(rest: Stack, top: tuple, byte: int) -> list[Stack]:
    _, integer, phase, digits = top
    digit = byte in DIGITS

    def to(new_phase: int, count: int) -> list[Stack]:
        return [rest + (("N", integer, new_phase, count),)]

    if phase == N_MINUS:
        if digit:
            return to(N_ZERO if byte == ord("0") else N_INT, 1)
        return []
    if phase in (N_DOT, N_EXP_SIGN):
        return to(N_FRAC if phase == N_DOT else N_EXP_DIGITS, 1) if digit else []
    if phase == N_EXP:
        if byte in b"+-":
            return to(N_EXP_SIGN, 0)
        return to(N_EXP_DIGITS, 1) if digit else []
    # complete phases: continue the number, or end it and let the parent read the byte
    if digit:
        room = {N_ZERO: 0, N_INT: MAX_INT_DIGITS, N_FRAC: MAX_FRAC_DIGITS,
                N_EXP_DIGITS: MAX_EXP_DIGITS}[phase]
        return to(phase, digits + 1) if digits < room else []
    if not integer and phase in (N_ZERO, N_INT) and byte == ord("."):
        return to(N_DOT, 0)
    if not integer and phase in (N_ZERO, N_INT, N_FRAC) and byte in b"eE":
        return to(N_EXP, 0)
    return step(rest, byte)


def _blank(rest: Stack, top: tuple, ws_index: int) -> list[Stack]:
    if top[ws_index] >= MAX_WS:
        return []
    return [rest + (top[:ws_index] + (top[ws_index] + 1,),)]


def _object(rest: Stack, top: tuple, byte: int) -> list[Stack]:
    _, node, phase, seen, key, pos, ws = top
    if phase == O_INKEY:
        key_bytes = node.key_bytes
        matching = tuple(name for name in key
                         if len(key_bytes[name]) > pos and key_bytes[name][pos] == byte)
        if not matching:
            return []
        done = [name for name in matching if len(key_bytes[name]) == pos + 1]
        if done:
            return [rest + (("O", node, O_COLON, seen, done[0], 0, 0),)]
        return [rest + (("O", node, O_INKEY, seen, matching, pos + 1, 0),)]
    if byte in WHITESPACE:
        return _blank(rest, top, 6)
    if phase == O_COLON:
        if byte != COLON:
            return []
        value = node.additional if key is None else node.properties[key]
        now_seen = seen if key is None else seen | {key}
        return [rest + (("O", node, O_NEXT, now_seen, None, 0, 0), ("V", value, 0))]
    if byte == RBRACE and phase in (O_FIRST, O_NEXT):
        return [rest] if node.required <= seen else []
    if byte == COMMA and phase == O_NEXT:
        return [rest + (("O", node, O_KEY, seen, None, 0, 0),)] if _more_keys(node, seen) \
            else []
    if byte == QUOTE and phase in (O_FIRST, O_KEY):
        out: list[Stack] = []
        names = tuple(name for name in node.properties if name not in seen)
        if names:
            out.append(rest + (("O", node, O_INKEY, seen, names, 0, 0),))
        if node.additional is not None:
            out.append(rest + (("O", node, O_COLON, seen, None, 0, 0),
                               ("S", ANY_STRING, 0, 0)))
        return out
    return []


def _more_keys(node: Node, seen: frozenset) -> bool:
    return node.additional is not None or any(n not in seen for n in node.properties)


def _array(rest: Stack, top: tuple, byte: int) -> list[Stack]:
    _, node, phase, count, ws = top
    if byte in WHITESPACE:
        return _blank(rest, top, 4)
    if byte == RBRACKET:
        return [rest] if count >= node.min_items else []
    room = node.max_items is None or count < node.max_items
    if phase == A_NEXT:
        if byte != COMMA or not room:
            return []
        return [rest + (("A", node, A_NEXT, count + 1, 0), ("V", node.items, 0))]
    if not room:
        return []
    return _start_value(rest + (("A", node, A_NEXT, 1, 0),), node.items, byte)


# ---- completion ------------------------------------------------------------------------

def can_end(stack: Stack) -> bool:
    """True when the text read so far is a complete value (EOS may come now)."""
    for frame in stack:
        kind = frame[0]
        if kind == "N":
            if frame[2] not in N_COMPLETE:
                return False
        elif kind == "L":
            if not any(len(lit) == frame[2] for lit in frame[1]):
                return False
        elif kind != "E":
            return False
    return True


def finished(stack: Stack) -> bool:
    """True when the value is complete and no further byte is possible."""
    return stack == (ROOT_END,)


def distance(stack: Stack) -> int:
    """The fewest bytes that complete the value from `stack`."""
    return sum(frame_distance(frame) for frame in stack)


def frame_distance(frame: tuple) -> int:
    """Bytes this frame still needs once everything above it is complete."""
    kind = frame[0]
    if kind == "E":
        return 0
    if kind == "V":
        return frame[1].min_len()
    if kind == "S":
        _, node, esc, length = frame
        if isinstance(esc, tuple):  # the character was counted at its lead byte
            return esc[0] + max(0, node.min_length - length) + 1
        pending = 0 if esc == 0 else (1 if esc == 1 else esc - 10)
        chars = length + (1 if esc else 0)
        return pending + max(0, node.min_length - chars) + 1
    if kind == "N":
        return 0 if frame[2] in N_COMPLETE else 1
    if kind == "L":
        return min(len(lit) - frame[2] for lit in frame[1])
    if kind == "A":
        _, node, phase, count, _ws = frame
        assert node.items is not None
        missing = max(0, node.min_items - count)
        if phase == A_FIRST:
            return node.min_len() - 1
        return missing * (1 + node.items.min_len()) + 1
    return _object_distance(frame)


def _object_distance(frame: tuple) -> int:
    _, node, phase, seen, key, pos, _ws = frame
    if phase == O_FIRST:
        return node.required_cost(seen, first=True) + 1
    if phase == O_NEXT:
        return node.required_cost(seen, first=False) + 1
    if phase == O_KEY:  # a member must follow the comma
        if node.required - seen:
            return node.required_cost(seen, first=True) + 1
        names = [n for n in node.properties if n not in seen]
        options = [node.member_cost(n) for n in names]
        if node.additional is not None:
            options.append(node.member_cost(None))
        return min(options) + 1
    if phase == O_INKEY:
        return min(len(node.key_bytes[n]) - pos + 1 + node.properties[n].min_len()
                   + node.required_cost(seen | {n}, first=False) + 1 for n in key)
    value = node.additional if key is None else node.properties[key]
    now_seen = seen if key is None else seen | {key}
    return 1 + value.min_len() + node.required_cost(now_seen, first=False) + 1
