"""vLLM 0.32's answer to a body its pydantic model rejects.

``vllm/entrypoints/serve/exception_handling/handlers/validation.py``: a ``RequestValidationError``
becomes a 400 whose type is ``"Bad Request"``, whose ``param`` is the first error's location
(``body.FIELD``) and whose message is ``N validation error(s):`` then one line per error, the pydantic
error dict with its input summarised (a container as ``<dict of N items>``). Only the field kinds the
simulator's bodies use are modelled: required strings, lax booleans and lax integers.
"""

from __future__ import annotations

from typing import Any, NoReturn

from routerlab.sim.api import ApiError

_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "f", "false", "n", "no", "off"}


def _summary(value: Any) -> str:
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) else str(value)
    return text[:200] + "...[truncated]" if len(text) > 200 else text


def _bool_error(value: Any) -> tuple[str, str] | None:
    """Pydantic's lax bool: True/False, 0/1, and the usual words; else its error type and text."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return None
    if isinstance(value, str):
        if value.lower() in _TRUE | _FALSE:
            return None
        return "bool_parsing", "Input should be a valid boolean, unable to interpret input"
    return "bool_type", "Input should be a valid boolean"


def check_body(body: dict[str, Any], required: tuple[str, ...], flags: tuple[str, ...] = ()) -> None:
    """Raise vLLM's 400 for the ``required`` string fields and the boolean ``flags`` of ``body``."""
    errors: list[dict[str, Any]] = []
    for name in required:
        if name not in body:
            errors.append({"type": "missing", "loc": f"body.{name}", "msg": "Field required", "input": _summary(body)})
        elif not isinstance(body[name], str):
            errors.append({"type": "string_type", "loc": f"body.{name}", "msg": "Input should be a valid string",
                           "input": _summary(body[name])})
    for name in flags:
        bad = _bool_error(body[name]) if name in body else None
        if bad is not None:
            errors.append({"type": bad[0], "loc": f"body.{name}", "msg": bad[1], "input": _summary(body[name])})
    if errors:
        _reject(errors)


def _reject(errors: list[dict[str, Any]]) -> NoReturn:
    """vLLM's 400 for pydantic's ``errors`` (at most 10 listed)."""
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {e}\n" for e in errors[:10])
    raise ApiError(message.rstrip(), type_="Bad Request", param=errors[0]["loc"])


def integer(body: dict[str, Any], name: str, default: int = 0) -> int:
    """An integer field as pydantic's lax int reads it (an integral number, or a string of one); else
    vLLM's 400 for it."""
    value = body.get(name, default)
    if isinstance(value, int):  # bool too: pydantic's lax int takes it
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, float):
        kind, msg = "int_from_float", "Input should be a valid integer, got a number with a fractional part"
    elif isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            kind, msg = "int_parsing", "Input should be a valid integer, unable to parse string as an integer"
    else:
        kind, msg = "int_type", "Input should be a valid integer"
    _reject([{"type": kind, "loc": f"body.{name}", "msg": msg, "input": _summary(value)}])


def flag(body: dict[str, Any], name: str) -> bool:
    """A boolean field already checked by :func:`check_body` (default False)."""
    value = body.get(name, False)
    return value.lower() in _TRUE if isinstance(value, str) else bool(value)
