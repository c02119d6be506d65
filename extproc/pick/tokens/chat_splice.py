"""A chat rendered by splicing its messages' contents into fixed text, where the template only copies them.

Jinja renders a chat template in 22-28 us a request at 32 KB (the stage profile in
docs/results/precise/cost-history.md), and most of a long conversation's turn. Yet for most templates and requests the
rendered text is fixed pieces (role headers, special tokens) with each message's content written
between them as it is, or trimmed: what differs from request to request is the contents, and where
they go depends only on the roles and ``add_generation_prompt``. This module proves that per
template and per such structure, then renders by joining strings.

The proof has two parts. The template's syntax tree is walked once: every expression that can
hold a message's content, or a container it can be reached from (``messages``, a message, its
list of parts, names assigned from them), is tracked, and each use of one that is not a copy into
the output (alone, concatenated, or through ``trim``), a navigation by a constant key, a type test
or ``length`` gets wrapped in a call that flags it when it runs: a comparison, a method, any other
filter, a call's argument, text captured by ``{% set %}`` blocks or macros. ``strftime_now`` flags
too (the date is not part of the structure). Then, once per structure, this instrumented copy of
the template is rendered with markers for the contents: if nothing flagged, no decision the
template took and nothing it wrote depended on a content other than by copying it, so the output
is the skeleton for every request of that structure; the markers say where each content goes and
whether trimmed. A request outside the shapes this covers (tools, documents, template kwargs,
``continue_final_message``, messages with more than a role and a string content) is rendered by
Jinja, as is every structure whose probe flagged; the first splice of each structure is also
rendered by Jinja and compared (a disagreement is logged and the structure left to Jinja).

Exactness: tests/test_chat_splice.py compares splicing with Jinja over generated conversations on
several templates, and checks that templates reading a content are left to Jinja. Pure.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal, cast

from jinja2 import nodes as n

from extproc.pick.tokens.chat_render import plain_role

log = logging.getLogger(__name__)

Kind = str | None  # what an expression may hold: see _CONTAINERS and _TEXTS; None: nothing of a content
_CONTAINERS: Final = frozenset({"messages", "message", "content", "part"})  # "content": a string or a list of parts
_TEXTS: Final = frozenset({"leaf", "trimmed", "composite"})  # a content, a trimmed one, text holding one
_TYPE_TESTS: Final = frozenset({"string", "defined", "undefined", "none", "mapping", "iterable", "sequence",
                                "number", "integer", "float", "boolean", "callable", "true", "false"})
_LOOP_SAFE: Final = frozenset({"index", "index0", "revindex", "revindex0", "first", "last", "length",
                               "depth", "depth0"})
_DICT_NAMES: Final = frozenset(dir(dict))
_REQUEST_FIELDS: Final = frozenset({"tools", "documents", "chat_template_kwargs", "reasoning_effort", "chat_template"})
MAX_STRUCTURES: Final = 4096  # skeletons kept (a conversation adds one per turn count); past it they start again
_MARK: Final = "\u2003"  # whitespace that trim removes and no template writes around a marker
_MARKER: Final = re.compile(f"({_MARK}?)\x00(\\d+)\x01({_MARK}?)")

Skeleton = tuple[str | tuple[int, bool], ...]  # text, or (message index, trimmed)


class ChatSplice:
    """``render(doc)``: the chat text for a chat completions body, spliced where proven, else None
    (the caller renders with Jinja). ``env`` and ``source``: the template's environment and source;
    ``render_with(template, doc)``: the caller's renderer (chat_render.render_chat bound to the
    special tokens and content format), used for the probes and the first-use checks."""

    def __init__(self, env: Any, source: str, template: Any,
                 render_with: Callable[[Any, Mapping[str, Any]], str]) -> None:
        self._render_with = render_with
        self._template = template
        self._flagged = False
        self._probe: Any = None
        self._skeletons: dict[tuple[bool, tuple[str, ...]], Skeleton | None] = {}
        self._checked: set[tuple[bool, tuple[str, ...]]] = set()
        self.spliced = 0  # requests rendered by splicing
        self.disagreed = 0  # structures whose first splice differed from Jinja's text (left to Jinja)
        try:
            tree = env.parse(source)
            _Instrument(tree).run()
            probe = env.from_string(tree)
        except Exception as e:  # noqa: BLE001 - a template this walk cannot take is rendered by Jinja
            log.info("chat template not spliced: %s: %s", type(e).__name__, e)
            return
        probe.globals = {**template.globals, **self._helpers()}
        self._probe = probe

    @property
    def enabled(self) -> bool:
        return self._probe is not None

    def render(self, doc: Mapping[str, Any]) -> str | None:
        if self._probe is None:
            return None
        key = _structure(doc)
        if key is None:
            return None
        skeleton: Skeleton | Literal[False] | None = self._skeletons.get(key, False)
        if skeleton is False:
            if len(self._skeletons) >= MAX_STRUCTURES:
                self._skeletons.clear()
                self._checked.clear()
            skeleton = self._skeletons[key] = self._learn(key)
        if skeleton is None:
            return None
        messages = doc["messages"]
        text = "".join([p if type(p) is str else  # noqa: E721 - exact type: a str, not a tuple
                        (messages[p[0]]["content"].strip() if p[1] else messages[p[0]]["content"]) for p in skeleton])
        if key not in self._checked:
            self._checked.add(key)
            expected = self._render_with(self._template, doc)
            if expected != text:
                self.disagreed += 1
                self._skeletons[key] = None
                log.warning("chat template splicing disagreed with Jinja for roles %s: left to Jinja", key[1])
                return expected
        self.spliced += 1
        return text

    def _learn(self, key: tuple[bool, tuple[str, ...]]) -> Skeleton | None:
        """One render of the instrumented template with markers for the contents: the skeleton, or None
        if a use of a content ran that is not a copy (or the render failed)."""
        add_generation_prompt, roles = key
        doc = {"messages": [{"role": role, "content": f"{_MARK}\x00{i}\x01{_MARK}"} for i, role in enumerate(roles)],
               "add_generation_prompt": add_generation_prompt}
        self._flagged = False
        try:
            text = self._render_with(self._probe, doc)
        except Exception:  # noqa: BLE001 - NotTokenizable or anything a template raises: Jinja decides
            return None
        if self._flagged:
            return None
        parts: list[str | tuple[int, bool]] = []
        at = 0
        for m in _MARKER.finditer(text):
            if bool(m.group(1)) != bool(m.group(3)) or int(m.group(2)) >= len(roles):
                return None  # stripped on one side only: not a copy this walk allows
            parts.append(text[at:m.start()])
            parts.append((int(m.group(2)), not m.group(1)))
            at = m.end()
        parts.append(text[at:])
        if any("\x00" in p or "\x01" in p for p in parts if type(p) is str):  # noqa: E721
            return None
        return tuple(p for p in parts if p != "")

    def _helpers(self) -> dict[str, Callable[..., Any]]:
        def flag(value: Any = None) -> Any:
            self._flagged = True
            return value

        def text(value: Any) -> Any:
            if type(value) is not str:  # noqa: E721 - a list of parts written out or trimmed: not a copy
                self._flagged = True
            return value

        def parts(value: Any) -> Any:
            if isinstance(value, str):  # a content's characters iterated
                self._flagged = True
            return value

        def strftime_now(fmt: str) -> str:
            self._flagged = True
            return ""

        return {_FLAG: flag, _TEXT: text, _PARTS: parts, "strftime_now": strftime_now}


def _structure(doc: Mapping[str, Any]) -> tuple[bool, tuple[str, ...]] | None:
    """What a spliced text depends on besides the contents, or None for a body splicing does not take."""
    if not doc.keys().isdisjoint(_REQUEST_FIELDS):  # one C call for the usual body, which has none of them
        for field in _REQUEST_FIELDS:
            if doc.get(field) is not None and (field != "chat_template_kwargs" or doc[field]):
                return None
    generation, final = doc.get("add_generation_prompt"), doc.get("continue_final_message")
    if not (generation is None or type(generation) is bool) or not (final is None or final is False):
        return None  # continue_final_message, or a flag that is not a boolean (request_bool refuses it)
    messages = doc.get("messages")
    if type(messages) is not list or not messages:
        return None
    roles = tuple(map(plain_role, messages))
    return None if None in roles else (generation is not False, cast(tuple[str, ...], roles))


# -- the walk over the template ---------------------------------------------------------------------

_FLAG: Final = "_splice_flag_"
_TEXT: Final = "_splice_text_"
_PARTS: Final = "_splice_parts_"
Context = Literal["out", "set", "other"]


class _Instrument:
    """Wraps every use of a content (or of what holds one) that is not a copy into the output in a
    call that flags it (see the module docstring). Names' kinds come from their assignments,
    computed to a fixed point before the last walk changes the tree."""

    def __init__(self, tree: Any) -> None:
        self.tree = tree
        self.kinds: dict[str, Kind] = {"messages": "messages"}

    def run(self) -> None:
        for _ in range(8):
            before = dict(self.kinds)
            self.stmts(copy.deepcopy(self.tree).body, captured=False)
            if self.kinds == before:
                break
        else:
            raise ValueError("names' kinds do not settle")
        self.stmts(self.tree.body, captured=False)

    # statements
    def stmts(self, body: list[Any], captured: bool) -> None:
        for node in body:
            self.stmt(node, captured)

    def stmt(self, node: Any, captured: bool) -> None:
        if isinstance(node, n.Output):
            node.nodes = [self.value(child, "other" if captured else "out") for child in node.nodes]
        elif isinstance(node, n.Assign):
            if isinstance(node.target, n.Name):
                node.node, kind = self.expr(node.node, "set")
                self.assign(node.target.name, kind)
            else:
                node.node = self.value(node.node, "other")
        elif isinstance(node, n.For):
            iter_, kind = self.expr(node.iter, "set")
            element = {"messages": "message", "content": "part"}.get(kind or "")
            if kind == "content":
                iter_ = self.call(_PARTS, iter_)
            elif kind is not None and element is None:
                iter_, element = self.call(_FLAG, iter_), None
            if element is not None and not isinstance(node.target, n.Name):
                iter_, element = self.call(_FLAG, iter_), None
            node.iter = iter_
            if isinstance(node.target, n.Name):
                self.assign(node.target.name, element)
            if node.test is not None:
                node.test = self.value(node.test, "other")
            self.stmts(node.body, captured)
            self.stmts(node.else_, captured)
        elif isinstance(node, n.If):
            node.test = self.value(node.test, "other")
            self.stmts(node.body, captured)
            for elif_ in node.elif_:
                self.stmt(elif_, captured)
            self.stmts(node.else_, captured)
        else:  # macros, call and filter blocks, {% set %} blocks, with, do, ...: their text is a value
            self.generic(node)

    def generic(self, node: Any) -> None:
        for field, value in node.iter_fields():
            if isinstance(value, list):
                setattr(node, field, [self.child(v) for v in value])
            elif isinstance(value, n.Node):
                setattr(node, field, self.child(value))

    def child(self, value: Any) -> Any:
        if isinstance(value, n.Expr):
            return self.value(value, "other")
        if isinstance(value, n.Stmt):
            self.stmt(value, captured=True)
        elif isinstance(value, n.Node):
            self.generic(value)  # helpers: keywords, pairs, operands
        return value

    # expressions
    def value(self, node: Any, ctx: Context) -> Any:
        """``node`` where its kind must fit ``ctx``: wrapped when it does not."""
        node, kind = self.expr(node, ctx)
        if kind is None:
            return node
        if ctx == "out" and kind in _TEXTS:
            return node
        if ctx == "out" and kind == "content":
            return self.call(_TEXT, node)
        return self.call(_FLAG, node)

    def expr(self, node: Any, ctx: Context) -> tuple[Any, Kind]:
        if isinstance(node, n.Name):
            return node, self.kinds.get(node.name) if node.ctx == "load" else None
        if isinstance(node, (n.Getitem, n.Getattr)):
            return self.navigate(node)
        if isinstance(node, n.Filter) and node.node is not None:
            return self.filter(node, ctx)
        if isinstance(node, n.Test):
            base, kind = self.expr(node.node, "other")
            if kind is not None and node.name not in _TYPE_TESTS:
                base = self.call(_FLAG, base)
            node.node = base
            self.generic_args(node)
            return node, None
        if isinstance(node, (n.Add, n.Concat)) and ctx in ("out", "set"):
            operands = [node.left, node.right] if isinstance(node, n.Add) else node.nodes
            texts = False
            done = []
            for operand in operands:
                operand, kind = self.expr(operand, ctx)
                if kind in _TEXTS:
                    texts = True
                elif kind == "content":
                    operand, texts = self.call(_TEXT, operand), True
                elif kind is not None:
                    operand = self.call(_FLAG, operand)
                done.append(operand)
            if isinstance(node, n.Add):
                node.left, node.right = done
            else:
                node.nodes = done
            return node, "composite" if texts else None
        if isinstance(node, n.CondExpr) and ctx in ("out", "set"):
            node.test = self.value(node.test, "other")
            node.expr1, first = self.expr(node.expr1, ctx)
            if node.expr2 is None:
                return node, first
            node.expr2, second = self.expr(node.expr2, ctx)
            return node, _union(first, second)
        self.generic(node)
        return node, None

    def navigate(self, node: Any) -> tuple[Any, Kind]:
        """``x[key]`` / ``x.key``: a constant key into what holds a content gives what it holds."""
        base, kind = self.expr(node.node, "other")
        node.node = base
        if isinstance(node, n.Getattr):
            key: Any = node.attr
        else:
            if isinstance(node.arg, n.Slice):
                self.generic(node.arg)
            else:
                node.arg = self.value(node.arg, "other")
            key = node.arg.value if isinstance(node.arg, n.Const) else node.arg
        if kind is None:
            if isinstance(base, n.Name) and base.name == "loop" and isinstance(node, n.Getattr) \
                    and key not in _LOOP_SAFE:
                return self.call(_FLAG, node), None  # loop.previtem / nextitem / cycle ...
            return node, None
        result: Kind
        if kind == "messages":
            if isinstance(key, n.Slice):
                result = "messages"
            elif isinstance(key, (int, n.Expr)) and not isinstance(key, bool):
                result = "message"
            else:
                result = "flag"
        elif kind in ("message", "part"):
            own = "content" if kind == "message" else "text"
            if key == own:
                result = "content" if kind == "message" else "leaf"
            elif isinstance(key, str) and key not in _DICT_NAMES:
                result = None  # role, type, or a key these messages do not have
            else:
                result = "flag"
        else:
            result = "flag"
        if result == "flag":
            node.node = self.call(_FLAG, base)
            return node, None
        return node, result

    def filter(self, node: Any, ctx: Context) -> tuple[Any, Kind]:
        base, kind = self.expr(node.node, "other")
        result: Kind = None
        if kind is not None:
            if node.name == "trim" and not (node.args or node.kwargs or node.dyn_args or node.dyn_kwargs) \
                    and kind in ("leaf", "trimmed", "content"):
                if kind == "content":
                    base = self.call(_TEXT, base)
                result = "trimmed"
            elif node.name in ("length", "count") and kind in _CONTAINERS:
                if kind == "content":  # a list of parts has a structural length, a string does not
                    base = self.call(_PARTS, base)
                result = None
            else:
                base = self.call(_FLAG, base)
        node.node = base
        self.generic_args(node)
        return node, result

    def generic_args(self, node: Any) -> None:
        node.args = [self.value(a, "other") for a in node.args]
        for kw in node.kwargs:
            kw.value = self.value(kw.value, "other")
        if node.dyn_args is not None:
            node.dyn_args = self.value(node.dyn_args, "other")
        if node.dyn_kwargs is not None:
            node.dyn_kwargs = self.value(node.dyn_kwargs, "other")

    def assign(self, name: str, kind: Kind) -> None:
        self.kinds[name] = _union(self.kinds.get(name), kind) if name in self.kinds else kind

    def call(self, helper: str, node: Any) -> Any:
        return n.Call(n.Name(helper, "load", lineno=node.lineno), [node], [], None, None, lineno=node.lineno)


def _union(a: Kind, b: Kind) -> Kind:
    """A name assigned both: text kinds join as text; a container with anything else is unusable."""
    if a == b or b is None:
        return a
    if a is None:
        return b
    if a in _TEXTS and b in _TEXTS:
        return "composite"
    return "mixed"
