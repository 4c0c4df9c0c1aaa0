"""A real OpenAI-compatible server on a free loopback port, in a thread of the test's process."""
import socket
import threading
import time

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


def start_server(model: str, api_key: str | None = API_KEY, speculative=None, engine: dict | None = None, **cfg):
    from tailrl import LLM
    from tailrl.serve.app import build_app
    from tailrl.serve.config import ServeConfig
    llm = LLM(model, seed=0, max_num_seqs=64, speculative=speculative, **(engine or {}))
    app = build_app(llm, ServeConfig(model_name=MODEL, api_key=api_key, **cfg))
    return ServerThread(app, free_port())
