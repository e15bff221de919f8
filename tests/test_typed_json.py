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
