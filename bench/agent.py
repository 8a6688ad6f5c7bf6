"""`iquest bench agent`: a coding agent's multi-turn session replayed against `iquest serve`, timed per turn.

Every turn sends the whole conversation so far, as an agent does: the previous turn's messages, the model's reply,
and the result of a read_file call whose content is a real source file of this repository (a fixed list, each cut
to --file-bytes). The prompt therefore grows by one reply and one file a turn while its head stays the same, which
is what prefix reuse exists for. Replies are greedy so that two runs (prefix reuse on and off, each against its own
server) replay the same conversation and differ only in what the server does with it.

The client is the official openai one, streaming chat completions with usage. Per turn: prompt tokens, the cached
tokens where the usage reports prompt_tokens_details.cached_tokens, time to the first token (the first chunk that
carries reasoning, content or a call: the server's opening chunk carries none), decode speed (tokens after the first
over the time after the first token, to the chunk that carries the finish reason) and the turn's total time.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What the agent reads, in order: the decode path top-down, then the server. Past the list's end the session starts
# over at its head (same files, a longer prompt).
FILES = ("fast/round.py", "reference/model.py", "fast/model.py", "reference/sampling.py", "serve/chat.py",
         "serve/app.py", "fast/cache.py", "serve/prepare.py", "reference/speculative.py", "fast/engine.py")
SYSTEM = "You are a coding agent working in the IQuestRT repository. Read files with read_file before answering."
TASK = ("Explain how one decode round flows from the fast engine's round through the model to the server's "
        "streamed reply. Read the files you need.")
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository (its first max_bytes bytes).",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "max_bytes": {"type": "integer"}},
                   "required": ["path"]}}}]


def read_head(path: str, budget: int, root: Path = ROOT) -> str:
    """The file's first `budget` bytes as text; a character cut at the end is dropped, not mangled."""
    return (root / path).read_bytes()[:budget].decode("utf-8", "ignore")


@dataclass
class Session:
    """The conversation an agent sends, turn by turn (no server needed: tests build it alone)."""

    file_bytes: int
    files: tuple[str, ...] = FILES
    root: Path = ROOT
    messages: list[dict] = field(default_factory=lambda: [{"role": "system", "content": SYSTEM},
                                                          {"role": "user", "content": TASK}])
    turn: int = 0

    def file(self, turn: int) -> str:
        return self.files[turn % len(self.files)]

    def request(self) -> list[dict]:
        return [dict(m) for m in self.messages]

    def advance(self, content: str | None, reasoning: str | None) -> None:
        """Add the model's reply and the read_file call the agent makes after it, with the call's result.
        The call is the script's, not the model's: the mini model writes no calls, and the replay must send the
        same conversation whatever the model wrote."""
        path = self.file(self.turn)
        cid = f"call_{self.turn}"
        reply: dict = {"role": "assistant", "content": content or None, "tool_calls": [
            {"id": cid, "type": "function",
             "function": {"name": "read_file", "arguments": json.dumps({"path": path, "max_bytes": self.file_bytes})}}]}
        if reasoning:
            reply["reasoning_content"] = reasoning
        self.messages += [reply, {"role": "tool", "tool_call_id": cid,
                                  "content": read_head(path, self.file_bytes, self.root)}]
        self.turn += 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_has_flag(flag: str) -> bool:
    done = subprocess.run([sys.executable, "-m", "iquest.cli.main", "serve", "--help"], capture_output=True,
                          text=True, timeout=120)
    return flag in done.stdout


class Server:
    """`iquest serve` in a subprocess on loopback, up once /health answers; stopped with SIGINT."""

    def __init__(self, model: str | None, device: str, max_context: int, prefix_reuse: str | None):
        self.port = free_port()
        self.cmd = [sys.executable, "-m", "iquest.cli.main", "serve", "--device", device, "--port", str(self.port),
                    "--max-context", str(max_context), "--log-level", "warning"]
        if model:
            self.cmd += ["--model", model]
        if prefix_reuse is not None:
            self.cmd += ["--prefix-reuse", prefix_reuse]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Server":
        import httpx

        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        end = time.monotonic() + 600   # a full model loads for minutes
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"iquest serve exited ({self.proc.returncode}): {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > end:
                self.__exit__()
                raise RuntimeError(f"iquest serve did not come up in 600 s: {self.tail()}")
            time.sleep(0.2)

    def tail(self, lines: int = 20) -> str:
        self.log.seek(0)
        return "".join(self.log.readlines()[-lines:]).strip()

    def __exit__(self, *exc) -> None:
        import signal

        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.started_line = next((ln for ln in self.tail(200).splitlines() if ln.startswith("iquest serve:")), None)
        self.log.close()


def timed_turn(client, model: str, messages: list[dict], max_tokens: int, thinking: bool, seed: int) -> dict:
    """One streamed turn: its reply and its times (seconds from the request's start)."""
    start = time.perf_counter()
    first = end = None
    reasoning, content, calls, finish, usage = [], [], 0, None, None
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens, temperature=0, seed=seed, stream=True,
        stream_options={"include_usage": True}, extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    for chunk in stream:
        now = time.perf_counter() - start
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        r = getattr(d, "reasoning_content", None) or ""
        if (r or d.content or d.tool_calls) and first is None:
            first = now
        reasoning.append(r)
        content.append(d.content or "")
        calls += len(d.tool_calls or [])
        if chunk.choices[0].finish_reason is not None:
            finish, end = chunk.choices[0].finish_reason, now
    total = time.perf_counter() - start
    if usage is None:
        raise RuntimeError("the stream carried no usage (stream_options.include_usage)")
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    tokens = usage.completion_tokens
    decode = (tokens - 1) / (end - first) if first is not None and end is not None and tokens > 1 and end > first \
        else None
    return {"prompt_tokens": usage.prompt_tokens, "cached_tokens": cached, "completion_tokens": tokens,
            "ttft_s": first, "decode_tokens_per_s": decode, "total_s": total, "finish_reason": finish,
            "model_calls": calls, "reply": {"reasoning": "".join(reasoning) or None, "content": "".join(content)}}


def run_session(url: str, turns: int, max_tokens: int, file_bytes: int, thinking: bool, seed: int,
                api_key: str | None, label: str) -> list[dict]:
    import httpx
    import openai

    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or "unused", max_retries=0,
                           timeout=3600)
    model = httpx.get(url.rstrip("/") + "/v1/models", timeout=30,
                      headers={"Authorization": f"Bearer {api_key}"} if api_key else None).json()["data"][0]["id"]
    session = Session(file_bytes)
    rows = []
    for turn in range(turns):
        if turn:
            prev = rows[-1]["reply"]
            session.advance(prev["content"], prev["reasoning"])
        r = timed_turn(client, model, session.request(), max_tokens, thinking, seed)
        r = {"turn": turn + 1, "file": session.file(turn - 1) if turn else None, **r}
        rows.append(r)
        cached = "" if r["cached_tokens"] is None else f" (cached {r['cached_tokens']})"
        decode = "-" if r["decode_tokens_per_s"] is None else f"{r['decode_tokens_per_s']:.1f}"
        print(f"[{label}] turn {turn + 1}/{turns}: prompt {r['prompt_tokens']} tokens{cached}, TTFT "
              f"{r['ttft_s'] if r['ttft_s'] is None else round(r['ttft_s'], 3)} s, decode {decode} tok/s over "
              f"{r['completion_tokens']} tokens, total {r['total_s']:.3f} s", file=sys.stderr, flush=True)
    return rows


def summarize(rows: list[dict]) -> dict:
    ttft = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    decode = [r["decode_tokens_per_s"] for r in rows if r["decode_tokens_per_s"] is not None]
    cached = [r["cached_tokens"] for r in rows if r["cached_tokens"] is not None]
    later = [r["ttft_s"] for r in rows[1:] if r["ttft_s"] is not None]
    return {"turns": len(rows), "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "cached_tokens": sum(cached) if cached else None,
            "completion_tokens": sum(r["completion_tokens"] for r in rows),
            "ttft_s_mean": sum(ttft) / len(ttft) if ttft else None,
            # the first turn has nothing to reuse: the later turns are where reuse shows
            "ttft_s_mean_after_first": sum(later) / len(later) if later else None,
            "ttft_s_last": rows[-1]["ttft_s"],
            "decode_tokens_per_s_mean": sum(decode) / len(decode) if decode else None,
            "total_s": sum(r["total_s"] for r in rows)}


def changed_files() -> list[str] | None:
    """Tracked files that differ from the commit: a result taken on a tree with edits in flight says so."""
    try:
        done = subprocess.run(["git", "diff", "--name-only", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.split() if done.returncode == 0 else None


def model_label(name: str) -> str:
    return name.removeprefix("iquest-q1-") or name


def machine(device: str) -> dict:
    out = {"host": platform.node(), "platform": platform.platform(), "processor": platform.processor() or
           platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        import torch

        out["torch"] = torch.__version__
        if device == "cuda" and torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return out


def warm_up(url: str, turns: int, max_tokens: int, file_bytes: int, thinking: bool, seed: int, api_key: str | None,
            label: str) -> None:
    """The session once, untimed, then one request under another system prompt. A server compiles a kernel the first
    time a shape needs it (seconds on a GPU, inside whichever turn first has that shape), so the timed session must
    find every shape compiled; the closing request replaces the prefix the server kept (it keeps the last request's),
    so the timed session's first turn has nothing to reuse, as a cold session's has not."""
    import openai

    run_session(url, turns, max_tokens, file_bytes, thinking, seed, api_key, f"{label}, warm-up")
    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or "unused", max_retries=0, timeout=600)
    client.chat.completions.create(model=served_name(url, api_key), max_tokens=1, temperature=0, messages=[
        {"role": "system", "content": "Warm-up over."}, {"role": "user", "content": "Reply with one token."}])


def run(*, url: str | None, model: str | None, device: str, prefix_reuse: str | None, compare: bool, turns: int,
        max_tokens: int, file_bytes: int, thinking: bool, max_context: int, seed: int, api_key: str | None,
        out: str | None, warmup: bool = False) -> dict:
    from ..provenance import commit

    # the servers run the tree as it is when they start: that is the commit of record, and a commit landing while
    # the session runs is noted beside it
    started_at = commit()
    arms = []
    if url:
        if warmup:
            warm_up(url, turns, max_tokens, file_bytes, thinking, seed, api_key, "server")
        rows = run_session(url, turns, max_tokens, file_bytes, thinking, seed, api_key, "server")
        arms.append({"arm": "running server", "url": url, "prefix_reuse": None, "warmup": warmup, "rows": rows,
                     "summary": summarize(rows)})
    for reuse in () if url else ("on", "off") if compare else (prefix_reuse,):
        with Server(model, device, max_context, reuse) as server:
            label = "server" if reuse is None else f"reuse {reuse}"
            command = "iquest " + shlex.join(server.cmd[3:])
            print(f"[{label}] {command}", file=sys.stderr, flush=True)
            if warmup:
                warm_up(server.url, turns, max_tokens, file_bytes, thinking, seed, api_key, label)
            rows = run_session(server.url, turns, max_tokens, file_bytes, thinking, seed, api_key, label)
        arms.append({"arm": label, "prefix_reuse": reuse, "serve_command": command, "warmup": warmup,
                     "serve_started": server.started_line, "rows": rows, "summary": summarize(rows)})
    name = model_label(served_name(url, api_key) if url else Path(model).name if model else "iquest-q1-mini")
    report = {"bench": "agent", "commit": started_at, "changed_files": changed_files(),
              "command": shlex.join(["iquest", *sys.argv[1:]]),
              "machine": machine(device), "device": device, "model": name,
              "turns": turns, "max_tokens": max_tokens, "file_bytes": file_bytes, "thinking": thinking,
              "seed": seed, "files": [FILES[i % len(FILES)] for i in range(max(turns - 1, 0))], "arms": arms}
    if commit() != started_at:
        report["commit_at_end"] = commit()
    if len(arms) == 2:
        a, b = (arm["rows"] for arm in arms)
        report["same_replies"] = [x["reply"] for x in a] == [y["reply"] for y in b]
        report["ttft_ratio_off_over_on"] = [y["ttft_s"] / x["ttft_s"] if x["ttft_s"] and y["ttft_s"] else None
                                            for x, y in zip(a, b)]
    path = Path(out) if out else ROOT / "bench" / "results" / f"agent-{name}-{report['device']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, path.with_suffix(".png"))
    print_table(report)
    print(f"wrote {path} and {path.with_suffix('.png')}", file=sys.stderr)
    return report


def served_name(url: str, api_key: str | None) -> str:
    import httpx

    return httpx.get(url.rstrip("/") + "/v1/models", timeout=30,
                     headers={"Authorization": f"Bearer {api_key}"} if api_key else None).json()["data"][0]["id"]


def print_table(report: dict) -> None:
    print(f"bench agent  model={report['model']} device={report['device']} turns={report['turns']} "
          f"max-tokens={report['max_tokens']} file-bytes={report['file_bytes']} commit={report['commit']}")
    print(f"{'arm':>14} {'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT (s)':>9} {'decode tok/s':>13} {'total (s)':>10}")
    for arm in report["arms"]:
        for r in arm["rows"]:
            cached = "-" if r["cached_tokens"] is None else str(r["cached_tokens"])
            ttft = "-" if r["ttft_s"] is None else f"{r['ttft_s']:.3f}"
            decode = "-" if r["decode_tokens_per_s"] is None else f"{r['decode_tokens_per_s']:.1f}"
            print(f"{arm['arm']:>14} {r['turn']:>4} {r['prompt_tokens']:>7} {cached:>7} {ttft:>9} {decode:>13} "
                  f"{r['total_s']:>10.3f}")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for arm, style in zip(report["arms"], ("o-", "s--")):
        rows = [r for r in arm["rows"] if r["ttft_s"] is not None]
        x = [r["prompt_tokens"] for r in rows]
        left.plot(x, [r["ttft_s"] * 1e3 for r in rows], style, label=arm["arm"])
        for r in rows:
            left.annotate(str(r["turn"]), (r["prompt_tokens"], r["ttft_s"] * 1e3), textcoords="offset points",
                          xytext=(3, 4), fontsize=7)
        decode = [r for r in arm["rows"] if r["decode_tokens_per_s"] is not None]
        right.plot([r["turn"] for r in decode], [r["decode_tokens_per_s"] for r in decode], style, label=arm["arm"])
    left.set_xlabel("prompt tokens (point labels: turn)")
    left.set_ylabel("time to first token (ms)")
    left.set_title("TTFT per turn")
    right.set_xlabel("turn")
    right.set_ylabel("decode tokens/s")
    right.set_title("decode after the first token")
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (left, right):
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"bench agent: {report['model']} on {report['device']}, {report['turns']} turns, "
                 f"{report['file_bytes']} B files ({report['commit']})", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
