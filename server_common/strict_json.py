"""Request bodies hold JSON (RFC 8259) numbers only: ``NaN``, ``Infinity``, ``-Infinity`` and numbers
too large for a float (``1e999``, which Python reads as infinity) are refused, on the router and on
every internal server, with the usual validation error naming the field.

Python's ``json.loads`` accepts those constants, so a body carrying them got past parsing and reached
range checks with a NaN (which compares false with every bound: "should be less than or equal to 2")
or, in a field without a range or in a free-form one (a JSON schema, a transfer target), went further.
``StrictJSONRoute`` parses the body first; at the first such number it raises FastAPI's
``RequestValidationError`` located at that field (type ``finite_number``), which the app's handler
turns into its 400 (router) or 422 (servers). A body that is not JSON at all is left to FastAPI.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute


class _NotANumber:
    """What a non-finite number parses to, so that its place in the body can be reported."""

    def __init__(self, text: str) -> None:
        self.text = text


def _constant(text: str) -> _NotANumber:
    return _NotANumber(text)


def _float(text: str) -> float | _NotANumber:
    value = float(text)
    return _NotANumber(text[:40]) if math.isinf(value) else value


def _first_bad(doc: Any) -> tuple[tuple[str | int, ...], _NotANumber] | None:
    """The path to the first non-finite number in ``doc`` and its text, walked without recursion."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), doc)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, _NotANumber):
            return path, node
        if isinstance(node, dict):
            stack.extend((path + (k,), v) for k, v in reversed(node.items()))
        elif isinstance(node, list):
            stack.extend((path + (i,), v) for i, v in reversed(list(enumerate(node))))
    return None


class StrictJSONRequest(Request):
    async def check_numbers(self) -> None:
        """Parse the body once (FastAPI's ``json()`` then returns it); RequestValidationError at the
        first non-finite number. Bodies that are not JSON are left for FastAPI to refuse."""
        body = await self.body()
        if not body:
            return
        bad = False

        def constant(text: str) -> _NotANumber:
            nonlocal bad
            bad = True
            return _constant(text)

        def number(text: str) -> float | _NotANumber:
            nonlocal bad
            value = _float(text)
            bad = bad or isinstance(value, _NotANumber)
            return value

        try:
            doc = json.loads(body, parse_constant=constant, parse_float=number)
        except (ValueError, RecursionError):
            return  # not JSON (or nested past the parser): FastAPI's own parse answers
        if not bad:
            self._json = doc
            return
        path, found = _first_bad(doc)
        raise RequestValidationError(
            [
                {
                    "type": "finite_number",
                    "loc": ("body", *path),
                    "msg": f"{found.text} is not a finite number",
                    "input": found.text,
                }
            ]
        )


class StrictJSONRoute(APIRoute):
    """A route whose JSON body may hold finite numbers only (FastAPI's custom-request pattern)."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            checked = StrictJSONRequest(request.scope, request.receive)
            await checked.check_numbers()
            return await handler(checked)

        return strict
