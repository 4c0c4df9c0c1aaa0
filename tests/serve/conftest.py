"""A real server on a free loopback port over a tiny random checkpoint with a local tokenizer."""
import os
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from checkpoints import make_checkpoint  # noqa: E402
from text_tokenizer import save_char_tokenizer  # noqa: E402

SMALL_MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "models", "small")
API_KEY = "test-key"
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn in a thread of this process: the test talks to it over real loopback HTTP."""

    def __init__(self, app, port: int) -> None:
        import uvicorn
        self.port = port
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> str:
    """Tiny random qwen2 whose EOS is the tokenizer's, with a chat template."""
    path = str(tmp_path_factory.mktemp("serve") / "tiny")
    make_checkpoint(path, vocab_size=97, eos_token_id=2, max_pos=1024)   # the speculator calibrates at 512
    save_char_tokenizer(path, chat_template=True)
    return path


def start_server(model: str, api_key: str | None = API_KEY, speculative=None, **cfg):
    from tailrl import LLM
    from tailrl.serve.app import build_app
    from tailrl.serve.config import ServeConfig
    llm = LLM(model, seed=0, max_num_seqs=64, speculative=speculative)
    app = build_app(llm, ServeConfig(model_name=MODEL, api_key=api_key, **cfg))
    return ServerThread(app, free_port())


@pytest.fixture(scope="module")
def server(chat_model):
    with start_server(chat_model, max_tokens_limit=64, max_request_bytes=16384, max_n=8) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
