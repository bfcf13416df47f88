"""What the router's OpenAPI document is held to in the fuzz tests: every check schemathesis has
(``schemathesis.checks``: status codes, content types, response schemas and headers, negative data
rejected, positive data accepted, not a server error, 405 with Allow for other methods, ignored
auth, ...), on a copy of the document whose ``model`` field is pinned to the served model, so
that generated requests get past the 404 to generation.

One check is narrowed, for a principled reason: ``positive_data_acceptance`` expects every
request the schema allows to be accepted, but a JSON schema cannot state the limits that are
counted in tokens after the chat template and the tokenizer ran (the prompt within
``router.max_prompt_tokens`` and, with ``max_tokens``, within the context), nor compare two
fields (``min_tokens`` at most ``max_tokens``, ``max_tokens`` 0 only with ``echo``,
``top_logprobs`` only with ``logprobs``, ``best_of`` equal to ``n``, ``background`` only with
``store``). A 400 naming exactly one of those limits
(``UNSTATED_LIMITS``: its ``param`` and ``code``) passes. So does a 400 naming a parameter
that carries a grammar (``GRAMMAR_PARAMS``): whether a JSON schema, regex or Lark grammar
compiles, whether a request names one constraint or two, and whether ``tool_choice`` names
one of the ``tools`` (or the model's template takes tools at all) is found by compiling and
comparing, which no JSON schema states. Any other refusal of valid data fails.
"""

from __future__ import annotations

import copy
import json

import schemathesis
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.specs.openapi.checks import positive_data_acceptance

GENERATION_REQUESTS = (
    "ChatCompletionRequest",
    "CompletionRequest",
    "ResponsesRequest",
    "TokenizeRequest",
    "DetokenizeRequest",
)
UNSTATED_LIMITS = {
    ("prompt", "invalid_value"),
    ("messages", "invalid_value"),  # router.max_prompt_tokens
    ("prompt", "context_length_exceeded"),
    ("messages", "context_length_exceeded"),  # the context
    ("max_tokens", "context_length_exceeded"),
    ("max_completion_tokens", "context_length_exceeded"),
    ("min_tokens", "invalid_value"),  # above the request's max_tokens
    ("max_tokens", "invalid_value"),  # 0 without echo
    ("top_logprobs", "invalid_value"),  # without logprobs true
    ("best_of", "invalid_value"),  # other than n
    ("input", "invalid_value"),  # /v1/responses: router.max_prompt_tokens
    ("input", "context_length_exceeded"),  # the context
    ("max_output_tokens", "context_length_exceeded"),
    ("background", "invalid_value"),  # /v1/responses: background true with store false
}

GRAMMAR_PARAMS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "tools",
    "tool_choice",
    "text",  # /v1/responses: text.format
)


def pinned(doc: dict, model: str) -> dict:
    """A copy of the router's document whose generation requests name ``model`` and only it."""
    doc = copy.deepcopy(doc)
    for name in GENERATION_REQUESTS:
        doc["components"]["schemas"][name]["properties"]["model"] = {"type": "string", "enum": [model]}
    return doc


def names_an_unstated_limit(response) -> bool:
    if response.status_code != 400:
        return False
    error = json.loads(response.content)["error"]
    param = error["param"] or ""
    grammar = param.split(".")[0].split("[")[0] in GRAMMAR_PARAMS
    return grammar or (param, error["code"]) in UNSTATED_LIMITS


def positive_data_accepted_within_unstated_limits(ctx, response, case):
    """``positive_data_acceptance``, but a 400 for a limit the schema cannot state passes (see above)."""
    if names_an_unstated_limit(response):
        return None
    return positive_data_acceptance(ctx, response, case)


def all_checks() -> list:
    """Every check schemathesis registers, with ``positive_data_acceptance`` narrowed as above."""
    load_all_checks()
    checks = [c for c in CHECKS.get_all() if c is not positive_data_acceptance]
    assert len(checks) == len(CHECKS.get_all()) - 1 >= 13, CHECKS.get_all_names()
    return [*checks, positive_data_accepted_within_unstated_limits]


def load(doc: dict, model: str, **kw) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_dict(pinned(doc, model), **kw)
