"""What a fresh CPU machine runs: the main job without triton installed, `--drafts auto` choosing by this device's
measured costs, and a summary that separates start-up, prefill and decode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from iquest.cli.engines import default_model_dir
from iquest.cli.main import main
from iquest.fast.depth_policy import ROUND_COSTS_FILE, depth_policy
from iquest.tests.helpers import TINY, fixture_dir, mini_or_skip

ROOT = Path(__file__).resolve().parent.parent
NO_TRITON = "import sys; sys.modules['triton'] = None; from iquest.cli.main import main; sys.exit(main({argv!r}))"


@pytest.mark.parametrize("argv", [
    ["generate", "--max-new-tokens", "4"],  # the README's main job: the shipped model, the fast engine on CPU
    ["generate", "--max-new-tokens", "6", "--drafts", "5"],  # speculative rounds: the torch accept and settle
    ["generate", "--engine", "reference", "--max-new-tokens", "3"],
    ["info"],
])
def test_cpu_commands_run_where_triton_cannot_be_imported(argv):
    """With `import triton` failing (sys.modules['triton'] = None), as on a machine where only `pip install -e .` ran."""
    done = subprocess.run([sys.executable, "-c", NO_TRITON.format(argv=argv)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "triton" not in done.stderr.lower(), done.stderr[-3000:]


def test_blocking_triton_does_block_it():
    """The check above can fail: a module that imports triton at its top does fail under the same block."""
    code = "import sys; sys.modules['triton'] = None; import iquest.kernels.embed"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "triton" in done.stderr


def _costs(tmp_path: Path, **entry) -> Path:
    (tmp_path / ROUND_COSTS_FILE).write_text(json.dumps({"cpu": entry}))
    return tmp_path


def test_auto_is_plain_where_the_measured_plain_step_is_cheaper(tmp_path):
    policy = depth_policy("auto", _costs(tmp_path, plain_us_per_token=100.0, auto_us_per_token=300.0), "cpu")
    assert policy.drafts == 0 and "plain sampling on cpu" in policy.label
    # the same file says nothing about another device kind: there the controller stays
    assert depth_policy("auto", tmp_path, "cuda").drafts == "auto"


def test_auto_keeps_the_controller_where_drafting_pays_or_nothing_was_measured(tmp_path):
    assert depth_policy("auto", _costs(tmp_path, plain_us_per_token=300.0, auto_us_per_token=100.0), "cpu").drafts \
        == "auto"
    assert depth_policy("auto", tmp_path / "nowhere", "cpu").drafts == "auto"
    assert depth_policy(0, tmp_path, "cpu").drafts == 0 and depth_policy(5, tmp_path, "cpu").label == "fixed depth 5"


def test_a_broken_round_cost_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="plain_us_per_token"):
        depth_policy("auto", _costs(tmp_path, plain_us_per_token=-1, auto_us_per_token=1), "cpu")
    (tmp_path / ROUND_COSTS_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not a round-cost file"):
        depth_policy("auto", tmp_path, "cpu")


def test_the_shipped_model_measured_its_cpu_costs():
    entry = json.loads((mini_or_skip() / ROUND_COSTS_FILE).read_text())["cpu"]
    assert entry["command"].startswith("iquest fit-depth") and entry["tokens"]["plain"] > 0


def _generate(capsys, *argv: str) -> dict:
    assert main(["generate", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_auto_on_cpu_runs_what_the_costs_choose_and_says_so(capsys):
    """On the shipped model, CPU costs say plain sampling: `auto` then decodes exactly as `--drafts 0` (before the
    mini model lands in the published layout the default is tiny, with no costs: `auto` is the controller)."""
    chosen = depth_policy("auto", default_model_dir(), "cpu")
    auto = _generate(capsys, "--max-new-tokens", "12", "--seed", "4")
    explicit = _generate(capsys, "--max-new-tokens", "12", "--seed", "4", "--drafts", str(chosen.drafts))
    assert auto["output_ids"] == explicit["output_ids"]
    assert auto["summary"]["depth_policy"] == chosen.label
    drafted = [r["drafts"] for r in auto["rounds"][1:]]  # the first entry is the prefill's token
    assert all(d == 0 for d in drafted) if chosen.drafts == 0 else all(d >= 3 for d in drafted)


def test_summary_separates_startup_prefill_and_decode(capsys):
    r = _generate(capsys, "--model", str(TINY), "--max-new-tokens", "10", "--drafts", "3", "--seed", "2")
    s = r["summary"]
    assert s["startup_seconds"] > 0 and s["prefill_seconds"] > 0 and s["decode_seconds"] > 0
    decoded = len(r["output_ids"]) - 1  # the first token comes from the prefill
    assert s["decode_tokens_per_second"] == pytest.approx(decoded / s["decode_seconds"])
    assert s["engine_run"] == "fast on cpu, tp 1, fp32 activations, weights fp8; kernels: torch"
    assert s["depth_policy"] == "fixed depth 3"
    assert (s["device"], s["tp"], s["dtype"], s["weights"], s["kernels"]) == ("cpu", 1, "fp32", "fp8", "torch")
    assert s["kernel_groups"]["triton"] == [] and "moe" in s["kernel_groups"]["torch"]
    assert main(["generate", "--model", str(TINY), "--max-new-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert "start-up" in err and "prefill" in err and "decode" in err and "depth policy: auto" in err
    assert "weights fp8; kernels: torch" in err


@pytest.mark.parametrize("weights, shown",
                         [("auto", "weights bf16"), ("fp8", "weights fp8 (quantized at load from bf16)")])
def test_the_summary_names_the_weight_format(capsys, weights, shown):
    """A BF16 checkpoint runs as BF16 on the CPU by default (auto), as FP8 quantized at load when asked."""
    bf16 = fixture_dir("tiny", "bf16")
    r = _generate(capsys, "--model", str(bf16), "--max-new-tokens", "3", "--weights", weights, "--drafts", "3")
    assert shown in r["summary"]["engine_run"]
    assert r["summary"]["weights_quantized_at_load"] == (weights == "fp8")


def test_weights_bf16_on_an_fp8_checkpoint_is_one_line(capsys):
    assert main(["generate", "--model", str(TINY), "--weights", "bf16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--weights bf16" in err and "Traceback" not in err


def test_checkout_folders_do_not_shadow_installed_packages():
    """Under `python -m pytest` the checkout's folders (kernels/, reference/, ...) are not importable by their own
    names (tests/conftest.py), so an installed package of the same name, such as Hugging Face's `kernels` that
    transformers imports, is the one found."""
    import importlib.util

    folders = [p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()]
    assert "kernels" in folders
    found = {name: importlib.util.find_spec(name) for name in folders}
    assert not [n for n, spec in found.items() if spec is not None and str(ROOT) in str(spec.origin)], found


def test_the_kernel_plan_in_words_names_the_torch_forms():
    """What a GPU run's summary says: the groups on Triton kernels, then those the plan left on their torch forms."""
    from iquest.fast.engine import kernel_summary
    from iquest.fast.plan import KernelPlan

    assert kernel_summary(KernelPlan.torch()) == "torch"
    assert kernel_summary(KernelPlan.triton()) == "triton for linear, attention, norm, moe, lm_head, sampling, glue"
    assert kernel_summary(KernelPlan(linear=True)) == (
        "triton for linear; torch forms for attention, norm, moe, lm_head, sampling, glue (off in this plan)")