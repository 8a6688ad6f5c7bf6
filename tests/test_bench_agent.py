"""`iquest bench agent` (bench/agent.py): the session it replays, built without a server (each turn the one before,
the model's reply and a repository file cut to the byte budget, with a call that its result answers), and short runs
on the mini model on CPU: against a server it starts itself, and against a running one (--url), each writing its
JSON and PNG; the flags that contradict each other are one-line errors."""

from __future__ import annotations

import json

import pytest

from iquest.bench.agent import FILES, ROOT, Session, read_head, summarize
from iquest.cli.main import main
from iquest.tests.helpers import MINI


def test_the_session_grows_by_a_reply_and_a_file_a_turn():
    s = Session(file_bytes=200)
    first = s.request()
    assert [m["role"] for m in first] == ["system", "user"]
    s.advance("a reply", "some thought")
    s.advance(None, None)
    msgs = s.request()
    assert msgs[:2] == first  # the head never changes: what prefix reuse keeps
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    for turn, (call, result) in enumerate([(msgs[2], msgs[3]), (msgs[4], msgs[5])]):
        (c,) = call["tool_calls"]
        assert result["tool_call_id"] == c["id"] == f"call_{turn}"
        assert json.loads(c["function"]["arguments"]) == {"path": FILES[turn], "max_bytes": 200}
        assert result["content"] == (ROOT / FILES[turn]).read_bytes()[:200].decode()
    assert msgs[2]["content"] == "a reply" and msgs[2]["reasoning_content"] == "some thought"
    assert msgs[4]["content"] is None and "reasoning_content" not in msgs[4]
    s.request()[0]["content"] = "changed"  # a request is a copy: the client may not alter the session
    assert s.request()[0] == first[0]


def test_files_are_real_cycle_and_cut_on_a_character(tmp_path):
    assert all((ROOT / f).is_file() and (ROOT / f).stat().st_size > 2000 for f in FILES)
    s = Session(file_bytes=10)
    assert [s.file(t) for t in range(len(FILES) + 1)] == [*FILES, FILES[0]]
    (tmp_path / "u.py").write_text("# é\n")   # 'é' is two bytes: a budget of 3 cuts inside it
    assert read_head("u.py", 3, tmp_path) == "# "


def test_summary_counts_what_the_rows_report():
    rows = [{"prompt_tokens": 100, "cached_tokens": 0, "completion_tokens": 8, "ttft_s": 0.4,
             "decode_tokens_per_s": 20.0, "total_s": 0.8},
            {"prompt_tokens": 300, "cached_tokens": 96, "completion_tokens": 8, "ttft_s": 0.2,
             "decode_tokens_per_s": 30.0, "total_s": 0.6}]
    s = summarize(rows)
    assert s["prompt_tokens"] == 400 and s["cached_tokens"] == 96 and s["completion_tokens"] == 16
    assert s["ttft_s_mean"] == pytest.approx(0.3) and s["ttft_s_mean_after_first"] == pytest.approx(0.2)
    assert s["decode_tokens_per_s_mean"] == pytest.approx(25.0) and s["total_s"] == pytest.approx(1.4)
    assert summarize([{**r, "cached_tokens": None} for r in rows])["cached_tokens"] is None


def check_report(path, turns: int, arms: int) -> dict:
    report = json.loads(path.read_text())
    assert path.with_suffix(".png").stat().st_size > 1000
    assert report["bench"] == "agent" and report["commit"] and report["machine"]["cpus"]
    assert report["command"].startswith("iquest bench agent") and len(report["arms"]) == arms
    for arm in report["arms"]:
        rows = arm["rows"]
        assert [r["turn"] for r in rows] == list(range(1, turns + 1))
        assert all(b["prompt_tokens"] > a["prompt_tokens"] + 40 for a, b in zip(rows, rows[1:]))  # a file a turn
        for r in rows:
            assert 0 < r["ttft_s"] <= r["total_s"] and 1 <= r["completion_tokens"] <= 6
            assert r["cached_tokens"] is None or 0 <= r["cached_tokens"] < r["prompt_tokens"]
        assert arm["summary"]["turns"] == turns
    return report


def bench(monkeypatch, argv: list[str]) -> int:
    """main() as the command line runs it (the report records sys.argv)."""
    monkeypatch.setattr("sys.argv", ["iquest", "bench", "agent", *argv])
    return main(["bench", "agent", *argv])


def test_a_short_session_against_a_server_it_starts(tmp_path, capsys, monkeypatch):
    out = tmp_path / "agent.json"
    assert bench(monkeypatch, ["--model", str(MINI), "--device", "cpu", "--turns", "3", "--max-tokens", "6",
                               "--file-bytes", "200", "--out", str(out)]) == 0
    report = check_report(out, 3, 1)
    assert report["model"] == "mini" and report["device"] == "cpu" and report["files"] == list(FILES[:2])
    assert report["arms"][0]["serve_started"].startswith("iquest serve: fast on cpu")
    assert report["arms"][0]["warmup"] is False  # auto: on only where the server runs on cuda
    err = capsys.readouterr().err
    assert err.count("] turn ") == 3 and "TTFT" in err  # progress a turn on stderr


def test_the_warm_up_leaves_the_timed_session_nothing_to_reuse(tmp_path, capsys, monkeypatch):
    """What --device cuda does by default, with reuse on: the warm-up's one turn keeps its prompt (237 tokens, which
    the mini model's 320-slot rings still hold), and the timed turn, the same prompt, would take 192 of them but for
    the warm-up's closing request."""
    out = tmp_path / "agent.json"
    assert bench(monkeypatch, ["--model", str(MINI), "--device", "cpu", "--turns", "1", "--max-tokens", "2",
                               "--prefix-reuse", "on", "--warmup", "on", "--out", str(out)]) == 0
    arm = json.loads(out.read_text())["arms"][0]
    assert arm["warmup"] and arm["rows"][0]["prompt_tokens"] > 64 and arm["rows"][0]["cached_tokens"] == 0
    assert capsys.readouterr().err.count("warm-up] turn ") == 1


def test_a_short_session_against_a_running_server(tmp_path, monkeypatch):
    from iquest.cli.engines import load_engine
    from iquest.serve.app import ServeOptions, create_app
    from iquest.serve.server import ServerThread, load_tokenizer

    app = create_app(load_engine("fast", MINI, 1, max_context=1024), load_tokenizer(MINI),
                     ServeOptions("iquest-q1-mini", api_key="k", max_context=1024))
    out = tmp_path / "remote.json"
    with ServerThread(app) as s:
        assert bench(monkeypatch, ["--url", s.url, "--api-key", "k", "--turns", "2", "--max-tokens", "4",
                                   "--file-bytes", "150", "--thinking", "off", "--out", str(out)]) == 0
    report = check_report(out, 2, 1)
    assert report["device"] == "remote" and report["thinking"] is False
    assert all(r["reply"]["reasoning"] is None and r["reply"]["content"] for r in report["arms"][0]["rows"])


@pytest.mark.parametrize("argv,needle", [
    (["--url", "http://127.0.0.1:1", "--compare"], "--compare"),
    (["--url", "http://127.0.0.1:1", "--prefix-reuse", "on"], "--prefix-reuse"),
    (["--url", "localhost:8000"], "--url"),
    (["--compare", "--prefix-reuse", "off"], "--compare"),
    (["--turns", "0"], "--turns"),
    (["--api-key", "k"], "--api-key"),
    (["--model", "/no/such/model"], "does not exist"),
])
def test_contradicting_flags_are_one_line_errors(capsys, argv, needle):
    assert main(["bench", "agent", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err
