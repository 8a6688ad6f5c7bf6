"""Python stacks of a process that seems hung: `kill -USR1 PID` makes any iquest process that called
`dump_stacks_on_signal` (the qualify process, its pool workers, every tensor-parallel rank) print each thread's stack
on its stderr, even while it waits inside a C call (a collective, a CUDA synchronize). `dump_stacks` asks every
descendant at once; `end_tree` stops a stuck process with everything it started. psutil is imported where used."""

from __future__ import annotations

import faulthandler
import signal

SIGNAL = getattr(signal, "SIGUSR1", None)  # None on Windows: no stacks on demand there
STALL_S = 180  # qualify --stall-dump's default: longer than a unit's first case takes to load and compile on a busy GPU


def dump_stacks_on_signal() -> None:
    if SIGNAL is not None:
        # fd 2, not sys.stderr: a test's or a worker's replacement stream may have no file descriptor
        faulthandler.register(SIGNAL, file=2, all_threads=True)


def _handles(pid: int) -> bool:
    """Whether `pid` catches SIGUSR1 (Linux's /proc/PID/status). Its default action ends a process, so one that has
    not registered (a worker still importing torch, multiprocessing's resource tracker, a compiler run by Triton) is
    never sent it. gVisor's /proc (the lent GPU machines) has no SigCgt line: there a multiprocessing child (a pool
    worker, a GPU's TP rank) is taken to have registered, as it has a few seconds after it starts; a CPU rank, forked
    from a server whose command line it shares (fast/engine.py), cannot be told from that server and is not asked."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next((line.split()[1] for line in f if line.startswith("SigCgt:")), None)
        if caught is not None:
            return bool(int(caught, 16) >> (SIGNAL - 1) & 1)
        with open(f"/proc/{pid}/cmdline") as f:
            return "spawn_main" in f.read()
    except (OSError, ValueError):
        return False


def dump_stacks(labels: dict[int, str] | None = None, say=None) -> int:
    """Ask every descendant of this process that registered (dump_stacks_on_signal) for its stacks, one at a time,
    each under a line from `say` naming it: by `labels` (pid -> what it is, e.g. the unit a worker runs), or as a
    child of a labelled process (a tensor-parallel rank of that worker's engine). Returns how many were asked."""
    if SIGNAL is None:
        return 0
    import sys
    import time

    import psutil

    labels, asked, found = labels or {}, 0, []
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    for p in psutil.Process().children(recursive=True):
        try:
            if _handles(p.pid):
                found.append((next((a.pid for a in [p] + p.parents() if a.pid in labels), None), p))
        except psutil.NoSuchProcess:
            pass
    found.sort(key=lambda f: (f[0] or f[1].pid, f[1].pid != f[0], f[1].pid))  # each worker, then what it started
    for owner, p in found:
        what = "" if owner is None else labels[owner] if owner == p.pid else f"started by {owner}, {labels[owner]}"
        say(f"--- Python stacks of process {p.pid}" + (f" ({what})" if what else "") + ":")
        try:
            p.send_signal(SIGNAL)
        except psutil.NoSuchProcess:
            continue
        asked += 1
        time.sleep(0.1)  # it writes at once, even blocked in a C call: its stacks come before the next one's line
    return asked


def end_tree(pids, grace: float = 3.0) -> None:
    """Terminate these processes and every process under them, then kill what is left after `grace` seconds. The
    tree is read first: a tensor-parallel rank whose parent died first would be left running, out of reach."""
    import psutil

    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs += [p] + p.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    for sig in ("terminate", "kill"):
        for p in procs:
            try:
                getattr(p, sig)()
            except psutil.NoSuchProcess:
                pass
        procs = psutil.wait_procs(procs, timeout=grace)[1]
        if not procs:
            return
