"""extproc.pick.tokens.chat_render's shortcuts give what the general path gives."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from extproc.core.normalize import _message, _message_fields
from extproc.pick.tokens.chat_render import _parse_message, compile_template, parse_message

ROLES = st.sampled_from(["system", "user", "assistant", "tool", "developer", ""]) | st.text(max_size=3)
VALUES = st.none() | st.text(max_size=8) | st.integers() | st.lists(st.fixed_dictionaries(
    {"type": st.just("text"), "text": st.text(max_size=5)}), max_size=2)
MESSAGES = (st.dictionaries(st.sampled_from(["role", "content", "name", "tool_calls", "tool_call_id", "reasoning"]),
                            VALUES | ROLES, max_size=3)
            | st.fixed_dictionaries({"role": ROLES, "content": st.text(max_size=8)}))


@given(content=st.text(max_size=20), role=st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
       fmt=st.sampled_from(["string", "openai"]), name=st.none() | st.text(max_size=3))
def test_string_content_is_parsed_as_its_one_text_part(content: str, role: str, fmt, name) -> None:  # type: ignore[no-untyped-def]
    """A string content is taken as the list ``[{"type": "text", "text": content}]`` is."""
    message = {"role": role, "content": content, **({"name": name} if name is not None else {})}
    as_part = {**message, "content": [{"type": "text", "text": content}]}
    assert parse_message(message, fmt) == parse_message(as_part, fmt)


@given(message=MESSAGES, fmt=st.sampled_from(["string", "openai"]))
def test_the_common_messages_shortcut_gives_the_general_walks_result(message: dict, fmt) -> None:  # type: ignore[no-untyped-def]
    """parse_message's and the normaliser's shortcut for {"role": str, "content": str} agree with
    their general paths on every message shape, the shortcut's own and all others."""
    assert _message(message) == _message_fields(message)
    try:
        general = _parse_message(message, fmt)
    except Exception as e:  # noqa: BLE001 - the same error either way
        try:
            parse_message(message, fmt)
        except type(e) as same:
            assert str(same) == str(e)
        else:
            raise AssertionError("the shortcut accepted what the general path refused") from e
    else:
        assert parse_message(message, fmt) == general


def test_flattened_globals_are_the_environments() -> None:
    env, template = compile_template("{{ raise_exception is defined }} {{ strftime_now('%Y') | length }} "
                                     "{{ range(2) | list }}")
    assert type(template.globals) is dict and template.globals == dict(env.make_globals(None))
    assert template.render() == "True 4 [0, 1]"
