"""`iquest qualify`: every check against the float64 reference, the negative controls, a table and a JSON report.

Report structure (JSON, `SCHEMA` names the version):
  schema, model, tp, dtype, weights (what the candidate's linears run as: bf16 or fp8), reference (the weights the
  float64 reference is judged on: "as stored", or "fp8 at load" for a BF16 checkpoint run with --weights fp8),
  source (that case: "bf16", the weights the fp8w.* rows measure the FP8 form against; else null), kernels,
  kernel_fallbacks ({stage: calls that ran the fallback}), tolerance_column, device, quick, seed, jobs (worker
  processes used), commit, seconds, passed, suite_alpha (the whole suite's statistical false-alarm rate per run)
  checks:   [{check, class, worst, tolerance, verdict, rows, where}]   healthy engine, one row per check x class
  controls: [{name, what, caught, caught_by: [[check, class]], intended: [[check, class]],
              intended_worst: [[check, class, worst, tolerance, verdict]] (the control's run, its intended checks),
              branch_count, branch_what, failing: [[check, class]], seconds}]
  controls_not_applicable: [{name, why}]   controls that cannot apply to this candidate (not run)
  lossless: {p_value, chi2, dof, samples, seed, replacement_rounds, replacement_drew_tested_token, observed, expected}
  controls_caught: "N/N"
  tolerances: path of the tolerance file used
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..provenance import commit
from ..fast.parallel import Parallel
from ..fast.plan import KernelPlan
from ..fast.collectives import TIMEOUT_NS
from ..fast.rank import MAX_CANDIDATES, EngineOptions, EngineParts, KernelSetting, RankEngine
from ..fast.stacks import STALL_S, dump_stacks, dump_stacks_on_signal, end_tree
from ..fast.weights import weight_format
from . import tolerances
from ..reference.config import Config
from .checks import (Case, RefSpec, Row, decode_session, lossless, quantized_at_load, session_rows, sliding_ring,
                     stability)
from .controls import REGISTRY, Control, control
from .replay import classes_all, recording_parts

SCHEMA = "iquest-qualify/2"


def qualify_cases(vocab: int, quick: bool, ring: int, seed: int = 0) -> tuple[list[Case], list[int], list[int]]:
    """The decode requests: a long one at the model's sampling defaults whose decode passes the sliding window and
    wraps the ring; a "wide" one (temperature 3, top_k as wide as a rank's candidates go, fast/rank.MAX_CANDIDATES,
    top_p 1) under which even an untrained draft is often accepted, so the paths after an accepted draft run on a
    random fixture too; and, in the full mode, more lengths and depths (the fitted controller included) and a greedy
    one. The quick mode's long request drafts 3 a round, not 7: its point is the window and the ring, and the wide one
    reaches every depth and verification row (the full mode's first request wraps the ring at 7). `seed` picks the
    prompts and the request seeds (seed 0: the historical first case). Returns (cases, stability prefix, appended
    tokens)."""
    gen = torch.Generator().manual_seed(7 + seed)
    need = ring + 8
    base = seed << 32
    wide, greedy = (3.0, min(vocab, MAX_CANDIDATES), 1.0), (0.0, 20, 0.95)

    def prompt(n):
        return tuple(int(x) for x in torch.randint(2, vocab, (n,), generator=gen))
    if quick:
        first = prompt(min(56, max(need - 48, 8)))
        cases = [Case(first, base + 1, 3, max(need - len(first), 48)), Case(prompt(16), base + 2, 7, 32, wide)]
        return cases, list(first[:40]), list(range(2, 10))
    cases = []
    for i, (length, drafts) in enumerate([(56, 7), (40, 3), (72, "auto"), (24, 5)]):
        cases.append(Case(prompt(length), base + 100 + i, drafts, max(need - length, 96)))
    cases += [Case(prompt(24), base + 104, 7, 96, wide), Case(prompt(24), base + 105, 4, 64, greedy)]
    return cases, list(cases[0].prompt[:40]), list(range(2, 10))


class _Engines:
    """The candidate under some options and parts, built with the recording parts laid over them
    (qualify/replay.py): (recorded rank-0 engine, run(req), single-rank engine for dists)."""

    def __init__(self, model_dir: str, tp: int, options: EngineOptions, device: str = "cpu",
                 parts: EngineParts = EngineParts()):
        self.fe = None
        parts = recording_parts(parts)
        if tp == 1:
            self.rank0 = RankEngine(model_dir, Parallel.single(device), options, parts)
            self.single, self.run = self.rank0, None
        else:
            from ..fast.engine import FastEngine
            from ..reference.sampling import SamplingParams

            self.fe = FastEngine.load(model_dir, tp=tp, device=device, options=options, parts=parts)
            self.rank0 = self.fe.rank0
            # Ranks only change reduction order: a single-rank engine stands in for fresh-prefill distributions.
            self.single = RankEngine(model_dir, Parallel.single(device), options, parts)

            def run(req):
                return self.fe.generate(req.prompt, seed=req.seed, params=SamplingParams(req.temperature, req.top_k,
                                        req.top_p), max_new_tokens=req.max_new_tokens, drafts=req.drafts)
            self.run = run

    def close(self):
        if self.fe is not None:
            self.fe.close()


def _sessions(engines: _Engines, plan: "Plan", bar, source: bool = False) -> list:
    out = []
    for case in plan.cases:
        out.append(decode_session(engines.rank0, plan.ref, case, plan.tol, engines.run, engines.single,
                                  plan.source if source else None))
        bar.update(1)
    return out


def _failing(rows: list[Row]) -> set[tuple[str, str]]:
    return {(r.check, r.cls) for r in rows if not r.passed and r.rows > 0}


@dataclass(frozen=True)
class Plan:
    """What every unit of a qualification run shares (picklable: units may run in worker processes)."""
    model_dir: str
    tp: int
    base: EngineOptions
    cases: tuple
    prefix: tuple
    extra: tuple
    dtype: str
    tol: str            # tolerance column: tolerances.scheme(dtype)
    samples: int
    device: str
    seed: int = 0
    ref: RefSpec | None = None      # the reference the candidate is judged on
    source: RefSpec | None = None   # fp8w.*: the BF16 weights an FP8 candidate came from (None: no such rows)


def run_healthy(plan: Plan, bar) -> tuple[list[Row], dict]:
    """The healthy candidate's rows, and the calls per stage its kernels could not take (ran the fallback)."""
    engines = _Engines(plan.model_dir, plan.tp, plan.base, plan.device)
    try:
        rows = session_rows(_sessions(engines, plan, bar, source=True), classes_all())
        rows += stability(engines.single, plan.ref, list(plan.prefix), list(plan.extra), plan.tol)
        fallbacks = dict(getattr(engines.rank0.model.ops, "fallbacks", {}))  # op group -> calls
    finally:
        engines.close()
    bar.update(1)
    return rows, fallbacks


def run_lossless(plan: Plan, bar) -> tuple[Row, dict]:
    return lossless(plan.samples, plan.base, device=plan.device, seed=plan.seed,
                    progress=steps_of(bar, LOSSLESS_STEPS))


def steps_of(bar, steps: int):
    """A lossless run's progress (requests done of all) as `steps` steps of `bar`: its one long run of requests (a
    minute and more on a GPU) is then seen stepping by the quiet-unit watch (`gather`), not taken for a stalled one."""
    told = 0

    def progress(done: int, total: int) -> None:
        nonlocal told
        now = steps * done // total
        if now > told:
            bar.update(now - told)
            told = now

    return progress


def run_control(ctl: Control, plan: Plan, bar) -> dict:
    t0 = time.time()
    if ctl.family == "lossless":
        row, info = lossless(plan.samples, plan.base, ctl.parts, device=plan.device, seed=plan.seed,
                             progress=steps_of(bar, len(plan.cases)))
        rows, branch = [row], ctl.branch(info, plan.model_dir)
    else:
        engines = _Engines(plan.model_dir, plan.tp, plan.base, plan.device, ctl.parts)
        try:
            sessions = _sessions(engines, plan, bar)
        finally:
            engines.close()
        rows, branch = session_rows(sessions, classes_all()), ctl.branch(sessions, plan.model_dir)
    failing = _failing(rows)
    hit = [list(c) for c in ctl.catches if c in failing]
    return {"name": ctl.name, "what": ctl.what, "caught": bool(hit) and branch > 0, "caught_by": hit,
            "intended": [list(c) for c in ctl.catches], "intended_worst": intended_worst(rows, ctl.catches),
            "branch_count": branch, "branch_what": ctl.branch_what,
            "failing": sorted(list(c) for c in failing), "seconds": round(time.time() - t0, 2)}


def intended_worst(rows: list[Row], catches) -> list[list]:
    """[check, class, worst, tolerance, verdict] of the control's run for each check it is meant to fail: how far past
    (or short of) its tolerance the defect lands, so a control caught only just, or missed only just, shows it."""
    by = {(r.check, r.cls): r.as_dict() for r in rows}
    return [[c[0], c[1], by[c]["worst"], by[c]["tolerance"], by[c]["verdict"]] for c in catches if c in by]


def control_margin(r: dict) -> str:
    """The intended check the control's run came closest to failing (or failed by most), as worst / tolerance (for
    the p-value checks: tolerance / worst, as a p-value fails below it)."""
    ratios = []
    for check, cls, worst, tol, _ in r.get("intended_worst", []):
        try:
            worst, tol = float(worst), float(tol)
        except (TypeError, ValueError):
            continue
        ratio = (tol / worst if worst > 0 else math.inf) if check == "lossless" else (worst / tol if tol > 0 else math.inf)
        ratios.append((ratio, f"{check}/{cls}"))
    if not ratios:
        return "-"
    ratio, where = max(ratios)
    return (f"{ratio:.3g}x" if math.isfinite(ratio) else "past a zero tolerance") + f" ({where})"


HEARTBEAT_S = 60  # a progress line at least this often while worker units run
# One unit quiet while others step: below the collectives' timeout, so a unit whose TP ranks wait on each other prints
# its processes' stacks while they still wait, not after the timeout has ended them
UNIT_STALL_S = 0.75 * TIMEOUT_NS / 1e9
_POLL_S = 0.25  # how often gather reads the units' step reports
LOSSLESS_STEPS = 8  # the lossless test's requests reported in eighths: each well inside UNIT_STALL_S on a GPU


class StallError(RuntimeError):
    """No step finished within the stall limit: the run's worker processes were ended (the CLI prints one line)."""


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, what: str) -> None:
        pass


_PROGRESS = None  # in a pool worker: the queue its units report to gather on (_init_worker)


def _init_worker(progress) -> None:
    global _PROGRESS
    _PROGRESS = progress
    dump_stacks_on_signal()


class _UnitBar(_NoBar):
    """A unit's bar in a pool worker: each step reaches the parent's bar as it finishes, not only when the unit ends."""

    def __init__(self, name: str):
        self.name = name

    def update(self, n: int = 1) -> None:
        if n and _PROGRESS is not None:
            _PROGRESS.put((self.name, n, os.getpid()))


def _in_worker(name: str, fn, *args):
    """Run one unit, `fn(*args, bar=...)`, in a pool worker, telling gather when it starts and in which process: the
    pool hands work to its call queue ahead of the workers, so the future's running() does not say that."""
    if _PROGRESS is not None:
        _PROGRESS.put((name, 0, os.getpid()))
    return fn(*args, bar=_UnitBar(name))


def _unit(kind: str, plan: Plan, name: str | None = None, *, bar):
    """One unit of work in a worker process (spawned: CUDA needs a fresh process; one CPU thread each)."""
    torch.set_num_threads(1)
    with torch.inference_mode():  # as _run_units says
        if kind == "healthy":
            return run_healthy(plan, bar)
        if kind == "lossless":
            return run_lossless(plan, bar)
        return run_control(control(name), plan, bar)


def unit_pool(jobs: int):
    """(`jobs` spawned worker processes, the queue their units report their steps on): gather takes both."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")
    progress = ctx.Queue()
    return ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init_worker, initargs=(progress,)), progress


def _run_units(plan: Plan, chosen: list[Control], jobs: int, bar, stall_s: float = STALL_S,
               stall_limit: float = 0) -> tuple[list[Row], dict, dict, list[dict]]:
    """The healthy engine, the lossless test and every control: in this process (jobs 1) or spread over `jobs`
    worker processes. Units are independent, so the report is the same either way."""
    if jobs <= 1:
        # Qualification takes no gradient: under inference mode the many small ops of its decodes and replays skip
        # autograd's bookkeeping (the same results, a good share less CPU time).
        with torch.inference_mode():
            bar.set_postfix_str("healthy engine")
            rows, fallbacks = run_healthy(plan, bar)
            bar.set_postfix_str("lossless")
            lrow, linfo = run_lossless(plan, bar)
            results = []
            for ctl in chosen:
                bar.set_postfix_str(f"control {ctl.name}")
                results.append(run_control(ctl, plan, bar))
        return rows + [lrow], linfo, fallbacks, results
    weight = {"healthy": len(plan.cases) + 1, "lossless": LOSSLESS_STEPS}
    units = {"healthy": (_unit, "healthy", plan), "lossless": (_unit, "lossless", plan)}
    units.update({c.name: (_unit, "control", plan, c.name) for c in chosen})
    pool, progress = unit_pool(jobs)
    try:
        done = gather(pool, units, bar, {k: weight.get(k, len(plan.cases)) for k in units}, jobs, progress=progress,
                      stall_s=stall_s, stall_limit=stall_limit)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)  # a failed unit ends the run now, not after the others
        raise
    pool.shutdown()
    (rows, fallbacks), (lrow, linfo) = done["healthy"], done["lossless"]
    return rows + [lrow], linfo, fallbacks, [done[c.name] for c in chosen]


def gather(pool, units: dict[str, tuple], bar, steps: dict[str, int], workers: int, heartbeat: float = HEARTBEAT_S,
           progress=None, stall_s: float = STALL_S, stall_limit: float = 0, unit_stall_s: float = UNIT_STALL_S) -> dict:
    """Each unit's result by name, its (function, *args) submitted to `pool` and called with a `bar=` keyword. The
    bar moves as each unit reports a step on `progress` (unit_pool's queue; None: only as units end, by their
    `steps`, of which a unit's end adds those it did not report) and shows a line at least every `heartbeat` seconds
    naming the units running, their steps and time, and those queued, so a run cut off by a time limit says how far
    it got. After `stall_s` seconds without a step (0: never) it says which units stalled and has every process
    under this one print its Python stacks (fast/stacks.py), once a stall; after `stall_limit` (0: never) it ends the
    pool's processes and raises StallError. A unit that has made no step for `unit_stall_s` (0: never) while others
    did is named and the stacks printed too, once until it steps again. A unit's exception is raised as soon as that
    unit ends."""
    from concurrent.futures import FIRST_COMPLETED, wait

    futures = {pool.submit(_in_worker, name, *call): name for name, call in units.items()}
    done, pending, counted, started, worker = {}, set(futures), dict.fromkeys(units, 0), {}, {}
    last = shown = time.monotonic()  # the last step; the last line
    dumped = False
    unit_last, unit_dumped = {}, set()  # a unit's last step (or start); the quiet units whose stacks were printed

    def stacks() -> None:
        """Every process under this one prints its Python stacks, each worker named by the unit it runs."""
        if not dump_stacks({pid: f"the worker running {name}" for name, pid in worker.items() if name not in done},
                           _say):
            _say("qualify: no worker process could be asked for its stacks (kill -USR1 PID asks one)")

    def left(now: float) -> str:
        names = [n for n in units if n not in done]
        running = [f"{n} {counted[n]}/{steps[n]} for {now - started[n]:.0f} s" for n in names if n in started]
        queued = [n for n in names if n not in started]
        return f"running: {', '.join(running) or 'none'}; queued: {', '.join(queued) or 'none'}"

    while pending:
        finished, pending = wait(pending, timeout=min(_POLL_S, heartbeat), return_when=FIRST_COMPLETED)
        now = time.monotonic()
        for name, n, pid in _reports(progress):
            if name in done:  # came on another pipe than the unit's result, after it: counted at its end
                continue
            started.setdefault(name, now)
            unit_last.setdefault(name, now)
            worker[name] = pid
            n = min(n, steps[name] - counted[name])
            if n > 0:
                counted[name] += n
                last = shown = unit_last[name] = now
                unit_dumped.discard(name)
                dumped = False
                bar.set_postfix_str(f"{name} {counted[name]}/{steps[name]}")
                bar.update(n)
        for fut in finished:
            name = futures[fut]
            done[name] = fut.result()
            bar.set_postfix_str(f"{name} done; {len(units) - len(done)} units left on {workers} workers")
            bar.update(steps[name] - counted[name])
            counted[name] = steps[name]
            last = shown = now
            dumped = False
        if progress is None:  # no start reports: a unit counts from when the pool runs it
            started.update((futures[f], now) for f in pending if f.running() and futures[f] not in started)
        quiet = now - last if pending else 0.0
        limit = bool(stall_limit) and quiet >= stall_limit
        if not dumped and (limit or stall_s and quiet >= stall_s):
            _say(f"qualify: no step finished for {quiet:.0f} s ({left(now)}); the Python stacks of the processes "
                 "running them follow on stderr")
            stacks()
            dumped = True
            if limit:
                time.sleep(0.5)  # the stacks are written before their processes are ended
        quiet_units = [n for n in unit_last if n not in done and n not in unit_dumped
                       and now - unit_last[n] >= unit_stall_s > quiet] if unit_stall_s else []
        if quiet_units:
            for_s = now - min(unit_last[n] for n in quiet_units)
            _say(f"qualify: {', '.join(quiet_units)} made no step for {for_s:.0f} s while other units did "
                 f"({left(now)}); the Python stacks of every running unit's processes follow on stderr")
            stacks()
            unit_dumped.update(quiet_units)
        if limit:
            unfinished = ", ".join(f"{n} {counted[n]}/{steps[n]} steps" for n in units if n not in done)
            end_tree(getattr(pool, "_processes", None) or {})  # a process pool's workers (private, there since 3.2)
            raise StallError(f"no step finished for {quiet:.0f} s (the stall limit): these units did not finish: "
                             f"{unfinished}; their worker processes were ended (their stacks are above)")
        if pending and now - shown >= heartbeat:
            bar.set_postfix_str(left(now))
            bar.update(0)
            shown = now
    return done


def _reports(progress) -> list[tuple[str, int, int]]:
    """The (unit, steps, worker pid) reports on `progress` so far, without waiting."""
    import queue

    out = []
    while progress is not None:
        try:
            out.append(progress.get_nowait())
        except queue.Empty:
            break
    return out


def _say(line: str) -> None:
    tqdm.write(line, file=sys.stderr)  # above a terminal's bar, which stays; a plain line in a log


def candidate_options(dtype: str, kernels: str | KernelPlan, device: str, shared_gpu: bool = False,
                      weights: str = "auto", router_fold: bool = False,
                      kernel_settings: tuple[KernelSetting, ...] = ()) -> EngineOptions:
    """The healthy candidate's engine options (`kernels` resolved to a plan for the device, e.g. auto -> triton).
    Eager on CUDA too: the recorder wraps the engine's Python calls, which a graph replay skips. The graph is held to
    the eager round separately (bit-exact: tests/test_fast_gpu.py)."""
    return EngineOptions(max_context=512, dtype=dtype, graphs=False, shared_gpu=shared_gpu,
                         kernels=EngineOptions(kernels=kernels).plan(torch.device(device)), weights=weights,
                         router_fold=router_fold, kernel_settings=kernel_settings)


def references(model_dir: str, config: Config, weights: str, device: str) -> tuple[str, RefSpec, RefSpec | None]:
    """(what the candidate's linears run as, the reference it is judged on, the BF16 source the fp8w.* rows measure
    it against or None): a BF16 checkpoint run as FP8 (quantized at load) is judged on the reference with the same
    quantization, and measured against the BF16 reference it came from."""
    fmt = weight_format(weights, config, torch.device(device))
    if fmt == "fp8" and quantized_at_load(model_dir):
        return fmt, RefSpec(model_dir, "fp8"), RefSpec(model_dir)
    return fmt, RefSpec(model_dir), None


def make_plan(model_dir: str, tp: int = 1, quick: bool = False, dtype: str = "fp32", device: str = "cpu",
              kernels: str | KernelPlan = "auto", shared_gpu: bool = False, weights: str = "auto",
              seed: int = 0, router_fold: bool = False,
              kernel_settings: tuple[KernelSetting, ...] = ()) -> tuple[Plan, str]:
    """The plan of a run and the weight format its candidate runs."""
    base = candidate_options(dtype, kernels, device, shared_gpu, weights, router_fold, kernel_settings)
    config = Config.from_dir(model_dir)
    fmt, ref, source = references(model_dir, config, weights, device)
    cases, prefix, extra = qualify_cases(config.vocab_size, quick, sliding_ring(config, base), seed)
    plan = Plan(model_dir, tp, base, tuple(cases), tuple(prefix), tuple(extra), dtype, tolerances.scheme(dtype),
                600 if quick else 3000, device, seed, ref, source)
    return plan, fmt


def select_controls(names: list[str] | None, model_dir: str, fmt: str, options: EngineOptions,
                    tp: int = 1) -> tuple[list[Control], list[dict]]:
    """The registered controls named (None: all) that apply to this candidate (its weight format, engine options and
    tensor-parallel ranks), and {name, why} of those that cannot."""
    chosen, skipped = [], []
    for c in REGISTRY:
        if names is not None and c.name not in names:
            continue
        why = c.applies(model_dir, fmt, options, tp) if c.applies is not None else None
        if why is None:
            chosen.append(c)
        else:
            skipped.append({"name": c.name, "why": why})
    return chosen, skipped


def qualify(model_dir: str, tp: int = 1, quick: bool = False, dtype: str = "fp32", json_out: str | None = None,
            progress: bool | None = None, controls: list[str] | None = None, out=None,
            device: str = "cpu", kernels: str | KernelPlan = "auto", jobs: int = 1, shared_gpu: bool = False,
            weights: str = "auto", seed: int = 0, quiet: bool = False, router_fold: bool = False,
            kernel_settings: tuple[KernelSetting, ...] = (), stall_dump: float = STALL_S,
            stall_limit: float = 0) -> dict:
    """One qualification run. `weights`: --weights (auto, bf16, fp8; fast/weights.weight_format); `seed`: picks the
    cases and the lossless test's request seeds; `controls`: names to run (None: all, [] none); `router_fold`: the
    candidate (and every control built on it) with EngineOptions.router_fold; `kernel_settings`: with those kernel
    launch settings (EngineOptions.kernel_settings: a numerical form qualified before it becomes a default);
    `stall_dump`, `stall_limit`: gather's stall_s and stall_limit, for runs on worker processes (jobs > 1)."""
    t0 = time.time()
    model_dir = str(model_dir)
    plan, fmt = make_plan(model_dir, tp, quick, dtype, device, kernels, shared_gpu, weights, seed, router_fold,
                          kernel_settings)
    chosen, skipped = select_controls(controls, model_dir, fmt, plan.base, plan.tp)
    jobs = max(1, min(jobs, len(chosen) + 2))
    total = len(plan.cases) * (1 + len(chosen)) + 1 + LOSSLESS_STEPS
    with progress_bar(total, progress) as bar:
        rows, linfo, fallbacks, results = _run_units(plan, chosen, jobs, bar, stall_dump, stall_limit)
    caught = sum(r["caught"] for r in results)
    passed = all(r.passed for r in rows) and caught == len(results)
    report = {"schema": SCHEMA, "model": model_dir, "tp": tp, "dtype": dtype, "weights": fmt,
              "reference": "fp8 at load" if plan.ref.quant else "as stored",
              "source": "bf16" if plan.source is not None else None, "kernels": plan.base.kernels.name,
              "router_fold": router_fold, "kernel_settings": [f"{op}.{f}={v}" for op, f, v in kernel_settings],
              "kernel_fallbacks": fallbacks, "tolerance_column": plan.tol, "device": device, "quick": quick,
              "seed": seed, "jobs": jobs, "commit": commit(), "seconds": round(time.time() - t0, 2),
              "passed": passed, "suite_alpha": tolerances.suite_alpha(), "checks": [r.as_dict() for r in rows],
              "controls": results, "controls_not_applicable": skipped, "lossless": linfo,
              "controls_caught": f"{caught}/{len(results)}", "tolerances": str(tolerances.PATH)}
    if not quiet:
        print_table(report, out)
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=1))
    return report


def closest(checks: list[dict]) -> list | None:
    """[check, class, worst, tolerance, worst / tolerance] of the bound a run came nearest to (the deterministic
    checks with a positive numeric tolerance; lossless is a p-value, recorded apart)."""
    best = None
    for c in checks:
        try:
            worst, tol = float(c["worst"]), float(c["tolerance"])
        except (TypeError, ValueError):
            continue
        if c["check"] == "lossless" or not tol > 0 or math.isnan(worst):
            continue
        if best is None or worst / tol > best[4]:
            best = [c["check"], c["class"], worst, tol, worst / tol]
    return best


def false_alarms(model_dir: str, seeds: int, out_path: str | None = None, first_seed: int = 0, dtype: str = "fp32",
                 device: str = "cpu", kernels: str | KernelPlan = "auto", weights: str = "auto", tp: int = 1,
                 jobs: int = 1, progress: bool | None = False, out=None, router_fold: bool = False,
                 kernel_settings: tuple[KernelSetting, ...] = (), stall_dump: float = STALL_S,
                 stall_limit: float = 0) -> dict:
    """The healthy engine's false-alarm rate: quick qualification of the healthy candidate alone (no controls) at
    seeds first_seed .. first_seed + seeds - 1; a run that fails any check is a false alarm. Writes the raw results
    (per seed: passed, failing checks, lossless p-value) to `out_path` when given."""
    runs = []
    for s in range(first_seed, first_seed + seeds):
        r = qualify(model_dir, tp=tp, quick=True, dtype=dtype, controls=[], device=device, kernels=kernels, jobs=jobs,
                    weights=weights, seed=s, progress=progress, quiet=True, router_fold=router_fold,
                    kernel_settings=kernel_settings, stall_dump=stall_dump, stall_limit=stall_limit)
        failing = [[c["check"], c["class"], c["worst"], c["tolerance"]] for c in r["checks"] if c["verdict"] != "pass"]
        runs.append({"seed": s, "passed": r["passed"], "failing": failing, "lossless_p": r["lossless"]["p_value"],
                     "closest": closest(r["checks"]), "seconds": r["seconds"]})
        print(f"false-alarm run: seed {s}: {'pass' if r['passed'] else 'FAIL ' + str(failing)} "
              f"(lossless p = {r['lossless']['p_value']:.3g}, {r['seconds']:.0f} s)", file=out or sys.stderr,
              flush=True)
    alarms = sum(not r["passed"] for r in runs)
    nearest = max((r["closest"] for r in runs if r["closest"]), key=lambda c: c[4], default=None)
    lossless_alarms = sum(any(f[0] == "lossless" for f in r["failing"]) for r in runs)
    report = {"schema": "iquest-qualify-false-alarm/1", "model": model_dir, "commit": commit(), "dtype": dtype,
              "device": device, "weights": weights, "tp": tp, "router_fold": router_fold,
              "kernel_settings": [f"{op}.{f}={v}" for op, f, v in kernel_settings],
              "mode": "quick, healthy engine only (no controls)",
              "seeds": [first_seed, first_seed + seeds - 1], "runs": runs, "false_alarms": alarms,
              "closest_bound": nearest,
              "false_alarm_rate": alarms / max(seeds, 1), "lossless_false_alarms": lossless_alarms,
              "suite_alpha": tolerances.suite_alpha(),
              "suite_alpha_why": tolerances.table()["statistics"]["why"]}
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(report, indent=1))
    return report


class _Lines:
    """Progress as plain lines on stderr, for a log rather than a terminal: steps done of the total, time elapsed
    and what is running."""

    def __init__(self, total: int, out=None):
        self.total, self.done, self.what, self.t0 = total, 0, "", time.time()
        self.out = out or sys.stderr

    def __enter__(self):
        print(f"qualify: {self.total} steps to run", file=self.out, flush=True)
        return self

    def __exit__(self, *exc) -> None:
        pass

    def set_postfix_str(self, what: str) -> None:
        self.what = what

    def update(self, n: int = 1) -> None:
        self.done += n
        now = f" ({self.what})" if self.what else ""
        print(f"qualify: {self.done}/{self.total} steps done, {time.time() - self.t0:.0f} s elapsed{now}",
              file=self.out, flush=True)


def progress_bar(total: int, progress: bool | None = None):
    """progress None: a tqdm bar on a terminal, plain lines (_Lines) elsewhere; True: the bar; False: neither."""
    if progress is None and not sys.stderr.isatty():
        return _Lines(total)
    return tqdm(total=total, desc="qualify", unit="step", disable=progress is False, file=sys.stderr)


def _fmt(x) -> str:
    if isinstance(x, str):
        return x
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.3g}"


def _columns(rows: list[tuple], out) -> None:
    """Rows of cells, each column as wide as its widest cell (left-aligned; the last column unpadded)."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) + "  " + str(r[-1]), file=out)


def _listed(pairs, most: int = 3) -> str:
    """check/class pairs, the first `most` of them and how many more: never cut inside a name."""
    names = [f"{a}/{b}" for a, b in pairs]
    return ", ".join(names[:most]) + (f" (+{len(names) - most} more)" if len(names) > most else "")


def print_table(report: dict, out=None) -> None:
    out = out or sys.stdout  # read at call time: a default bound at import keeps whatever stream was current then
    checks = [("check", "class", "worst", "tolerance", "verdict", "rows")]
    for r in report["checks"]:
        if r["check"] == "lossless":  # a p-value against its significance level: it fails when small
            worst, tol = f"p = {_fmt(r['worst'])}", f"alpha = {_fmt(r['tolerance'])}"
        else:
            worst, tol = _fmt(r["worst"]), _fmt(r["tolerance"])
        checks.append((r["check"], r["class"], worst, tol, r["verdict"], r["rows"]))
    if report.get("source"):
        print(f"weights {report.get('weights')} (quantized at load): judged on the reference with the same "
              f"quantization; fp8w.* rows measure them against the {report['source']} weights", file=out)
    _columns(checks, out)
    if any(r["check"] == "lossless" for r in report["checks"]):
        print("(worst/tolerance: the largest error and the most allowed, passing at or below it; lossless: the "
              "chi-square test's p-value, passing at or above the significance level alpha)", file=out)
    for r in report["checks"]:
        if r["verdict"] != "pass":
            print(f"  FAIL {r['check']} / {r['class']}: {r['where']}", file=out)
    print(file=out)
    if report["controls"]:
        controls = [("negative control", "caught", "branch", "margin (>1: past its tolerance)", "caught by")]
        for r in report["controls"]:
            by = _listed(r["caught_by"]) if r["caught_by"] else f"NOT CAUGHT (intended: {_listed(r['intended'])})"
            controls.append((r["name"], "yes" if r["caught"] else "NO", r["branch_count"], control_margin(r), by))
        _columns(controls, out)
        print("(branch: times the broken code ran on an input where it matters; margin: the largest worst / "
              "tolerance of its intended checks, alpha / p for lossless: above 1 it was caught with that much to "
              "spare)", file=out)
    for r in report.get("controls_not_applicable", []):
        print(f"not applicable: {r['name']}: {r['why']}", file=out)
    print(f"\nnegative controls: {report['controls_caught']} caught", file=out)
    if "suite_alpha" in report:
        print(f"statistical false-alarm rate of the whole suite per run: {report['suite_alpha']:.3g} (the lossless "
              f"chi-square, its one statistical test; every other check is a deterministic bound)", file=out)
    print(f"qualification {'PASSED' if report['passed'] else 'FAILED'} in {report['seconds']:.0f} s", file=out)
