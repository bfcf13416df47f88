"""`pdserve router`'s process: the OpenAI-compatible router, from its frozen settings.

deploy/process_cli.py reads the cluster config and calls ``run``; this
package never reads the config itself.
"""

from __future__ import annotations

from router.settings import RouterSettings


def run(settings: RouterSettings, log_level: str) -> int:
    from router.app import create_app
    from server_common.run import serve

    app = create_app(settings)
    serve(
        app,
        settings.listen_host,
        settings.port,
        log_level,
        app.state.drain,
        settings.drain_timeout_s,
        http=app.state.connections.protocol_class(),
        keep_alive_s=settings.client_keepalive_s,
    )
    return 0
