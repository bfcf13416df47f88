"""Fixtures of the bench tests: a tiny tokenizer trained on the spot, a fake OpenAI server."""

import http.server
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import pytest


def _train_tokenizer(out_dir, add_bos: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    words = (
        "alpha beta gamma delta epsilon zeta theta kappa lambda omega river stone cloud "
        "paper tiger lemon orange purple silver garden window market engine signal"
    ).split()
    corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(200)]
    corpus += ["Hello, world! 123 -- ok?", "naïve café über"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer folder with no special tokens added on encode."""
    return _train_tokenizer(tmp_path_factory.mktemp("tok_plain"), add_bos=False)


@pytest.fixture(scope="session")
def bos_tokenizer_dir(tmp_path_factory):
    """The same tokenizer, adding a BOS token on encode (like Llama)."""
    return _train_tokenizer(tmp_path_factory.mktemp("tok_bos"), add_bos=True)


def stream_completion(path: str, body: dict) -> tuple[int, Iterator[str]]:
    """A streamed completion of ``max_tokens`` tokens " t0", " t1", ..., then usage and [DONE]."""

    def events() -> Iterator[str]:
        for i in range(body["max_tokens"]):
            time.sleep(0.001)  # a token's time, so that inter-token latencies are not zero
            yield json.dumps({"choices": [{"text": f" t{i}", "finish_reason": None}]})
        usage = {
            "prompt_tokens": len(body["prompt"]) if isinstance(body["prompt"], list) else -1,
            "completion_tokens": body["max_tokens"],
        }
        yield json.dumps({"choices": [], "usage": usage})
        yield "[DONE]"

    return 200, events()


class SocketFake:
    """A fake OpenAI server on a real socket: GET /v1/models names ``model_root`` as the folder;
    a POST is answered by ``answer(path, body) -> (status, SSE data payloads)``."""

    def __init__(
        self,
        model_root,
        answer: Callable[[str, dict], tuple[int, Iterable[str]]] = stream_completion,
        model_id: str = "tiny",
    ):
        root = str(model_root)

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                data = json.dumps({"object": "list", "data": [{"id": model_id, "root": root}]}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                status, payloads = answer(self.path, body)
                self.send_response(status)
                self.send_header("content-type", "text/event-stream")
                self.send_header("connection", "close")
                self.end_headers()
                for data in payloads:
                    self.wfile.write(f"data: {data}\n\n".encode())
                    self.wfile.flush()
                self.close_connection = True

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def fake_openai_url(tiny_tokenizer_dir):
    """URL of a fake OpenAI server whose model folder is the tiny tokenizer."""
    server = SocketFake(tiny_tokenizer_dir)
    yield server.url
    server.close()
