"""`iquest --help`: every default stated, one example per command that parses, the flags the commands share spelled
and meaning the same everywhere; `iquest --version` and `python -m iquest`."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import iquest
from iquest.cli.main import EXAMPLES, _parsers, build_parser, main
from iquest.fast.plan import CHOICES
from iquest.reference.config import GenerationConfig

ROOT = Path(__file__).resolve().parent.parent
PARSERS = dict(_parsers(build_parser(), ""))
OPTIONS = [(name, a) for name, p in PARSERS.items() for a in p._actions
           if a.option_strings and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))]


def _shown(default) -> list[str]:
    """The ways a help text may spell a default."""
    if isinstance(default, tuple):
        return [",".join(map(str, default))]
    if isinstance(default, float):
        return [f"{default:g}"]
    return [str(default), repr(default), str(default).replace(",", ", ")]


@pytest.mark.parametrize("name,action", [(n, a) for n, a in OPTIONS if a.default not in (None, False, [])
                                         and not a.required],
                         ids=[f"{n}:{a.dest}" for n, a in OPTIONS if a.default not in (None, False, [])
                              and not a.required])
def test_every_default_is_stated(name, action):
    text = action.help or ""
    assert "default" in text and any(s in text for s in _shown(action.default)), (name, action.option_strings, text)


def test_sampling_defaults_come_from_the_generation_config():
    """generate's help names the values the shipped model's generation_config.json holds, which are also what a model
    without that file gets."""
    help_of = {a.dest: a.help for a in PARSERS["generate"]._actions}
    from iquest.cli.engines import default_model_dir

    shipped = json.loads((default_model_dir() / "generation_config.json").read_text())
    for key, shown in (("temperature", "1.0"), ("top_k", "20"), ("top_p", "0.95")):
        assert str(shipped[key]) == str(getattr(GenerationConfig, key)) == shown
        assert f"default: the model's generation_config.json, {shown}" in help_of[key], help_of[key]
    assert "auto (default)" in help_of["drafts"]


def test_every_command_has_an_example_that_parses():
    assert set(PARSERS) - {""} <= set(EXAMPLES) and "iquest" in EXAMPLES
    parser = build_parser()
    for name, example in EXAMPLES.items():
        words = shlex.split(example.split(" > ")[0])
        assert words[0] == "iquest" and (name == "iquest" or words[1:1 + len(name.split())] == name.split()), example
        parser.parse_args(words[1:])  # a usage error exits
    for name, p in PARSERS.items():
        assert f"example:\n  {EXAMPLES[name or 'iquest']}" in p.format_help(), name


def _flag(parser_name: str, flag: str):
    return next((a for a in PARSERS[parser_name]._actions if flag in a.option_strings), None)


def test_kernels_offer_the_user_choices_only():
    for name in ("generate", "qualify", "debug diff", "debug chain"):
        assert tuple(_flag(name, "--kernels").choices) == CHOICES, name
    assert "auto" in _flag("generate", "--kernels").help and "TRITON_INTERPRET=1" in _flag("generate", "--kernels").help


def test_device_is_auto_cuda_cpu_everywhere():
    having = [name for name in PARSERS if _flag(name, "--device")]
    assert {"generate", "serve", "qualify", "debug diff", "debug chain", "bench step"} <= set(having)
    for name in having:
        assert list(_flag(name, "--device").choices) == ["auto", "cuda", "cpu"], name


def test_weights_mean_the_same_everywhere():
    """--weights: what the fast engine's linears run as, on every command that builds one (and info, which counts
    them), with the documented default."""
    from iquest.fast.weights import WEIGHT_FORMATS

    having = [name for name in PARSERS if _flag(name, "--weights") and name != "make-fixture"]  # the format it writes
    assert {"generate", "serve", "info"} <= set(having)
    for name in having:
        action = _flag(name, "--weights")
        assert tuple(action.choices) == WEIGHT_FORMATS and action.default == "auto", name
    text = _flag("generate", "--weights").help
    assert "FP8 checkpoint as FP8" in text and "quantized once at load" in text and "BF16 elsewhere" in text


def test_json_means_stdout_everywhere_and_bench_keeps_out():
    having = {name: _flag(name, "--json") for name in PARSERS if _flag(name, "--json")}
    checkers = {"check-checkpoint"} & set(PARSERS)  # another command's, where it is registered
    assert set(having) == {"generate", "info", "qualify", "debug diff", "debug chain"} | checkers
    for name, action in having.items():
        assert action.nargs == 0 and "stdout" in action.help, name  # a flag, never a file name
    for name in PARSERS:
        if name.startswith("bench "):
            assert _flag(name, "--out") is not None, name
    assert "file of record" in PARSERS["bench"].description


def test_json_prints_one_object_on_stdout(capsys):
    assert main(["info", "--model", str(ROOT / "fixtures" / "tiny"), "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["checkpoint"]["tensors"] > 0 and out.count("\n") == 1


def test_version_and_python_m_iquest(tmp_path):
    for cmd in ([sys.executable, "-m", "iquest", "--version"], [sys.executable, "-m", "iquest.cli.main", "--version"]):
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=60)
        assert done.returncode == 0 and done.stdout.startswith(f"iquest {iquest.__version__} "), done


def test_the_entry_point_imports_nothing_heavy():
    """What lets main() catch a Ctrl-C during `import torch`: importing iquest.cli.main and building the parser import
    no torch (tests/test_cli.py sends the SIGINT)."""
    code = "import sys; from iquest.cli.main import build_parser; build_parser(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr
