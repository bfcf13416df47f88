"""`pdserve prefill`'s process: one prefill server, from its frozen settings.

deploy/process_cli.py reads the cluster config and calls ``run``; this
package never reads the config itself.
"""

from __future__ import annotations

from server_common.kernel_cache import bound_kernel_caches
from server_common.settings import ServerSettings


def run(settings: ServerSettings, log_level: str) -> int:
    bound_kernel_caches()  # before the engine's first oneDNN kernel (server_common/kernel_cache.py)
    from kvlink.factory import RANK_AGENT, prefill_link_factory
    from prefill_server.app import create_app
    from prefill_server.service import PrefillService
    from server_common.connections import server_guard
    from server_common.engine_thread import build_engine
    from server_common.faults import FaultInjector
    from server_common.run import serve

    engine = build_engine(settings.engine, RANK_AGENT)  # ranks hold their KV senders
    faults = FaultInjector() if settings.fault_injection else None
    service = PrefillService(settings, engine, prefill_link_factory(settings, engine, faults), faults)
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
