"""`iquest bench depth`: the depth controller's gain over a fixed depth, paired, with an A/A' arm for the noise floor.

Three arms decode every held-out prompt (fixtures/fit_depth.py's `replay_prompts`: 12 lines of real code up to a
function header of the mini model's held-out files, less those `iquest fit-depth` fitted the controller on, which its
file lists) with the same request seed, in one engine in one process:

- A = fixed depth D (the control; D defaults to the best fixed depth that `iquest fit-depth` recorded beside the
  model, `depth_controller.json` "fit.cross_validation.best_fixed"),
- auto = the fitted controller (the engine's drafts="auto"),
- A' = fixed depth D again: the same work as A, so A'/A is the timing noise floor.

A unit of pairing is (prompt, seed); repeat r decodes prompt i with seed `--seed + r * prompts + i`, so every unit is
a distinct sample. Within a unit the arms run back to back in an order rotated per unit (A auto A', auto A' A, A' A
auto, ...), so drift hits all arms alike.

The post-prefill state: the engine offers no snapshot of its whole post-prefill state (prefix reuse restores the ring
caches of whole 64-row prefill blocks only, and re-prefills the rest), so each arm prefills the prompt itself and the
clock covers decode only: from the first token drawn after prefill to the last, as fixtures/round_costs.py does.
Prefill is deterministic, so every arm of a unit decodes from the same state: the report checks that their first
tokens and logprobs agree bit for bit, and that A and A' emit the same tokens (same mode, same seed). Fixed depth and
the controller are different exact samples of the same distribution (docs/round.md: a round's depth decides which
uniforms are drawn), so auto's tokens differ from A's past the first round; the pairing is on prompt and seed.

Statistics, kept simple: per arm, TPOT = decode seconds / decode tokens (the first token is prefill's), pooled over
the units, and its median over repeats; per unit, the ratios auto/A and A'/A. The headline is the median unit's ratio
with a 95% bootstrap interval over units (resampling whole units keeps the pairing; a median, because on a shared
machine one unit caught by another process's burst can move a pooled ratio by tens of percent), beside the pooled
ratio with its interval and a two-sided sign test. The gain counts as beyond noise when auto/A's interval excludes 1
and its distance from 1 exceeds the A'/A interval's widest distance from 1.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

from .agent import ROOT, changed_files, machine, model_label

BOOTSTRAP = 2000  # resamples of the units for the 95% intervals (numpy, seed 0: the same data, the same interval)
FALLBACK_FIXED = 3  # the mini model's best fixed depth under fit-depth's cost model, where a model records none


def best_fixed(model_dir: Path) -> tuple[int, str]:
    """The fixed depth to compare the controller with, and where it came from."""
    path = Path(model_dir) / "depth_controller.json"
    try:
        name = json.loads(path.read_text())["fit"]["cross_validation"]["best_fixed"]  # e.g. "fixed 3"
        return int(name.split()[-1]), f"{path.name} fit.cross_validation.best_fixed ({name!r})"
    except (OSError, KeyError, TypeError, ValueError, IndexError):
        return FALLBACK_FIXED, f"no fitted best fixed depth beside the model: {FALLBACK_FIXED}"


def held_out(model_dir: Path, tok, n: int) -> tuple[list[tuple[str, int, list[int]]], int]:
    """Up to `n` of the model's held-out prompts (fit_depth.replay_prompts, in its order) that the depth controller
    was not fitted on (its file's "fit.replay.prompts"), and how many were passed over as fitted on."""
    from ..fixtures.fit_depth import replay_prompts

    try:
        fitted = set(json.loads((Path(model_dir) / "depth_controller.json").read_text())["fit"]["replay"]["prompts"])
    except (OSError, KeyError, TypeError, ValueError):
        fitted = set()
    every = replay_prompts(model_dir, tok, 10 ** 6)
    fresh = [p for p in every if f"{p[0]}:{p[1]}" not in fitted]
    return fresh[:n], len(every) - len(fresh)


def arms(fixed: int) -> list[dict]:
    return [{"arm": "A", "drafts": fixed, "label": f"fixed:{fixed}"},
            {"arm": "auto", "drafts": "auto", "label": "controller"},
            {"arm": "A'", "drafts": fixed, "label": f"fixed:{fixed} again"}]


def order(unit: int, n: int) -> list[int]:
    """Arm indices for unit `unit`: 0 1 2, 1 2 0, 2 0 1, ..."""
    return [(unit + j) % n for j in range(n)]


def decode(engine, prompt: list[int], seed: int, drafts, tokens: int, params, stop) -> dict:
    """One request, timed from the first token drawn after prefill to the last (reading a step's tokens syncs the
    device, so the clock starts and stops on finished work)."""
    steps = engine.generate(prompt, seed=seed, params=params, max_new_tokens=tokens, drafts=drafts, stop_ids=stop)
    first = next(steps)
    t0 = time.perf_counter()
    rest = list(steps)
    seconds = time.perf_counter() - t0
    out = list(first.tokens) + [t for s in rest for t in s.tokens]
    return {"seconds": seconds, "tokens": len(out) - 1, "rounds": len(rest),
            "drafts": sum(s.drafts for s in rest), "accepted": sum(s.accepted for s in rest),
            "first": [first.tokens[0], first.logprobs[0]], "ids": out}


def pooled(records: list[dict]) -> float:
    """Seconds per decode token over the records (inf when none emitted any)."""
    n = sum(r["tokens"] for r in records)
    return sum(r["seconds"] for r in records) / n if n else math.inf


def ratio_stats(units: list[dict], num: str, den: str) -> dict:
    """The per-unit TPOT ratios num/den: their median with a 95% bootstrap interval over units (the headline: one
    unit hit by another process's burst moves it little), the pooled ratio (total seconds over total tokens, each
    arm) with its interval, and a sign test (units where num is faster). A unit where either arm decoded nothing (the
    first token was a stop) has no TPOT and is left out."""
    import numpy as np

    given = len(units)
    units = [u for u in units if u["arms"][num]["tokens"] and u["arms"][den]["tokens"]]
    if not units:
        raise ValueError("no unit decoded a token past the first in both arms: raise --tokens or --prompts")
    s = np.array([[u["arms"][num]["seconds"], u["arms"][den]["seconds"]] for u in units])
    n = np.array([[u["arms"][num]["tokens"], u["arms"][den]["tokens"]] for u in units], dtype=np.float64)
    per = (s[:, 0] / n[:, 0]) / (s[:, 1] / n[:, 1])
    idx = np.random.default_rng(0).integers(0, len(units), size=(BOOTSTRAP, len(units)))
    boot_median = np.median(per[idx], axis=1)
    boot_pooled = (s[idx, 0].sum(1) / n[idx, 0].sum(1)) / (s[idx, 1].sum(1) / n[idx, 1].sum(1))
    faster, slower = int((per < 1).sum()), int((per > 1).sum())
    return {"ratio": float(np.median(per)), "ci95": [float(x) for x in np.quantile(boot_median, [0.025, 0.975])],
            "pooled_ratio": float((s[:, 0].sum() / n[:, 0].sum()) / (s[:, 1].sum() / n[:, 1].sum())),
            "pooled_ci95": [float(x) for x in np.quantile(boot_pooled, [0.025, 0.975])],
            "units": len(units), "units_left_out": given - len(units), "faster": faster, "slower": slower,
            "sign_test_p": sign_test(faster, slower), "unit_ratios": [float(x) for x in per]}


def sign_test(k: int, m: int) -> float:
    """Two-sided exact binomial p of k successes against m failures at p = 1/2 (ties dropped)."""
    n = k + m
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(k, m) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def verdict(gain: dict, noise: dict) -> dict:
    floor = max(abs(noise["ci95"][0] - 1), abs(noise["ci95"][1] - 1))
    lo, hi = gain["ci95"]
    beyond = (hi < 1 or lo > 1) and abs(gain["ratio"] - 1) > floor
    return {"gain": gain["ratio"] - 1, "noise_floor": floor, "beyond_noise": bool(beyond),
            "rule": "the median unit's auto/A: its 95% interval excludes 1 and |auto/A - 1| exceeds the widest "
                    "|A'/A - 1| of the median A'/A's 95% interval"}


def run(*, model_dir: Path, device: str, prompts: int, tokens: int, repeats: int, fixed: int | None, seed: int,
        out: str | None) -> dict:
    import torch
    from tokenizers import Tokenizer

    from ..fast.engine import FastEngine
    from ..provenance import commit
    from ..reference.sampling import SamplingParams

    started_at, load_at_start = commit(), os.getloadavg()
    source = "--fixed"
    if fixed is None:
        fixed, source = best_fixed(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    chosen, fitted_on = held_out(model_dir, tok, prompts)
    if not chosen:
        raise ValueError(f"no held-out function headers found for {model_dir} outside the controller's fit")
    if len(chosen) < prompts:
        print(f"only {len(chosen)} held-out prompts outside the controller's fit (asked for {prompts})",
              file=sys.stderr, flush=True)
    the_arms = arms(fixed)
    engine = FastEngine.load(model_dir, device=device)
    units = []
    try:
        gen = engine.generation
        params, stop = SamplingParams(gen.temperature, gen.top_k, gen.top_p), tuple(gen.eos_token_id)
        described = engine.describe()
        print(f"bench depth: {described['text']}; {len(chosen)} prompts x {repeats} repeats x {tokens} tokens",
              file=sys.stderr, flush=True)
        for drafts in (fixed, "auto"):  # warm-up: kernels, captured graphs, allocator
            decode(engine, chosen[0][2], seed, drafts, min(tokens, 16), params, stop)
        for r in range(repeats):
            for i, (name, line, ids) in enumerate(chosen):
                unit = r * len(chosen) + i
                s = seed + unit
                done = {}
                for a in order(unit, len(the_arms)):
                    arm = the_arms[a]
                    done[arm["arm"]] = decode(engine, ids, s, arm["drafts"], tokens, params, stop)
                units.append({"unit": unit, "repeat": r, "prompt": i, "source": f"{name}:{line}",
                              "prompt_tokens": len(ids), "seed": s,
                              "order": [the_arms[a]["arm"] for a in order(unit, len(the_arms))],
                              "arms": {a["arm"]: done[a["arm"]] for a in the_arms}})
                print(f"repeat {r + 1}/{repeats} prompt {i + 1}/{len(chosen)}: " + ", ".join(
                    f"{k} {1e3 * pooled([v]):.2f} ms/token" if v["tokens"] else f"{k} stopped at once"
                    for k, v in units[-1]["arms"].items()),
                    file=sys.stderr, flush=True)
    finally:
        engine.close()
    report = summarize(units, the_arms, repeats)
    name = model_label(model_dir.name)
    report = {"bench": "depth", "commit": started_at, "changed_files": changed_files(),
              "command": shlex.join(["iquest", *sys.argv[1:]]) if sys.argv[1:2] == ["bench"] else
              f"iquest bench depth --model {model_dir} --device {device} --prompts {prompts} --tokens {tokens} "
              f"--repeats {repeats} --fixed {fixed} --seed {seed}",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(device) | {"torch_threads": torch.get_num_threads(), "load_average_1_5_15_min": {
                  "start": [round(x, 2) for x in load_at_start], "end": [round(x, 2) for x in os.getloadavg()]}},
              "device": device,
              "engine": described, "model": name, "prompts": len(chosen),
              "prompts_passed_over": f"{fitted_on} held-out prompts the controller was fitted on "
                                     "(depth_controller.json fit.replay.prompts)", "tokens": tokens, "repeats": repeats,
              "seed": seed, "fixed": fixed, "fixed_from": source,
              "sampling": {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p},
              "arms": the_arms, **report, "notes": notes(device), "units": units}
    if commit() != started_at:
        report["commit_at_end"] = commit()
    path = Path(out) if out else ROOT / "bench" / "results" / f"depth-{name}-{device}-{started_at}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)
    print(f"wrote {path}", file=sys.stderr)
    return report


def summarize(units: list[dict], the_arms: list[dict], repeats: int) -> dict:
    import numpy as np

    per_arm = {}
    for a in the_arms:
        recs = [u["arms"][a["arm"]] for u in units]
        by_repeat = [pooled([u["arms"][a["arm"]] for u in units if u["repeat"] == r]) for r in range(repeats)]
        rounds = sum(x["rounds"] for x in recs)
        per_arm[a["arm"]] = {
            "tpot_us": 1e6 * pooled(recs), "tpot_us_median_over_repeats": 1e6 * float(np.median(by_repeat)),
            "tpot_us_by_repeat": [1e6 * t for t in by_repeat], "decode_tokens": sum(x["tokens"] for x in recs),
            "decode_seconds": sum(x["seconds"] for x in recs), "rounds": rounds,
            "tokens_per_round": sum(x["tokens"] for x in recs) / max(rounds, 1),
            "drafts_per_round": sum(x["drafts"] for x in recs) / max(rounds, 1)}
    gain, noise = ratio_stats(units, "auto", "A"), ratio_stats(units, "A'", "A")
    checks = {"same_first_token_all_arms": all(len({json.dumps(v["first"]) for v in u["arms"].values()}) == 1
                                               for u in units),
              "a_equals_a_prime_tokens": all(u["arms"]["A"]["ids"] == u["arms"]["A'"]["ids"] for u in units),
              "auto_equals_a_tokens_units": sum(u["arms"]["A"]["ids"] == u["arms"]["auto"]["ids"] for u in units)}
    return {"per_arm": per_arm, "auto_over_A": gain, "A_prime_over_A": noise, "verdict": verdict(gain, noise),
            "checks": checks}


def notes(device: str) -> list[str]:
    out = ["TPOT = decode seconds / decode tokens: from the first token drawn after prefill to the last; prefill "
           "and the first token are outside the clock",
           "A and A' are the same fixed depth: A'/A is the timing noise floor of this machine and run",
           "auto and A are different exact samples (same prompt and seed): their tokens differ past the first round"]
    if device == "cpu":
        out.append("CPU TPOT is not the target figure: on a CPU a verification block's rows are compute, so the "
                   "depth trade-off differs from the GPU's (weight-bound); the figure of record is the H200's "
                   "(--device cuda)")
    return out


def print_table(report: dict) -> None:
    print(f"bench depth  model={report['model']} device={report['device']} prompts={report['prompts']} "
          f"repeats={report['repeats']} tokens={report['tokens']} fixed={report['fixed']} commit={report['commit']}")
    print(f"{'arm':>5} {'what':>16} {'TPOT (us)':>10} {'median/rep':>11} {'tokens':>7} {'rounds':>7} "
          f"{'tok/round':>10} {'drafts/round':>13}")
    for a in report["arms"]:
        v = report["per_arm"][a["arm"]]
        print(f"{a['arm']:>5} {a['label']:>16} {v['tpot_us']:>10.1f} {v['tpot_us_median_over_repeats']:>11.1f} "
              f"{v['decode_tokens']:>7} {v['rounds']:>7} {v['tokens_per_round']:>10.3f} {v['drafts_per_round']:>13.2f}")
    for key, label in (("auto_over_A", "auto/A"), ("A_prime_over_A", "A'/A")):
        g = report[key]
        print(f"{label:>7}: median unit {100 * (g['ratio'] - 1):+.2f}% (95% CI {100 * (g['ci95'][0] - 1):+.2f}% .. "
              f"{100 * (g['ci95'][1] - 1):+.2f}%); pooled {100 * (g['pooled_ratio'] - 1):+.2f}% "
              f"({100 * (g['pooled_ci95'][0] - 1):+.2f}% .. {100 * (g['pooled_ci95'][1] - 1):+.2f}%); "
              f"faster in {g['faster']}/{g['units']} units (sign test p={g['sign_test_p']:.3g})")
    v = report["verdict"]
    print(f"gain {100 * v['gain']:+.2f}% against a noise floor of {100 * v['noise_floor']:.2f}%: "
          f"{'beyond' if v['beyond_noise'] else 'NOT beyond'} noise; checks {report['checks']}")
