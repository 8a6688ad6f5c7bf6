"""The `iquest` command line: generate (reference engine), make-fixture and check-checkpoint, in process and end to
end."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from iquest.cli.main import main
from iquest.reference.checkpoint import CheckpointReader

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "fixtures" / "tiny"
EOS = 0  # <|iquest_end|>


def generate(capsys, *extra: str, model: Path | str = TINY) -> dict:
    code = main(["generate", "--engine", "reference", "--model", str(model), "--json", *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def fails(capsys, argv: list[str], *needles: str) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code not in (0, None)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and "error" in lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def check_output_budget(result: dict, n: int) -> None:
    out = result["output_ids"]
    if EOS in out:  # a stop token ends the output early, and is its last token
        assert out.index(EOS) == len(out) - 1 and len(out) <= n
    else:
        assert len(out) == n


# ---- generate -------------------------------------------------------------------------------------------

def test_generate_json_shape(capsys):
    r = generate(capsys, "--max-new-tokens", "8", "--seed", "3")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    assert r["engine"] == "reference" and r["seed"] == 3
    assert r["prompt_ids"] == tok.encode("def fibonacci(n):\n").ids
    check_output_budget(r, 8)
    assert all(isinstance(t, int) and 0 <= t < 512 for t in r["output_ids"])
    assert r["text"] == tok.decode(r["output_ids"])
    assert [t for rnd in r["rounds"] for t in rnd["tokens"]] == r["output_ids"]
    for rnd in r["rounds"]:
        assert len(rnd["logprobs"]) == len(rnd["tokens"]) and all(lp <= 0 for lp in rnd["logprobs"])
        assert 0 <= rnd["accepted"] <= rnd["drafts"]
        assert len(rnd["tokens"]) <= rnd["accepted"] + 1
    assert r["summary"]["tokens"] == len(r["output_ids"])
    assert r["summary"]["rounds"] == len(r["rounds"]) - 1
    assert r["summary"]["engine_run"] == "reference (float64, CPU; the checkpoint's fp8 weights, dequantized exactly)"


def test_same_seed_same_output_different_seed_different(capsys):
    a = generate(capsys, "--max-new-tokens", "8", "--seed", "3")
    b = generate(capsys, "--max-new-tokens", "8", "--seed", "3")
    c = generate(capsys, "--max-new-tokens", "8", "--seed", "4")
    assert a["output_ids"] == b["output_ids"] and a["rounds"] == b["rounds"]
    assert a["output_ids"] != c["output_ids"]


def test_drafts_zero_is_plain_sampling(capsys):
    r = generate(capsys, "--max-new-tokens", "6", "--drafts", "0", "--seed", "1")
    check_output_budget(r, 6)
    assert all(rnd["drafts"] == 0 and len(rnd["tokens"]) == 1 for rnd in r["rounds"])


def test_drafts_fixed_three(capsys):
    r = generate(capsys, "--max-new-tokens", "10", "--drafts", "3", "--seed", "1")
    check_output_budget(r, 10)
    spec = r["rounds"][1:]
    assert spec and all(rnd["drafts"] <= 3 for rnd in spec) and spec[0]["drafts"] == 3
    assert all(len(rnd["served_probs"]) == rnd["drafts"] for rnd in spec)
    assert r["rounds"][0]["drafts"] == 0  # the first token comes from the prefill


def test_drafts_auto(capsys):
    r = generate(capsys, "--max-new-tokens", "6", "--drafts", "auto", "--seed", "2")
    check_output_budget(r, 6)
    assert all(rnd["drafts"] in (0, 3, 4, 5, 6, 7) for rnd in r["rounds"])


def test_prompt_ids(capsys):
    r = generate(capsys, "--prompt-ids", "5,6, 7", "--max-new-tokens", "4", "--seed", "0")
    assert r["prompt_ids"] == [5, 6, 7]
    check_output_budget(r, 4)


@pytest.mark.parametrize("n", [1, 5, 13])
def test_max_new_tokens_is_exact(capsys, n):
    r = generate(capsys, "--max-new-tokens", str(n), "--seed", "7", "--drafts", "3")
    check_output_budget(r, n)


def test_greedy_is_seed_independent(capsys):
    a = generate(capsys, "--max-new-tokens", "5", "--temperature", "0", "--drafts", "0", "--seed", "1")
    b = generate(capsys, "--max-new-tokens", "5", "--temperature", "0", "--drafts", "0", "--seed", "2")
    assert a["output_ids"] == b["output_ids"]


def test_streaming_text_and_summary(capsys):
    r = generate(capsys, "--max-new-tokens", "6", "--seed", "3", "--drafts", "3")
    code = main(["generate", "--engine", "reference", "--model", str(TINY), "--max-new-tokens", "6", "--seed", "3",
                 "--drafts", "3"])
    out, err = capsys.readouterr()
    assert code == 0
    assert out == r["text"].rstrip("\ufffd") + "\n" or out == r["text"] + "\n"  # a trailing partial char is held back
    assert err.startswith(f"[reference] {len(r['output_ids'])} tokens in {r['summary']['rounds']} rounds")


def test_model_without_tokenizer_needs_prompt_ids(capsys, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(TINY, model)
    (model / "tokenizer.json").unlink()
    fails(capsys, ["generate", "--engine", "reference", "--model", str(model)], "--prompt-ids")
    r = generate(capsys, "--prompt-ids", "3,4", "--max-new-tokens", "2", model=model)
    assert r["text"] is None and len(r["output_ids"]) in (1, 2)


# ---- bad input: non-zero exit, one line on stderr, no traceback -------------------------------------------

BASE = ["generate", "--engine", "reference", "--model", str(TINY), "--max-new-tokens", "4"]


@pytest.mark.parametrize("extra,needle", [
    (["--prompt-ids", ",".join(["5"] * 4100)], "context"),
    (["--prompt-ids", "1,512,3"], "512"),
    (["--prompt-ids", "-1"], "-1"),
    (["--prompt-ids", "1,x"], "--prompt-ids"),
    (["--prompt-ids", ","], "empty"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--top-k", "0"], "top_k"),
    (["--temperature", "-0.5"], "temperature"),
    (["--drafts", "9"], "--drafts"),
    (["--drafts", "2"], "--drafts"),
    (["--drafts", "many"], "--drafts"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--tp", "2"], "--tp"),
    (["--seed", "x"], "--seed"),
], ids=["too_long", "id_too_big", "id_negative", "id_not_int", "no_ids", "top_p_0", "top_p_big", "top_k_0",
        "temp_negative", "drafts_9", "drafts_2", "drafts_word", "max_new_0", "reference_tp2", "seed_word"])
def test_bad_generate_input(capsys, extra, needle):
    fails(capsys, BASE + extra, needle)


def test_missing_model_folder(capsys, tmp_path):
    fails(capsys, ["generate", "--engine", "reference", "--model", str(tmp_path / "nope")], "does not exist")
    fails(capsys, ["generate", "--engine", "reference", "--model", str(tmp_path)], "config.json")  # a folder, no model


def test_unknown_command_and_preset(capsys, tmp_path):
    fails(capsys, ["fly"], "fly")
    fails(capsys, ["make-fixture", "--preset", "huge", "--out", str(tmp_path)], "huge")


# ---- the inputs of issue 39: each a line naming the file, flag or value ------------------------------------------

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU says")


def _damaged_copy(tmp_path: Path, keep: int | None = None, text: bytes | None = None) -> tuple[Path, str]:
    model = tmp_path / "m"
    shutil.copytree(TINY, model)
    shard = next(model.glob("*.safetensors"))
    data = shard.read_bytes()
    shard.write_bytes(data[:keep] if text is None else text)
    return model, shard.name


@pytest.mark.parametrize("argv", [["generate", "--engine", "reference"], ["generate", "--engine", "fast"], ["info"]],
                         ids=["reference", "fast", "info"])
@pytest.mark.parametrize("keep", [300_000, 100], ids=["data_cut", "header_cut"])
def test_a_truncated_safetensors_file(capsys, tmp_path, argv, keep):
    model, shard = _damaged_copy(tmp_path, keep)
    line = fails(capsys, argv + ["--model", str(model)], shard, "truncated")
    assert str(keep) in line  # its size, beside what the header describes


def test_a_file_that_is_not_safetensors(capsys, tmp_path):
    model, shard = _damaged_copy(tmp_path, text=b"not a checkpoint at all")
    fails(capsys, ["info", "--model", str(model)], shard)


def test_info_checks_the_checkpoint_it_summarizes(capsys, tmp_path):
    assert main(["info", "--model", str(TINY)]) == 0
    assert "headers match the layout" in capsys.readouterr().out
    (tmp_path / "config.json").write_text((TINY / "config.json").read_text())  # configs with no weights
    (tmp_path / "mtp").mkdir()
    (tmp_path / "mtp" / "config.json").write_text((TINY / "mtp" / "config.json").read_text())
    fails(capsys, ["info", "--model", str(tmp_path)], "safetensors")
    shutil.rmtree(tmp_path / "mtp")  # no draft folder: the published layout keeps the draft in mtp/
    fails(capsys, ["info", "--model", str(tmp_path)], "mtp")


def test_a_corrupt_tokenizer(capsys, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(TINY, model)
    (model / "tokenizer.json").write_text("{not json")
    fails(capsys, BASE[:3] + ["--model", str(model)], "tokenizer.json")


def test_a_prompt_that_is_not_utf8(capsys, tmp_path, monkeypatch):
    # argv bytes that are not UTF-8 reach Python as surrogate escapes: b"\xff" is "\udcff"
    fails(capsys, BASE + ["--prompt", b"def \xff".decode("utf-8", "surrogateescape")], "--prompt", "UTF-8")
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"def f(x):\n    return '\xe9'\n")  # Latin-1, not UTF-8
    fails(capsys, BASE + ["--prompt-file", str(bad)], str(bad), "UTF-8", "0xe9")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe")))
    fails(capsys, BASE + ["--prompt", "-"], "stdin", "UTF-8")
    fails(capsys, BASE + ["--prompt-file", str(tmp_path / "none.txt")], "none.txt", "No such file")
    fails(capsys, BASE + ["--prompt-file", str(tmp_path)], str(tmp_path))


@NO_GPU
@pytest.mark.parametrize("argv", [
    ["generate", "--model", str(TINY)],
    ["qualify", "--model", str(TINY), "--quick"],
    ["debug", "diff", "--model", str(TINY)],
    ["debug", "chain", "--model", str(TINY)],
], ids=["generate", "qualify", "debug_diff", "debug_chain"])
def test_triton_kernels_on_cpu(capsys, monkeypatch, argv):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fails(capsys, argv + ["--kernels", "triton"], "--kernels triton", "TRITON_INTERPRET=1")
    monkeypatch.setitem(sys.modules, "triton", None)  # as where only `pip install -e .` ran
    fails(capsys, argv + ["--kernels", "triton"], "--kernels triton", "not installed")


@NO_GPU
@pytest.mark.parametrize("argv", [
    ["generate", "--model", str(TINY)],
    ["qualify", "--model", str(TINY), "--quick"],
    ["debug", "diff", "--model", str(TINY)],
    ["bench", "step", "--config", str(TINY / "config.json"), "--tp-slice", "2"],
], ids=["generate", "qualify", "debug_diff", "bench_step_config"])
def test_device_cuda_without_a_gpu(capsys, argv):
    fails(capsys, argv + ["--device", "cuda"], "--device cuda")


@NO_GPU
def test_bench_step_without_a_gpu(capsys):
    fails(capsys, ["bench", "step"], "bench step", "CUDA device")


def test_json_takes_no_file_name(capsys):
    fails(capsys, ["qualify", "--json", "report.json"], "report.json", "stdout")


# ---- prompts from a file or stdin ---------------------------------------------------------------------------

def test_prompt_from_a_file_or_stdin_is_the_prompt(capsys, tmp_path, monkeypatch):
    text = "def fibonacci(n):\n    # caf\u00e9 \u2192 ok\n"
    path = tmp_path / "prompt.py"
    path.write_text(text, encoding="utf-8")
    argv = ["--max-new-tokens", "2", "--seed", "5", "--drafts", "0"]
    inline = generate(capsys, "--prompt", text, *argv)
    assert generate(capsys, "--prompt-file", str(path), *argv)["prompt_ids"] == inline["prompt_ids"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    from_stdin = generate(capsys, "--prompt", "-", *argv)
    assert from_stdin["prompt_ids"] == inline["prompt_ids"] and from_stdin["output_ids"] == inline["output_ids"]


def test_a_prompt_past_the_argument_limit(capsys, tmp_path):
    """1 MB: more than one argv string may hold (128 KiB on Linux). It gets in, and meets the context check."""
    path = tmp_path / "big.txt"
    path.write_text("x = 1\n" * ((1 << 20) // 6 + 1))
    assert path.stat().st_size > 1 << 20
    fails(capsys, BASE + ["--prompt-file", str(path)], "prompt (", "context")


# ---- make-fixture ---------------------------------------------------------------------------------------

def test_make_fixture_writes_a_loadable_checkpoint(capsys, tmp_path):
    out = tmp_path / "fx"
    assert main(["make-fixture", "--preset", "tiny", "--out", str(out), "--seed", "1"]) == 0
    assert str(out) in capsys.readouterr().out
    r = CheckpointReader(out)
    assert r.config.vocab_size == 512 and r.block == (16, 16) and r.is_packed("model.layers.1.")
    r.read("mtp/mtp.eh_proj.weight_scale_inv")
    g = generate(capsys, "--max-new-tokens", "3", "--seed", "1", "--drafts", "3", model=out)
    check_output_budget(g, 3)


def test_make_fixture_weight_format_and_expert_storage(capsys, tmp_path):
    from iquest.fixtures.make import make_fixture

    out = tmp_path / "fx"
    assert main(["make-fixture", "--preset", "tiny", "--out", str(out), "--seed", "1", "--weights", "bf16",
                 "--unpacked"]) == 0
    assert "BF16" in capsys.readouterr().out
    r = CheckpointReader(out)
    assert r.block is None and not r.is_packed("model.layers.1.")
    same = make_fixture("tiny", tmp_path / "api", seed=1, packed=False, weights="bf16")
    for f in ("model-00001-of-00001.safetensors", "mtp/model-00001-of-00001.safetensors", "config.json"):
        assert (out / f).read_bytes() == (same / f).read_bytes(), f
    fails(capsys, ["make-fixture", "--preset", "tiny", "--out", str(tmp_path / "x"), "--weights", "int4"], "--weights")
    text = subprocess.run(_script() + ["make-fixture", "--help"], capture_output=True, text=True, env=_env(),
                          timeout=60).stdout
    assert "--weights {fp8,bf16}" in text and "--unpacked" in text and "default fp8" in text


# ---- check-checkpoint -----------------------------------------------------------------------------------

def test_check_checkpoint_reports_a_valid_folder(capsys):
    assert main(["check-checkpoint", str(TINY)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert lines[0] == f"{TINY}: valid"
    text = "\n".join(lines)
    for needle in ("4 layers: 2 full, 2 sliding (window 32)", "1 layer: 0 full, 1 sliding (window 16)",
                   "FP8 E4M3, 16x16 scale blocks", "packed", "<|iquest_end|>=0", "chat template  present",
                   "values         checked"):
        assert needle in text, needle

    assert main(["check-checkpoint", str(TINY), "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    r = json.loads(out)
    assert r["valid"] is True and r["error"] is None and r["values_checked"]
    assert r["target"]["layers"] == 4 and r["target"]["full_layers"] == 2 and r["target"]["sliding_layers"] == 2
    assert r["target"]["num_experts"] == 8 and r["target"]["hidden_size"] == 64 and r["draft"]["sliding_window"] == 16
    assert r["weights"] == {"format": "FP8", "block": [16, 16]} and r["experts"] == "packed"
    assert r["files"] == 2 and r["bytes"] == sum(f.stat().st_size for f in TINY.rglob("*.safetensors"))
    indexes = [TINY / "model.safetensors.index.json", TINY / "mtp" / "model.safetensors.index.json"]
    assert r["tensors"] == sum(len(json.loads(i.read_text())["weight_map"]) for i in indexes)
    assert r["logical_tensors"] == 164
    assert r["tp_degrees"] == [1, 2, 4]
    assert r["tokenizer"]["present"] and r["tokenizer"]["special_tokens"]["<|iquest_end|>"] == 0
    assert r["tokenizer"]["eos_token"] == {"token": "<|iquest_end|>", "id": 0} and r["tokenizer"]["bos_token"] is None
    assert r["chat_template"] is True and r["warnings"] == []


def test_check_checkpoint_bf16_per_expert_without_tokenizer(capsys, tmp_path):
    from iquest.fixtures.make import make_fixture

    d = make_fixture("micro", tmp_path / "m", seed=0, packed=False, weights="bf16")
    assert main(["check-checkpoint", str(d), "--json", "--headers-only"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["weights"] == {"format": "BF16", "block": None} and r["experts"] == "per-expert"
    assert r["values_checked"] is False and r["tokenizer"]["present"] is False and r["chat_template"] is False


def _broken(tmp_path: Path, how: str) -> Path:
    model = tmp_path / "m"
    shutil.copytree(TINY, model)
    if how == "no_mtp":
        shutil.rmtree(model / "mtp")
    elif how == "bad_config":
        raw = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps(dict(raw, rotary_dim=7)))
    elif how == "missing_tensor":
        from safetensors.torch import load_file, save_file

        f = model / "mtp" / "model-00001-of-00001.safetensors"
        tensors = load_file(f)
        del tensors["mtp.hnorm.weight"]
        save_file(tensors, str(f))
        index = json.loads((model / "mtp" / "model.safetensors.index.json").read_text())
        del index["weight_map"]["mtp.hnorm.weight"]
        (model / "mtp" / "model.safetensors.index.json").write_text(json.dumps(index))
    elif how == "nan_value":
        from safetensors.torch import load_file, save_file

        f = model / "model-00001-of-00001.safetensors"
        tensors = load_file(f)
        tensors["model.norm.weight"][3] = float("nan")
        save_file(tensors, str(f))
    elif how == "truncated":
        f = model / "model-00001-of-00001.safetensors"
        f.write_bytes(f.read_bytes()[:5000])
    return model


@pytest.mark.parametrize("how,needle", [
    ("no_mtp", "mtp/config.json"),
    ("bad_config", "rotary_dim=7"),
    ("missing_tensor", "missing tensor mtp/mtp.hnorm.weight"),
    ("nan_value", "tensor model.norm.weight holds non-finite values"),
    ("truncated", "truncated"),
])
def test_check_checkpoint_reports_a_broken_folder(capsys, tmp_path, how, needle):
    model = _broken(tmp_path, how)
    assert main(["check-checkpoint", str(model)]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == f"{model}: NOT VALID"
    assert needle in out.splitlines()[1] and out.splitlines()[1].startswith("  problem")
    assert err.strip().splitlines() == [err.strip()] and needle in err and "Traceback" not in err
    assert main(["check-checkpoint", str(model), "--json"]) == 1
    r = json.loads(capsys.readouterr().out)
    assert r["valid"] is False and needle in r["error"] and "\n" not in r["error"]
    assert r["tokenizer"]["present"]  # what it holds is still reported


def test_check_checkpoint_headers_only_misses_values(capsys, tmp_path):
    model = _broken(tmp_path, "nan_value")
    assert main(["check-checkpoint", str(model), "--headers-only"]) == 0
    assert "values         not read" in capsys.readouterr().out


def test_check_checkpoint_of_no_folder(capsys, tmp_path):
    assert main(["check-checkpoint", str(tmp_path / "nope"), "--json"]) == 1
    r = json.loads(capsys.readouterr().out)
    assert "does not exist" in r["error"] and r["files"] == 0


# ---- the real console script, end to end -------------------------------------------------------------------

def _script() -> list[str]:
    exe = shutil.which("iquest")
    return [exe] if exe else [sys.executable, "-m", "iquest.cli.main"]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def test_console_script_generate_end_to_end(tmp_path):
    cmd = _script() + ["generate", "--engine", "reference", "--model", str(TINY), "--max-new-tokens", "8",
                       "--seed", "3", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    check_output_budget(r, 8)
    assert r["text"] is not None and r["rounds"]


def test_console_script_error_has_no_traceback(tmp_path):
    cmd = _script() + ["generate", "--engine", "reference", "--model", str(TINY), "--prompt-ids", "1,2,99999"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120)
    assert p.returncode == 2
    assert p.stdout == ""
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "Traceback" not in p.stderr
    assert "99999" in p.stderr


def test_ctrl_c_while_torch_imports(tmp_path):
    """SIGINT as soon as the process maps libtorch (inside `import torch`, which main() does after its Ctrl-C handling
    is in place): one line and 130, as a Ctrl-C mid-decode gives. The child starts with SIGINT's default action: a
    pytest started as a non-interactive shell's background job (`pytest &`) has SIGINT ignored, which a child inherits,
    and Python then installs no handler for it (the process ran to the end and exited 0)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc to see when torch starts loading")
    cmd = _script() + ["generate", "--engine", "reference", "--model", str(TINY), "--prompt-ids", "1,2"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while p.poll() is None and time.monotonic() < deadline:
        try:
            if "libtorch" in Path(f"/proc/{p.pid}/maps").read_text():
                break
        except OSError:
            pass
        time.sleep(0.002)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert err.strip() == "iquest generate: interrupted", err
