"""extproc.pick.chat_render's shortcuts give what the general path gives."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from extproc.pick.chat_render import compile_template, parse_message


@given(content=st.text(max_size=20), role=st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
       fmt=st.sampled_from(["string", "openai"]), name=st.none() | st.text(max_size=3))
def test_string_content_is_parsed_as_its_one_text_part(content: str, role: str, fmt, name) -> None:  # type: ignore[no-untyped-def]
    """A string content is taken as the list ``[{"type": "text", "text": content}]`` is."""
    message = {"role": role, "content": content, **({"name": name} if name is not None else {})}
    as_part = {**message, "content": [{"type": "text", "text": content}]}
    assert parse_message(message, fmt) == parse_message(as_part, fmt)


def test_flattened_globals_are_the_environments() -> None:
    env, template = compile_template("{{ raise_exception is defined }} {{ strftime_now('%Y') | length }} {{ range(2) | list }}")
    assert type(template.globals) is dict and template.globals == dict(env.make_globals(None))
    assert template.render() == "True 4 [0, 1]"
