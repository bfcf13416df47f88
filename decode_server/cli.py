"""`pdserve decode`'s process: one decode (or colocated) server, from its frozen settings.

deploy/process_cli.py reads the cluster config and calls ``run``; this
package never reads the config itself.
"""

from __future__ import annotations

from server_common.kernel_cache import bound_kernel_caches
from server_common.settings import ServerSettings


def run(settings: ServerSettings, log_level: str) -> int:
    bound_kernel_caches()  # before the engine's first oneDNN kernel (server_common/kernel_cache.py)
    from decode_server.app import create_app
    from decode_server.service import GenerationService
    from kvlink.factory import RANK_AGENT, receiver_factory
    from server_common.connections import server_guard
    from server_common.engine_thread import build_engine
    from server_common.faults import FaultInjector
    from server_common.run import serve

    engine = build_engine(settings.engine, RANK_AGENT)  # a decode rank holds its receiver
    faults = FaultInjector() if settings.fault_injection else None
    make_receiver = None
    if settings.role == "decode":
        make_receiver = receiver_factory(settings, engine, faults)
    service = GenerationService(settings, engine, make_receiver, faults)
    guard = server_guard(settings)
    service.metrics.registry.register(guard)
    serve(
        create_app(service),
        settings.listen_host,
        settings.port,
        log_level,
        service.drain,
        settings.drain_timeout_s,
        http=guard.protocol_class(),
    )
    return 0
