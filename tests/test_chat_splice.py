"""extproc.pick.tokens.chat_splice: a spliced chat text is Jinja's text; templates that read a content are
left to Jinja."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.pick.tokens.chat_splice import MAX_STRUCTURES
from extproc.pick.tokens.prompt_tokens import ModelTokenizer, NotTokenizable

ASSETS = Path(__file__).resolve().parent.parent / "lab" / "routerlab" / "assets"

CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Llama 3's shape: the system message taken out and trimmed, every content trimmed, a default system text
LLAMA3_LIKE = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
               "{% set system_message = messages[0]['content'] | trim %}"
               "{% set messages = messages[1:] %}{% else %}{% set system_message = 'You are helpful.' %}{% endif %}"
               "{{ '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}"
               "{% for message in messages %}{% if message.role not in ['user', 'assistant', 'tool'] %}"
               "{{ raise_exception('bad role') }}{% endif %}"
               "{{ '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n'"
               " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
# Qwen 3's shape: an assistant's content is split at its reasoning (read: never spliced with an assistant turn)
THINKING = ("{% for message in messages %}{% if message.role == 'assistant' %}"
            "{% set content = message.content.split('</think>')[-1].lstrip('\\n') %}{% else %}"
            "{% set content = message.content %}{% endif %}"
            "{{ '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _with_template(tmp_path: Path, template: str) -> ModelTokenizer:
    d = tmp_path / "model"
    shutil.copytree(ASSETS / "tiny-bytelevel", d, dirs_exist_ok=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return ModelTokenizer(d, content_format="string")


def _jinja(mt: ModelTokenizer, doc: dict[str, Any]) -> str | type[NotTokenizable]:
    try:
        return mt._render_with(mt._template, doc)
    except NotTokenizable:
        return NotTokenizable


def _spliced(mt: ModelTokenizer, doc: dict[str, Any]) -> str | type[NotTokenizable]:
    try:
        return mt.render_chat(doc)
    except NotTokenizable:
        return NotTokenizable


CONTENT = st.one_of(st.text(max_size=12), st.sampled_from(["", " ", "  padded  ", "\n", "a</think>b", "\x00",
                                                          "\u2003x\u2003", "\x000\x01", "{{ x }}", "<|im_end|>"]))
CONVERSATION = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                                               "content": CONTENT}), min_size=1, max_size=6)


@pytest.mark.parametrize("template", [CHATML, LLAMA3_LIKE, THINKING], ids=["chatml", "llama3-like", "thinking"])
@settings(max_examples=200, deadline=None)
@given(messages=CONVERSATION, generation=st.sampled_from([None, True, False]))
def test_a_spliced_text_is_jinjas(tmp_path_factory: pytest.TempPathFactory, template: str,
                                  messages: list[dict[str, str]], generation: bool | None) -> None:
    mt = _TOKENIZERS.get(template) or _TOKENIZERS.setdefault(
        template, _with_template(tmp_path_factory.mktemp("t"), template))
    doc: dict[str, Any] = {"messages": messages}
    if generation is not None:
        doc["add_generation_prompt"] = generation
    assert _spliced(mt, doc) == _jinja(mt, doc)
    assert _spliced(mt, doc) == _jinja(mt, doc)  # the second time past the first-use check
    assert mt.splice is not None and mt.splice.disagreed == 0


_TOKENIZERS: dict[str, ModelTokenizer] = {}


def test_the_shipped_templates_splice_where_they_only_copy(tmp_path: Path) -> None:
    questions = [{"messages": [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": f"q{i} "}]}
                 for i in range(3)]
    turn = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>x</think>\nyo"},
                         {"role": "user", "content": "and?"}]}
    for template, question_spliced, turn_spliced in ((CHATML, True, True), (LLAMA3_LIKE, True, True),
                                                     (THINKING, True, False)):
        mt = _with_template(tmp_path / str(len(template)), template)
        assert mt.splice is not None
        for doc in questions:
            assert mt.render_chat(doc) == _jinja(mt, doc)
        assert (mt.splice.spliced == 3) is question_spliced
        before = mt.splice.spliced
        assert mt.render_chat(turn) == _jinja(mt, turn)
        assert (mt.splice.spliced > before) is turn_spliced
    bytelevel = ModelTokenizer(ASSETS / "tiny-bytelevel")  # "openai" content: the text of each message's one part
    for doc in questions:
        assert bytelevel.render_chat(doc) == _jinja(bytelevel, doc)
    assert bytelevel.splice is not None and bytelevel.splice.spliced == 3


READS = {  # templates that read a content (or the date): never spliced
    "compares": "{% for m in messages %}{% if m['content'] == '' %}EMPTY{% else %}{{ m['content'] }}{% endif %}"
                "{% endfor %}",
    "truth": "{% for m in messages %}{% if m.content %}{{ m.content }}{% endif %}|{% endfor %}",
    "filter": "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}",
    "slice": "{% for m in messages %}{{ m['content'][:3] }}{% endfor %}",
    "method on a name": "{% for m in messages %}{% set c = m['content'] %}{{ c.strip() }}{% endfor %}",
    "trimmed text": "{% for m in messages %}{{ ('<' + m['content']) | trim }}{% endfor %}",
    "tojson": "{% for m in messages %}{{ m | tojson }}{% endfor %}",
    "map": "{{ messages | map(attribute='content') | join(',') }}",
    "captured": "{% for m in messages %}{% set x %}{{ m['content'] }}{% endset %}{{ x | trim }}{% endfor %}",
    "macro": "{% macro show(t) %}{{ t | trim }}{% endmacro %}"
             "{% for m in messages %}{{ show(m['content']) }}{% endfor %}",
    "previtem": "{% for m in messages %}{% if loop.previtem and loop.previtem['content'] %}P{% endif %}"
                "{{ m.content }}{% endfor %}",
    "characters": "{% for m in messages %}{% for c in m['content'] %}{{ c }}.{% endfor %}{% endfor %}",
    "get": "{% for m in messages %}{{ m.get('content') }}{% endfor %}",
    "length": "{% for m in messages %}{{ m['content'] | length }}{% endfor %}",
    "date": "{{ strftime_now('%Y') }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "namespace": "{% set ns = namespace(c='') %}{% for m in messages %}{% set ns.c = m['content'] %}{% endfor %}"
                 "{{ ns.c.strip() }}",
    "in": "{% for m in messages %}{% if 'x' in m['content'] %}X{% endif %}{{ m['content'] }}{% endfor %}",
}


@pytest.mark.parametrize("template", READS.values(), ids=READS.keys())
def test_a_template_that_reads_a_content_is_left_to_jinja(tmp_path: Path, template: str) -> None:
    mt = _with_template(tmp_path, template)
    assert mt.splice is not None
    for contents in (["x", " a "], ["", "bx  "], ["  ", "y"]):
        doc = {"messages": [{"role": "user", "content": c} for c in contents]}
        assert mt.render_chat(doc) == _jinja(mt, doc)
    assert mt.splice.spliced == 0
    assert mt.splice.disagreed == 0  # refused by the proof, not caught by the first-use check


def test_bodies_outside_the_spliced_shape_are_rendered_by_jinja(tmp_path: Path) -> None:
    mt = _with_template(tmp_path, CHATML)
    assert mt.splice is not None
    base = {"messages": [{"role": "user", "content": "x"}]}
    others = [
        {**base, "tools": [{"type": "function", "function": {"name": "f"}}]},
        {**base, "continue_final_message": True, "add_generation_prompt": False},
        {**base, "add_generation_prompt": 1},  # not a boolean: refused, as by Jinja's path
        {**base, "add_generation_prompt": 1.0},
        {**base, "continue_final_message": 0},
        {**base, "chat_template_kwargs": {"bos_token": "B"}},
        {"messages": [{"role": "user", "content": "x", "name": "bob"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
        {"messages": [{"role": "developer", "content": "x"}]},
    ]
    for doc in others:
        assert _spliced(mt, doc) == _jinja(mt, doc)
    assert mt.splice.spliced == 0
    assert _spliced(mt, base) == _jinja(mt, base) and mt.splice.spliced == 1


def test_a_splice_that_disagrees_with_jinja_on_first_use_is_dropped(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    mt = _with_template(tmp_path, CHATML)
    splice = mt.splice
    assert splice is not None
    doc = {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True}
    splice._skeletons[(True, ("user",))] = ("wrong ", (0, False))  # as if the proof had been wrong
    assert mt.render_chat(doc) == _jinja(mt, doc)
    assert splice.disagreed == 1 and "disagreed" in caplog.text
    assert mt.render_chat(doc) == _jinja(mt, doc) and splice.spliced == 0


def test_structures_kept_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("extproc.pick.tokens.chat_splice.MAX_STRUCTURES", 3)
    mt = _with_template(tmp_path, CHATML)
    assert mt.splice is not None and MAX_STRUCTURES > 3
    for n in range(1, 8):
        doc = {"messages": [{"role": "user", "content": "x"}] * n}
        assert mt.render_chat(doc) == _jinja(mt, doc)
        assert len(mt.splice._skeletons) <= 3
    assert mt.splice.spliced == 7


def test_a_template_the_walk_cannot_take_is_rendered_by_jinja(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    def fails(self: object) -> None:
        raise ValueError("names' kinds do not settle")

    monkeypatch.setattr("extproc.pick.tokens.chat_splice._Instrument.run", fails)
    with caplog.at_level("INFO", logger="extproc.pick.tokens.chat_splice"):
        mt = _with_template(tmp_path, CHATML)
    assert mt.splice is not None and not mt.splice.enabled and "not spliced" in caplog.text
    doc = {"messages": [{"role": "user", "content": "x"}]}
    assert mt.render_chat(doc) == _jinja(mt, doc)
    assert (mt.splice.spliced, mt.splice.disagreed, mt.jinja_renders) == (0, 0, 1)
