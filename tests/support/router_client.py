"""The router app under a test client, its workers scripted (tests/support/fakes.py): no servers."""

from fastapi.testclient import TestClient

from router.app import create_app
from router.settings import RouterSettings, WorkerSpec
from tests.support.fakes import in_rotation

WORKERS = (
    WorkerSpec("p0", "prefill", "http://p0"),
    WorkerSpec("d0", "decode", "http://d0"),
    WorkerSpec("d1", "decode", "http://d1"),
)


def make_client(model, fake, **overrides):
    settings = RouterSettings(
        model_path=model.root, served_model_name="tiny", workers=WORKERS, queue_timeout_s=0.1, **overrides
    )
    return TestClient(in_rotation(create_app(settings, model=model, client=fake)), raise_server_exceptions=False)


def reply_ids(model, text):
    return model.tokenizer(text)["input_ids"]
