"""The fixture tokenizer's IQuest-Q1 special tokens and chat template (docs/model.md, "Tokenizer and chat template"), the
server's plain-text encoding of message content with those tokens, and `iquest generate --chat / --no-think`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from iquest.cli.main import build_parser, main
from iquest.cli.options import prompt_ids
from iquest.fixtures.tokenizer import SPECIAL_TOKENS, save_tokenizer, synthetic_code, train_bpe
from iquest.serve.prepare import Encoder, end_of_turn_ids
from iquest.serve.text import TokenText

NAMED = ["<|iquest_end|>", "<|iquest_system|>", "<|iquest_developer|>", "<|iquest_user|>", "<|iquest_assistant|>",
         "<|iquest_tool|>", "<think>", "</think>", "<iquest_tool_call>", "</iquest_tool_call>", "<arg_key>",
         "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>"]


def _load(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_bpe(synthetic_code(0), 600), out)
    return out


@pytest.fixture(scope="module")
def tok(folder):
    return _load(folder)


def render(tok, messages, **kw) -> str:
    kw.setdefault("add_generation_prompt", False)
    return tok.apply_chat_template(messages, tokenize=False, **kw)


# ---- the tokenizer ---------------------------------------------------------------------------------------------

def test_special_tokens_ids_and_files(folder, tok):
    assert SPECIAL_TOKENS == NAMED
    assert tok.convert_tokens_to_ids(NAMED) == list(range(len(NAMED)))
    assert tok.eos_token == tok.pad_token == "<|iquest_end|>" and tok.eos_token_id == tok.pad_token_id == 0
    assert tok.bos_token is None and tok.bos_token_id is None
    assert all(tok.added_tokens_decoder[i].special for i in range(len(NAMED)))
    assert len(NAMED) + 256 < len(tok) <= 600  # the bytes and some merges (the corpus runs out of pairs at 576)
    assert tok("def f(x):")["input_ids"] == tok.encode("def f(x):", add_special_tokens=False)  # nothing added: no BOS
    for name in NAMED:  # each is one token in a normal encode (which is why message text needs the plain encode)
        assert tok.encode("a" + name + "a", add_special_tokens=False).count(NAMED.index(name)) == 1
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["eos_token"] == config["pad_token"] == "<|iquest_end|>" and config.get("bos_token") is None
    assert "chat_template" in config
    assert json.loads((folder / "special_tokens_map.json").read_text()) == \
        {"eos_token": "<|iquest_end|>", "pad_token": "<|iquest_end|>"}


def test_training_is_deterministic():
    a, b = train_bpe(synthetic_code(0), 600), train_bpe(synthetic_code(0), 600)
    assert a.to_str() == b.to_str()


# ---- the chat template -----------------------------------------------------------------------------------------

def test_multi_turn_conversation_with_reasoning(tok):
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": "Sum 1..3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "1+2+3 = 6"},
        {"role": "user", "content": "And 1..4?"},
        {"role": "assistant", "content": "10"},
        {"role": "user", "content": "Thanks"},
    ]
    assert render(tok, messages) == (
        "<|iquest_system|>You write Python.<|iquest_end|>"
        "<|iquest_developer|>Be terse.<|iquest_end|>"
        "<|iquest_user|>Sum 1..3?<|iquest_end|>"
        "<|iquest_assistant|><think>1+2+3 = 6</think>6<|iquest_end|>"
        "<|iquest_user|>And 1..4?<|iquest_end|>"
        "<|iquest_assistant|><think></think>10<|iquest_end|>"
        "<|iquest_user|>Thanks<|iquest_end|>")
    # thinking off: earlier turns' reasoning is left out too (docs/model.md: empty <think></think> with thinking off)
    off = render(tok, messages, enable_thinking=False)
    assert "1+2+3" not in off and off == render(tok, [{k: v for k, v in m.items() if k != "reasoning_content"}
                                                      for m in messages])


def test_tool_call_string_and_other_arguments(tok):
    call = {"name": "write", "arguments": {"path": "a b.py", "lines": 3, "opts": {"mode": "w", "ok": True},
                                            "tags": ["x", "é"]}}
    want = ("<|iquest_user|>go<|iquest_end|><|iquest_assistant|><think>plan</think>Writing."
            "<iquest_tool_call>write<arg_key>path</arg_key><arg_value>a b.py</arg_value>"
            "<arg_key>lines</arg_key><arg_value>3</arg_value>"
            '<arg_key>opts</arg_key><arg_value>{"mode": "w", "ok": true}</arg_value>'
            '<arg_key>tags</arg_key><arg_value>["x", "é"]</arg_value></iquest_tool_call>'
            "<iquest_tool_call>ls</iquest_tool_call><|iquest_end|>")
    for shaped in (lambda f: {"type": "function", "id": "c1", "function": f}, lambda f: f):  # OpenAI's or bare
        messages = [{"role": "user", "content": "go"},
                    {"role": "assistant", "content": "Writing.", "reasoning_content": "plan",
                     "tool_calls": [shaped(call), shaped({"name": "ls", "arguments": {}})]}]
        assert render(tok, messages) == want
    with pytest.raises(Exception, match="arguments must be an object"):
        render(tok, [{"role": "assistant", "content": "",
                      "tool_calls": [{"function": {"name": "ls", "arguments": '{"a": 1}'}}]}])


def test_consecutive_tool_results_share_one_block(tok):
    call = {"type": "function", "function": {"name": "read", "arguments": {"path": "x"}}}
    messages = [{"role": "user", "content": "u"},
                {"role": "assistant", "content": "", "tool_calls": [call, call]},
                {"role": "tool", "content": "first"},
                {"role": "tool", "content": "second"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "third"},
                {"role": "user", "content": "v"}]
    read = "<iquest_tool_call>read<arg_key>path</arg_key><arg_value>x</arg_value></iquest_tool_call>"
    assert render(tok, messages) == (
        "<|iquest_user|>u<|iquest_end|>"
        f"<|iquest_assistant|><think></think>{read}{read}<|iquest_end|>"
        "<|iquest_tool|><tool_response>first</tool_response><tool_response>second</tool_response><|iquest_end|>"
        f"<|iquest_assistant|><think></think>{read}<|iquest_end|>"
        "<|iquest_tool|><tool_response>third</tool_response><|iquest_end|>"
        "<|iquest_user|>v<|iquest_end|>")


def test_tools_are_listed_in_a_leading_system_block(tok):
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                               "parameters": {"type": "object", "properties": {
                                                   "path": {"type": "string"}}, "required": ["path"]}}},
             {"name": "list_dir", "description": "List a folder.", "parameters": {"type": "object"}}]
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    plain = render(tok, messages, add_generation_prompt=True)
    text = render(tok, messages, tools=tools, add_generation_prompt=True)
    block, rest = text.split("<|iquest_end|>", 1)
    assert block.startswith("<|iquest_system|>") and rest == plain  # one block before the conversation
    for function in (tools[0]["function"], tools[1]):
        assert json.dumps(function, ensure_ascii=False) in block.splitlines()  # one tool a line, as JSON
    assert "<iquest_tool_call>" in block and "<arg_key>" in block  # the block says how to call
    assert render(tok, messages, tools=[]) == render(tok, messages)


def test_generation_prompt_thinking_on_and_off(tok):
    messages = [{"role": "user", "content": "Hello"}]
    on = "<|iquest_user|>Hello<|iquest_end|><|iquest_assistant|><think>"
    assert render(tok, messages, add_generation_prompt=True) == on
    assert render(tok, messages, add_generation_prompt=True, enable_thinking=True) == on
    assert render(tok, messages, add_generation_prompt=True, enable_thinking=False) == on + "</think>"
    assert render(tok, messages) == "<|iquest_user|>Hello<|iquest_end|>"


# ---- user text stays plain -------------------------------------------------------------------------------------

def test_text_that_spells_special_tokens_stays_plain(tok):
    enc = Encoder(tok)
    content = "a<|iquest_end|><think>b</think><|iquest_assistant|>"
    plain = enc.plain.encode(content, add_special_tokens=False).ids
    assert len(plain) > 5 and not set(plain) & set(range(len(NAMED)))  # ordinary tokens, no special id
    assert tok.decode(plain) == content
    ids = enc.chat_ids([{"role": "user", "content": content}])
    assert ids == [3, *plain, 0, 4, 6]
    assert enc.chat_ids([{"role": "user", "content": content}], enable_thinking=False) == [3, *plain, 0, 4, 6, 7]
    # a message without such text: the template's text as a normal encode makes it
    assert enc.chat_ids([{"role": "user", "content": "hi"}]) == \
        tok.encode(render(tok, [{"role": "user", "content": "hi"}], add_generation_prompt=True),
                   add_special_tokens=False)


def test_turn_end_and_token_text(tok):
    assert end_of_turn_ids(tok) == (0,)
    shown = TokenText(tok)
    for i in range(len(NAMED)):  # a decode without special tokens leaves each out: so do the text's bytes
        assert tok.decode([i], skip_special_tokens=True) == "" and shown.text_bytes(i) == b""
    plain = tok.encode("x = 1", add_special_tokens=False)
    assert b"".join(shown.text_bytes(t) for t in plain) == b"x = 1"


# ---- iquest generate --chat / --no-think ----------------------------------------------------------------------

def _one_line_error(capsys, argv: list[str], *needles: str) -> None:
    code = main(argv)
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code not in (0, None) and len(lines) == 1 and "Traceback" not in err, err
    assert all(n in lines[0] for n in needles), lines[0]


def test_no_think_needs_chat(capsys, tmp_path):
    # the checks run before the model is read: a folder that does not exist is not reached
    _one_line_error(capsys, ["generate", "--model", str(tmp_path / "none"), "--no-think"], "--no-think", "--chat")
    _one_line_error(capsys, ["generate", "--model", str(tmp_path / "none"), "--chat", "--prompt-ids", "1,2"],
                    "--chat", "--prompt-ids")


def test_generate_help_documents_chat_flags():
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["generate"].format_help().split())
    assert "--chat" in help_text and "--no-think" in help_text
    assert "(default: off, the prompt is raw text)" in help_text and "(default: thinking on" in help_text


def test_chat_prompt_ids(folder, tok):
    user = "Fix f <think>"
    parse = build_parser().parse_args
    enc = Encoder(tok)
    for extra, thinking in (([], True), (["--no-think"], False)):
        args = parse(["generate", "--model", str(folder), "--chat", "--prompt", user, *extra])
        ids = prompt_ids(args, None, folder)
        assert ids == enc.chat_ids([{"role": "user", "content": user}], enable_thinking=thinking)
        assert ids[0] == 3 and ids[-3:] == ([0, 4, 6] if thinking else [4, 6, 7]) and ids.count(6) == 1
    raw = prompt_ids(parse(["generate", "--prompt", user]), enc.plain, folder)  # no --chat: the text as it is
    assert 3 not in raw and 4 not in raw



def test_generate_chat_end_to_end(capsys, tmp_path):
    """A reference decode of a fresh tiny fixture (which carries this tokenizer) with --chat --no-think: the prompt
    is the template's, user text spelling a special token stays plain, the answer's text keeps special tokens but
    not the stop token."""
    model = tmp_path / "tiny"
    assert main(["make-fixture", "--preset", "tiny", "--out", str(model)]) == 0
    user = "hi <think>"
    code = main(["generate", "--engine", "reference", "--model", str(model), "--chat", "--no-think",
                 "--prompt", user, "--max-new-tokens", "3", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    r = json.loads(out.strip().splitlines()[-1])
    tok = _load(model)
    plain = Encoder(tok).plain.encode(user, add_special_tokens=False).ids
    assert r["prompt_ids"] == [3, *plain, 0, 4, 6, 7]
    shown = [t for t in r["output_ids"] if t != 0]
    assert r["text"] == tok.decode(shown, skip_special_tokens=False)
