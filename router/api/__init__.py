"""The OpenAI API half of the router: what a client sends and gets back, and how a request becomes its answer.

Requests are validated, templated and tokenized here, handed to the cluster half (router/cluster/) as
dispatch sessions, and their tokens turned back into OpenAI choices, chunks and errors.

- api_requests: client -> router, the OpenAI request bodies pdserve accepts
- api_responses: router -> client, OpenAI response bodies and stream chunks
- openai_handlers: the OpenAI endpoints' logic, between the thin routes and the dispatcher
- fanout: a request's sessions (one per prompt) -> its choices' deltas
- choices: one choice's text and log-probabilities, as a sequence's token events arrive
- textstream: token ids -> text, incrementally, and stop strings
- logprob_shapes: tokens with their log-probabilities -> the OpenAI and vLLM shapes
- sse: server-sent events as OpenAI streams them
- tools: tools (function calling), rendered by the chat template
- tool_calls: the model's ``<tool_call>`` blocks -> OpenAI tool calls
- structured: structured-output fields (OpenAI's and vLLM's) -> one ``StructuredSpec``
- grammar_check: compiling a client's grammar in a capped child process
- openapi: the published OpenAPI document
- model: the served model: name, context length, tokenizer and chat template
- limits: request limits: body size (413), prompt tokens and max_tokens (400)
"""
