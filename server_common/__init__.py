"""The server runtime the prefill and decode servers (and the router, for its
own HTTP side) run on: the engine thread, settings, metrics, health and
vitals, the request guard and connection limits, tracing and timelines,
memory upkeep, fault injection's routes, and ``run`` (uvicorn with pdserve's
defaults). The control plane's schemas are ``wire``; everything KV is
``kvlink``.
"""
