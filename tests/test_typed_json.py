"""typed_json.check: a value parsed from a file matches its declared schema, or a UserError names the field."""

from __future__ import annotations

import pytest
from typing_extensions import NotRequired, TypedDict

from torchcls.errors import UserError
from torchcls.typed_json import check, sha256_type


class Pin(TypedDict):
    seq: int
    hash: str


class Record(TypedDict):
    run_id: str
    outputs: NotRequired[dict[str, bool]]
    chain_head: NotRequired[Pin]
    sha256: NotRequired[sha256_type()]


def test_a_matching_value_comes_back_unchanged_with_keys_the_schema_does_not_name():
    value = {"run_id": "r", "outputs": {"predictions": True}, "chain_head": {"seq": 3, "hash": "h"},
             "sha256": "a" * 64, "later_key": [1]}
    assert check(value, Record, "x.json") is value


@pytest.mark.parametrize(("value", "field", "got"), [
    ([1], "the top level", "list"),
    ({}, "run_id", "nothing"),
    ({"run_id": 1}, "run_id", "int"),
    ({"run_id": "r", "outputs": []}, "outputs", "list"),
    ({"run_id": "r", "outputs": {"predictions": 1}}, "outputs.predictions", "int"),  # strict: no coercion
    ({"run_id": "r", "chain_head": {"seq": [1], "hash": "h"}}, "chain_head.seq", "list"),
    ({"run_id": "r", "chain_head": {"seq": True, "hash": "h"}}, "chain_head.seq", "bool"),  # a bool is no int
    ({"run_id": "r", "sha256": "A" * 64}, "sha256", "str"),
])
def test_a_value_of_another_shape_is_refused_naming_the_file_and_field(value, field, got):
    with pytest.raises(UserError, match=rf"^x\.json: {field}: .* \(got {got}\), so it was not written by torchcls "
                                        r"or was damaged; export it again$"):
        check(value, Record, "x.json", hint="export it again")


class Many(TypedDict):
    records: list[Record]
    tags: dict[str, bool]
    pairs: list[tuple[int, int]]


@pytest.mark.parametrize("value", [
    {"records": [1] * 100_000, "tags": {}, "pairs": []},
    {"records": [], "tags": {str(i): 1 for i in range(100_000)}, "pairs": []},
    {"records": [{"run_id": 1}] * 100_000, "tags": {}, "pairs": [("x", "y")] * 100_000},
])
def test_the_check_stops_at_the_first_wrong_value(value):
    """Review 5, finding 1: pydantic recorded every mismatch (about 1 KB each) before it reported one, so a 2 MiB
    file of a million wrong values took 1 GB. Every container of a schema now fails fast: at most one error per
    field of the schema (a TypedDict checks each of its fields), whatever N."""
    from pydantic_core import ValidationError

    from torchcls.typed_json import _validator

    with pytest.raises(ValidationError) as refused:
        _validator(Many).validate_python(value, strict=True)
    assert refused.value.error_count() <= len(Many.__annotations__)
    with pytest.raises(UserError, match=r"^m\.json: (records|tags)\.0"):
        check(value, Many, "m.json")
