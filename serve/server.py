"""Starting the server: the tokenizer, uvicorn, and a server-in-a-thread (embedding, tests)."""

from __future__ import annotations

import contextlib
import signal
import threading
import warnings
import time
from pathlib import Path

import uvicorn

from .app import ServeOptions, create_app


def load_tokenizer(model_dir: str | Path):
    """The model folder's tokenizer (tokenizer.json + tokenizer_config.json with its chat_template)."""
    import transformers
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").exists():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json: the server needs the model's tokenizer")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # it reads config.json and warns that iquest_q1 is unknown to it
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return AutoTokenizer.from_pretrained(str(model_dir))
    finally:
        transformers.logging.set_verbosity(verbosity)


def uvicorn_config(app, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                          access_log=log_level == "debug")


class Server(uvicorn.Server):
    """uvicorn's server, but its shutdown (SIGTERM, SIGINT, `should_exit`) first drains the app's decode
    worker: new requests get 503, queued ones 503 at once, the running one an error event at its next
    Step. uvicorn then waits for those answers to go out, not for decodes to run to their end."""

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn raises a captured SIGTERM again once it has shut down, so the process ends 143; a clean
        # shutdown on SIGTERM exits 0, as a service manager expects
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals[:] = [s for s in self._captured_signals if s != signal.SIGTERM]

    async def shutdown(self, sockets=None) -> None:
        worker = getattr(getattr(self.config.app, "state", None), "worker", None)
        if worker is not None:
            worker.drain()
        await super().shutdown(sockets=sockets)


class ServerThread:
    """A live uvicorn server on a background thread: `with ServerThread(app) as s: ... s.url ...`.

    port=0 picks a free port; `url` is known once the server listens.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.server = Server(uvicorn_config(app, host, port, log_level))
        self.server.install_signal_handlers = lambda: None  # signals belong to the main thread
        self.thread = threading.Thread(target=self.server.run, name="iquest-serve", daemon=True)
        self.host = host

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def serve(engine, tokenizer, options: ServeOptions, host: str, port: int, log_level: str = "info") -> None:
    Server(uvicorn_config(create_app(engine, tokenizer, options), host, port, log_level)).run()
