"""`iquest serve` as a user starts it: a subprocess on 127.0.0.1 with --api-key, answered by the openai
client, stopped with SIGINT; SIGTERM mid-stream drains (an error event for the stream, 503 for the
queued, a prompt exit, no traceback); --help explains each flag; bad flags are one-line errors."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from iquest.cli.main import main
from iquest.tests.helpers import TINY, stop_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(*flags: str) -> tuple[subprocess.Popen, str]:
    """`iquest serve` on the tiny model in a subprocess, once /health answers; its URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "iquest.cli.main", "serve", "--model", str(TINY), "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > end:
            proc.kill()
            raise AssertionError("the server did not come up")
        time.sleep(0.1)


def test_serve_subprocess_with_api_key():
    proc, url = serve("--api-key", "k3y", "--max-context", "256", "--queue-size", "2", "--log-level", "warning")
    try:
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=10).status_code == 401
        client = openai.OpenAI(base_url=url + "/v1", api_key="k3y", max_retries=0, timeout=60)
        assert client.models.list().data[0].id == "tiny"
        a = client.completions.create(model="tiny", prompt="def f():", max_tokens=6, seed=9)
        b = client.completions.create(model="tiny", prompt="def f():", max_tokens=6, seed=9)
        assert a.choices[0].text == b.choices[0].text
    finally:
        stop_server(proc)
    assert proc.returncode is not None
    log = proc.stdout.read()  # the start-up line names what runs
    assert "iquest serve: fast on cpu, tp 1, fp32 activations, weights fp8; kernels: torch; depth policy" in log, log


def test_sigterm_drains_the_running_stream_and_the_queue():
    proc, url = serve("--max-context", "2048", "--queue-size", "2", "--drafts", "0")
    queued: dict = {}
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2000, "stream": True,
                                                              "seed": 1}) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")  # decoding
                waiter = threading.Thread(target=lambda: queued.setdefault("r", httpx.post(
                    url + "/v1/completions", json={"prompt": "y", "max_tokens": 4}, timeout=30)))
                waiter.start()
                end = time.monotonic() + 20
                while "iquest_queue_depth 1.0" not in http.get("/metrics").text:
                    assert time.monotonic() < end, "the second request was not queued"
                    time.sleep(0.02)
                sent = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
            waiter.join(30)
        proc.wait(10)
        exited = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    log = proc.stdout.read()
    assert exited < 3, f"exit took {exited:.1f} s"
    assert proc.returncode == 0, (proc.returncode, log)  # a clean shutdown on SIGTERM, not 143
    assert "503 the server is shutting down" in log, log  # a 5xx is logged, with its request id
    assert "[DONE]" not in events and json.loads(events[-1])["error"]["code"] == "shutting_down"
    assert queued["r"].status_code == 503 and queued["r"].json()["error"]["code"] == "shutting_down"
    assert "Traceback" not in log and "CancelledError" not in log, log


def test_serve_help_explains_each_flag(capsys):
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--engine", "--tp", "--host", "--port", "--api-key", "--queue-size", "--deadline",
                 "--max-context", "--drafts", "--served-model-name", "--max-body-size", "--weights"):
        assert flag in out
    assert "127.0.0.1" in out and "429" in out


@pytest.mark.parametrize("argv,needle", [
    (["--port", "70000"], "--port"),
    (["--queue-size", "-1"], "--queue-size"),
    (["--deadline", "-2"], "--deadline"),
    (["--max-body-size", "0"], "--max-body-size"),
    (["--model", "/no/such/model"], "does not exist"),
    (["--engine", "turbo"], "invalid choice"),
    (["--weights", "bf16"], "--weights bf16"),  # the tiny fixture is block FP8
])
def test_serve_bad_flags_are_one_line_errors(capsys, argv, needle):
    code = main(["serve", "--model", str(TINY), *argv] if "--model" not in argv else ["serve", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and needle in err and "Traceback" not in err
