"""Values parsed from a file, checked against a declared schema before any of them is used.

`bounded_json` bounds what a parse may build (bytes, values, nesting, strings); it says nothing of
each value's type. A reader that then indexes, hashes, compares or does arithmetic on a value of
the wrong type (`"outputs": []`, `"dtype": ["F32"]`, `"seq": [1]`) ends in a TypeError, KeyError or
worse deep inside a command. So every file kind a reader takes from a received run dir, checkpoint
or artifact states its shape once, as a `typing_extensions.TypedDict` (pydantic's strict mode: no coercion, a bool is
not an int, a string not a number), and `check` refuses a value that does not match with a
UserError naming the file, the field and what it should be. Readers keep the dict they parsed (the
check builds nothing they use), so keys a schema does not name pass through unchanged.
"""

from __future__ import annotations

import copy
import functools
from typing import Annotated, Any

from torchcls.errors import UserError

SHA256_PATTERN = r"^[0-9a-f]{64}$"
# pydantic-core's container schemas that take `fail_fast` (a TypedDict's fields are the schema's, so bounded)
FAIL_FAST_TYPES = frozenset({"list", "dict", "tuple", "set", "frozenset", "deque", "generator"})


class SchemaMismatch(UserError):
    """A value of another shape than its schema (`check`), as against a file that could not be read or parsed:
    readers that take a record of another shape as absent catch this one only."""


def __getattr__(name: str) -> Any:
    # NonNegative = Annotated[int, Field(ge=0)] (counts, sizes, sequence numbers), built on first use so that
    # importing this module leaves pydantic unloaded (~60 ms), as sha256_type does
    if name == "NonNegative":
        from pydantic import Field

        return Annotated[int, Field(ge=0)]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def sha256_type() -> Any:
    """A lowercase hex SHA-256 digest, as a schema field type."""
    from pydantic import StringConstraints

    return Annotated[str, StringConstraints(pattern=SHA256_PATTERN)]


@functools.cache
def _validator(schema: Any):
    """pydantic's validator of `schema`, made to stop at the first error in every list, dict, tuple and set.
    pydantic otherwise records every mismatch before it reports one, ~1 KB each: a 2 MiB file of a million
    wrong values took 1 GB. Fail-fast containers bound that by the schema's own size, whatever the file."""
    from pydantic import TypeAdapter
    from pydantic_core import SchemaValidator

    core = copy.deepcopy(TypeAdapter(schema).core_schema)
    _fail_fast(core)
    return SchemaValidator(core)


def _fail_fast(node: Any) -> None:
    if isinstance(node, dict):
        if node.get("type") in FAIL_FAST_TYPES:
            node["fail_fast"] = True
        for child in node.values():
            _fail_fast(child)
    elif isinstance(node, list):
        for child in node:
            _fail_fast(child)


def check(value: Any, schema: Any, where: str, hint: str = "",
          cause: str = "so it was not written by torchcls or was damaged") -> Any:
    """`value` itself when it matches `schema` (a TypedDict, or any type pydantic can validate), else a
    SchemaMismatch (a UserError): "`where`: field a.b: what it should be (got T), `cause`", then `hint` (the
    fix), when given. `cause`: what a mismatch says of the file (another for files torchcls does not write)."""
    from pydantic_core import ValidationError

    try:
        _validator(schema).validate_python(value, strict=True)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        field = ".".join(str(p) for p in first["loc"]) or "the top level"
        got = type(first.get("input")).__name__ if first["type"] != "missing" else "nothing"
        raise SchemaMismatch(f"{where}: {field}: {first['msg'].lower()} (got {got}), {cause}"
                             f"{'; ' + hint if hint else ''}") from None
    return value
