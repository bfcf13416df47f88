"""The cluster half of the router: which worker serves a request, and the request's trip through the workers.

Admission, the choice of decode and prefill servers, the session that drives a request once admitted,
recovery when a step fails, and the workers themselves: who they are, whether they are healthy, which KV
blocks they hold. It never imports the API half (router/api/), which calls into it.

- dispatch: admitting a request and opening its decode stream
- session: one request's trip through the cluster once admitted
- admission: per-worker in-flight limits and a bounded waiting room
- recovery: what the router does when a step of a request fails (pure)
- policies: which worker gets the next request (pure)
- registry: the workers the router knows, their health and load
- health: passive health, from what real requests say about a worker
- discovery: workers joining and leaving at runtime
- kv_index: which block hashes each server holds (pure)
- kv_events: polling every worker's block-hash events into the ``KvIndex``
- worker_client: the router's HTTP calls to prefill and decode servers
- http_pool: the HTTP client's connection pool, with a scan linear in its connections
"""
