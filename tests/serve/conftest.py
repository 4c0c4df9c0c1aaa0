"""A real server on a free loopback port over a tiny random checkpoint with a local tokenizer."""
import os

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from checkpoints import make_checkpoint  # noqa: E402
from serve_helpers import API_KEY, MODEL, ServerThread, free_port, start_server  # noqa: E402,F401
from text_tokenizer import save_char_tokenizer  # noqa: E402

SMALL_MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "models", "small")


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> str:
    """Tiny random qwen2 whose EOS is the tokenizer's, with a chat template."""
    path = str(tmp_path_factory.mktemp("serve") / "tiny")
    make_checkpoint(path, vocab_size=97, eos_token_id=2, max_pos=1024)   # the speculator calibrates at 512
    save_char_tokenizer(path, chat_template=True)
    return path


@pytest.fixture(scope="module")
def server(chat_model):
    with start_server(chat_model, max_tokens_limit=64, max_request_bytes=16384, max_n=8) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
