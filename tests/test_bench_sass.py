"""bench/sass.py: the decode round's kernels compiled for sm_90a on the CPU at one TP8 rank's shapes of docs/model.md's
model. The FP8 linear's preloaded weight tiles are all requested before the PDL wait, with nothing that waits for them
before it; every published-model kernel (bf16 forms) compiles without spilling and keeps the PDL contract; reads meant
to overlap the previous kernel come before the wait; an odd rank's expert shard reads one scale a row as rank 0's
does; the report reads real registers and instruction counts; the CLI rejects unknown kernels and malformed
overrides."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch

from iquest.bench import sass
from iquest.kernels import moe as mo
from iquest.kernels.testing import substitute
from iquest.tests.kernel_controls import linear_transparent


# The specs read the full model's config and lay out every tensor of it (0.3-0.6 s a call): built once a module, as
# the specs are frozen values (a test's variant is dataclasses.replace or compile_spec's overrides, never a mutation)
_specs = functools.lru_cache(maxsize=None)(sass.specs)
_published_specs = functools.lru_cache(maxsize=None)(sass.published_specs)


def _before_wait(spec, **constexprs) -> list[str]:
    seq = sass.sequence(sass.compile_spec(spec, **constexprs))
    assert seq.count("ACQBULK") == 1, "one griddepcontrol.wait"
    return seq[:seq.index("ACQBULK")]


def test_specs_are_the_published_rank_shapes():
    """q/k/v of one TP8 rank: 6 query heads and one KV head's k and v, 1024 rows of 3072; 24 K tiles in 8 splits on
    132 SMs, so 3 preloaded a program; o_proj's K is its 6 heads' 768 columns."""
    specs = _specs()
    assert set(specs) == {"fp8_linear", "fp8_linear_loop", "fp8_linear_direct"} | set(PUBLISHED)
    assert specs["fp8_linear"].constexprs["PRELOAD"] == 3 and "[1024 x 3072]" in specs["fp8_linear"].note
    assert specs["fp8_linear_direct"].constexprs["PRELOAD"] == 6


def test_preloaded_tiles_are_all_requested_before_the_wait():
    """q/k/v's preloaded tiles (2 x 128-bit loads a thread each) and their scales: every load issued before the wait,
    and no barrier there (a barrier before the wait is a layout conversion waiting for a tile's bytes, which would
    make the tiles' HBM round trips follow one another). Negative control: without the opaque move after the wait,
    Triton converts each tile right after its load, and the barriers appear. The loop form reads nothing before the
    wait."""
    spec = _specs()["fp8_linear"]
    tiles = spec.constexprs["PRELOAD"]
    early = _before_wait(spec)
    assert early.count("LDG") >= 2 * tiles + 2 * tiles and early.count("BAR") == 0, early
    control = _before_wait(dataclasses.replace(spec, fn=substitute(spec.fn, **linear_transparent())))
    assert control.count("BAR") >= tiles - 1 and control.count("LDG") >= 2 * tiles, control
    assert _before_wait(_specs()["fp8_linear_loop"]).count("LDG") == 0


def test_pdl_signals_after_the_wait():
    """The preloaded q/k/v projection signals the next launch once, after its wait (so at most two kernels are in
    flight: kernels/launch.py), with its weight tiles requested before that wait."""
    ptx = sass.compile_spec(_specs()["fp8_linear"]).asm["ptx"]
    wait, signal = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
    assert ptx.count("griddepcontrol.wait") == ptx.count("griddepcontrol.launch_dependents") == 1 and wait < signal
    assert "ld.global" in ptx[:wait]  # the preloads are issued first


def test_report_reads_registers_and_the_mix():
    r = sass.report(sass.compile_spec(_specs()["fp8_linear_loop"]))
    assert 32 <= r["registers"] <= 255 and r["stack_bytes"] == 0 and r["mix"].get("HMMA", 0) > 0
    assert r["instructions"] == sum(r["mix"].values())


def test_unknown_constexpr_is_refused():
    with pytest.raises(ValueError, match="no parameters"):
        sass.compile_spec(_specs()["fp8_linear"], NOT_A_PARAMETER=1)


def test_cli(tmp_path, capsys):
    from iquest.cli.main import main

    out = tmp_path / "sass.json"
    assert main(["bench", "sass", "--kernels", "fp8_linear", "--set", "fp8_linear.PRELOAD=0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["overrides"] == {"fp8_linear": {"PRELOAD": 0}} and report["kernels"]["fp8_linear"]["mix"]["HMMA"] > 0
    assert "fp8_linear (FP8 linear" in capsys.readouterr().out
    assert main(["bench", "sass", "--kernels", "moe_down_retired"]) != 0
    assert main(["bench", "sass", "--set", "fp8_linear"]) != 0
    assert main(["bench", "sass", "--kernels", "rmsnorm,moe_down_odd", "--out", str(out)]) == 0
    assert set(json.loads(out.read_text())["kernels"]) == {"rmsnorm", "moe_down_odd"}


# ---- the published model's kernels ------------------------------------------------------------------------------
PUBLISHED = ("attention_split", "attention_split_sliding", "attention_combine", "attention_combine_long", "qk_rope_kv",
             "qkv_rope_kv", "rmsnorm", "add_norm", "router_logits", "router_select", "o_proj_router", "add_norm_route",
             "prefetch_logits", "prefetch_warm",
             "moe_gate_up", "moe_down", "moe_gate_up_odd", "moe_down_odd", "moe_down_add_norm",
             "moe_combine",
             "moe_combine_add_norm", "all_reduce_add_norm", "all_reduce_combine_add_norm", "lm_head", "lm_head_draft",
             "lm_head_dot", "logprob_parts", "depth_rule")
# Stack bytes a kernel may use: none spills at the defaults (measured: the largest register count is the attention
# split kernel's 254 of 255, so a larger tile there would spill first and this catches it).
STACK_BOUND = {name: 0 for name in PUBLISHED}


@functools.lru_cache(maxsize=None)
def _compiled(name: str):
    return sass.compile_spec(_published_specs()[name])


def test_published_specs_are_the_rank_shapes():
    specs = _published_specs()
    assert tuple(specs) == PUBLISHED
    split, combine = specs["attention_split"].constexprs, specs["attention_combine_long"].constexprs
    assert (split["G"], split["D"], split["BLOCK_M"], split["NUM_SPLITS"]) == (6, 128, 64, 18)
    assert specs["attention_split_sliding"].constexprs["NUM_SPLITS"] == 131  # 4,161 slots, 32 a tile
    assert combine["NUM_SPLITS"] == 264 and combine["BLOCK_S"] == 128
    assert specs["moe_gate_up"].constexprs["G_OFF0"] == 0 and specs["moe_gate_up_odd"].constexprs["G_OFF0"] == 64
    assert specs["moe_down_odd"].constexprs["D_OFF1"] == 64 and specs["moe_down"].constexprs["BLOCK_K"] == 64
    assert specs["lm_head_dot"].constexprs["BLOCK_V"] == 32 and "20000 x 3072" in specs["lm_head"].note
    assert specs["lm_head"].constexprs["ROWS"] == 6 and specs["lm_head_draft"].constexprs["ROWS"] == 1
    assert specs["router_logits"].constexprs["PRELOAD"] and "6 H splits" in specs["router_logits"].note
    assert specs["qk_rope_kv"].constexprs["HKV"] == 1  # one KV head a rank: the launch compiles it in
    # the router fold at the rank's o_proj (6 heads' 768 columns) and 96 column tiles of 32
    assert "[3072 x 768]" in specs["o_proj_router"].note and specs["add_norm_route"].constexprs["E_PAD"] == 256
    assert "96 tiles" in specs["add_norm_route"].note
    # the expert prefetch at the rank's 192-row expert slabs: 4 and 5 live rows, 18 bulk requests of 32 KB a slab
    warm = specs["prefetch_warm"].constexprs
    assert (warm["W0"], warm["W1"], warm["W2"], warm["ISSUE"], warm["CHUNKS_PAD"]) == (4, 5, 0, True, 32)
    assert "589824 bytes" in specs["prefetch_warm"].note
    # the depth rule: every feature a term, a 20-candidate distribution in a 32-lane vector
    assert specs["depth_rule"].constexprs["TERMS"] == 5 and specs["depth_rule"].constexprs["KP"] == 32


SIDE_BRANCH = ("prefetch_logits", "prefetch_warm")  # the expert prefetch: a side stream's plain launches, no PDL


@pytest.mark.parametrize("name", [n for n in PUBLISHED if n not in SIDE_BRANCH])
def test_published_kernel_compiles_without_spills_and_keeps_the_pdl_contract(name):
    """bf16 forms for sm_90a: registers within the 255 a thread, stack within the bound; one wait and one signal to
    the next launch, the signal after the wait (kernels/launch.py)."""
    kernel = _compiled(name)
    r = sass.report(kernel)
    assert 16 <= r["registers"] <= 255 and r["stack_bytes"] <= STACK_BOUND[name], (name, r["registers"],
                                                                                   r["stack_bytes"])
    ptx = kernel.asm["ptx"]
    wait, signal = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
    assert ptx.count("griddepcontrol.wait") == ptx.count("griddepcontrol.launch_dependents") == 1 and wait < signal


@pytest.mark.parametrize("name", SIDE_BRANCH)
def test_the_prefetch_branch_compiles_without_spills_and_issues_its_bulk_prefetches(name):
    """The side branch's kernels follow a cross-stream event, not the previous kernel of a PDL chain: no wait, no
    signal. The selection's program issues its experts' slabs as bulk L2 prefetches (one instruction a 32 KB piece)."""
    kernel = _compiled(name)
    r = sass.report(kernel)
    assert 16 <= r["registers"] <= 255 and r["stack_bytes"] <= STACK_BOUND[name], (name, r)
    ptx = kernel.asm["ptx"]
    assert "griddepcontrol" not in ptx
    assert ("cp.async.bulk.prefetch.L2.global" in ptx) == (name == "prefetch_warm")
    if name == "prefetch_warm":
        assert "UBLKPF" in sass.sequence(kernel)


def test_the_routers_select_warms_its_chosen_experts_after_choosing():
    """The select with the routed prefetch (`route(warm=...)`, EngineOptions.routed_prefetch) ends in bulk L2 requests
    for the chosen experts' Gate and Up slabs, after its wait; without WARM (the engine's default) it issues none."""
    spec = _published_specs()["router_select"]
    ptx = _compiled("router_select").asm["ptx"]
    assert ptx.index("griddepcontrol.wait") < ptx.index("cp.async.bulk.prefetch.L2.global")
    assert "UBLKPF" in sass.sequence(_compiled("router_select"))
    assert "cp.async.bulk.prefetch" not in sass.compile_spec(spec, WARM=False).asm["ptx"]


def test_reads_meant_to_overlap_the_previous_kernel_come_before_the_wait():
    """The router's weight tile (preload: one tile a split), the attention split's first K/V lines asked of L2, the
    combine's sink logit (q and sink_k) and Down's routing and weight tile asked of L2 (both forms, the plain one and
    the one ending in the tail) are issued before the wait; the norms read nothing before it, nor Gate/Up (its
    experts come from the launch just before it)."""
    def before(name: str) -> str:
        ptx = _compiled(name).asm["ptx"]
        return ptx[:ptx.index("griddepcontrol.wait")]

    assert before("router_logits").count("ld.global") >= 4
    assert before("attention_split").count("prefetch.global.L2") >= 2
    assert before("attention_combine").count("ld.global") >= 2
    assert "ld.global" not in before("rmsnorm") and "ld.global" not in before("add_norm")
    for down in ("moe_down", "moe_down_odd", "moe_down_add_norm"):
        assert before(down).count("prefetch.global.L2") >= 1 and before(down).count("ld.global") >= 2, down
    assert "ld.global" not in before("moe_gate_up") and "prefetch" not in before("moe_gate_up")
    # the control: without the setting, nothing is asked of L2 anywhere in Down
    plain = sass.compile_spec(_published_specs()["moe_down"], PREFETCH=False).asm["ptx"]
    assert "prefetch.global.L2" not in plain


def test_gate_ups_product_form_drops_the_per_element_multiply():
    """The spec compiles the engine's settings, MoESettings.gate_up_scale="product" over its H splits, at both
    offsets: spill-free, and the weight form's multiply of every weight element by its scale (64 FMUL a thread a K
    step at 32 rows x 128 columns over 4 warps, both projections) is not in its K loop, which is shorter
    (`sass.dot_loop`)."""
    settings = mo.MoESettings()
    assert settings.gate_up_scale == "product" and settings.gate_up_split > 1
    for name in ("moe_gate_up", "moe_gate_up_odd"):
        spec = _published_specs()[name]
        assert spec.constexprs["SCALE_PRODUCT"] and spec.constexprs["SPLIT"] == settings.gate_up_split
        product = sass.report(_compiled(name))
        weight = sass.report(sass.compile_spec(spec, SCALE_PRODUCT=False))
        assert product["stack_bytes"] == 0 and product["registers"] <= 255, product
        w, p = weight["dot_loop"], product["dot_loop"]
        assert w["mix"].get("FMUL", 0) >= 64 and p["mix"].get("FMUL", 0) == 0, (w, p)
        assert p["instructions"] < w["instructions"], (w, p)


def test_downs_product_form_drops_the_multiply_and_fits_128_registers_under_its_cap():
    """MoESettings.down_scale="product" (the default): Down's K loop without the weight form's 64 FMUL a thread,
    shorter; it takes 142 registers on its own, and under MoESettings.down_registers=128 (Triton's maxnreg, the
    default) the same K loop in 128, spill-free, at both offsets. Down ending in the tail takes no cap (144 registers:
    it spills under 128)."""
    settings = mo.MoESettings()
    assert settings.down_scale == "product" and settings.down_registers == 128
    for name in ("moe_down", "moe_down_odd"):
        spec = _published_specs()[name]
        assert spec.constexprs["SCALE_PRODUCT"] and spec.options == {"maxnreg": settings.down_registers}, spec.options
        capped = sass.report(_compiled(name))
        weight = sass.report(sass.compile_spec(spec, SCALE_PRODUCT=False))
        uncapped = sass.report(sass.compile_spec(spec, maxnreg=0))
        w, u, c = weight["dot_loop"], uncapped["dot_loop"], capped["dot_loop"]
        assert w["mix"].get("FMUL", 0) >= 64 and c["mix"].get("FMUL", 0) == 0 and c["instructions"] < w["instructions"]
        assert uncapped["registers"] > settings.down_registers, uncapped  # what the cap is for
        assert capped["registers"] <= settings.down_registers and capped["stack_bytes"] == 0, capped
        assert c["instructions"] == u["instructions"], (c, u)
    fused = _published_specs()["moe_down_add_norm"]
    assert fused.constexprs["SCALE_PRODUCT"] and "maxnreg" not in fused.options, fused.options
    # the cap's floor: 8 registers fewer spill (`bench sass --set moe_down.maxnreg=120`), and so would the fused kernel
    # under Down's cap
    assert sass.report(sass.compile_spec(_published_specs()["moe_down"], maxnreg=120))["stack_bytes"] > 0
    assert sass.report(sass.compile_spec(fused, maxnreg=settings.down_registers))["stack_bytes"] > 0


def test_an_odd_ranks_expert_shard_reads_one_scale_a_row():
    """At TP8 an odd rank's 192 rows start 64 into a 128-row scale block: Gate/Up's K steps and Down's 64-column
    steps still lie inside one scale block each, so the kernels issue the global loads rank 0's do. Negative control:
    Down's K step at 128 straddles two blocks at offset 64, and its weight form falls back to a scale a weight
    element."""
    loads = {n: sum(sass.sequence(_compiled(n)).count(op) for op in ("LDG", "LDGSTS"))
             for n in ("moe_gate_up", "moe_gate_up_odd", "moe_down", "moe_down_odd")}
    assert loads["moe_gate_up_odd"] == loads["moe_gate_up"] and loads["moe_down_odd"] == loads["moe_down"], loads
    straddling = sass.sequence(sass.compile_spec(_published_specs()["moe_down_odd"], BLOCK_K=128, SCALE_PRODUCT=False))
    assert sum(straddling.count(op) for op in ("LDG", "LDGSTS")) > 4 * loads["moe_down_odd"]


def test_the_pair_major_grids_change_no_k_step_and_spill_nothing():
    """MoESettings.pair_major (the default): only the program's item is read from other grid axes (the pair slowest),
    so Gate/Up's (at the default split) and Down's K steps compile to the three-axis grid's instructions, spill-free,
    in its registers (more would cost Down a program an SM: 4 of 4 warps fit at 128)."""
    assert mo.MoESettings().pair_major
    for name in ("moe_gate_up", "moe_gate_up_odd", "moe_down"):
        pair = sass.report(_compiled(name))
        grid = sass.report(sass.compile_spec(_published_specs()[name], PAIR_MAJOR=False))
        assert pair["stack_bytes"] == 0 and pair["registers"] == grid["registers"], (name, grid, pair)
        assert pair["dot_loop"] == grid["dot_loop"], (name, grid["dot_loop"], pair["dot_loop"])
