"""Members of a canonical JSON object changed one key at a time read as json.dumps(sort_keys=True)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from services.nodeagent.core.json_members import JsonMembers


def _dumps(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


# Keys as claim UIDs are, and as anything JSON allows (sorting must match json's, escapes too).
keys = st.one_of(st.uuids().map(str), st.text(max_size=6))
changes = st.lists(st.tuples(st.booleans(), keys, st.integers(-5, 5)), max_size=60)


@given(changes)
def test_members_read_as_the_canonical_object_after_any_changes(ops: list[tuple[bool, str, int]]) -> None:
    members, model = JsonMembers(), {}
    for add, key, value in ops:
        if add:
            members.set(key, f"{_dumps(key)}:{_dumps({'v': value})}")
            model[key] = {"v": value}
        else:
            members.discard(key)
            model.pop(key, None)
        assert "{" + members.text() + "}" == _dumps(model)
        assert len(members) == len(model)
