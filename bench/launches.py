"""Whether two variants' captured graphs differ: the Triton kernels each capture launched, by compiled binary, so that
an ineffective substitution (a setting no kernel reads, an option whose branch never runs) cannot pass for an
optimization (issue 52's paired evidence; the seed's check). `bench step` records each variant's capture and reports
every arm against the first.

Within one process Triton compiles a kernel once for each specialization (its constexprs, warps, stages), so launches
of one binary carry one function handle, and another setting, another kernel or another sequence shows as a
difference. Only Triton's launches are seen (through its launch hook): a variant that changes a torch op alone is
reported as the same graph, and a capture on the CPU (none: the eager loop) records nothing.
"""

from __future__ import annotations

from contextlib import contextmanager

from triton import knobs


class Launches:
    """Triton's launch hook: (kernel name, compiled function handle) of each launch, in order."""

    def __init__(self) -> None:
        self.kernels: list[tuple[str, int]] = []

    def __call__(self, metadata) -> None:
        data = metadata.get()  # Triton's LazyDict of the launch
        self.kernels.append((str(data["name"]), int(data["function"])))


@contextmanager
def recorded():
    """The Triton kernels launched inside the block (a `Launches`), the hook removed after it."""
    rec = Launches()
    knobs.runtime.launch_enter_hook.add(rec)
    try:
        yield rec
    finally:
        knobs.runtime.launch_enter_hook.remove(rec)


def compare(main: list[tuple[str, int]], other: list[tuple[str, int]]) -> dict:
    """One capture's launches against another's: identical or not, the launches of each, how many positions differ
    (a length difference counts each missing launch) and the first that does, with its kernel names."""
    differing = [i for i, (a, b) in enumerate(zip(main, other)) if a != b]
    differing += list(range(min(len(main), len(other)), max(len(main), len(other))))
    first = differing[0] if differing else None
    name = lambda seq, i: seq[i][0] if i is not None and i < len(seq) else None  # noqa: E731
    return {"identical": not differing, "launches": [len(main), len(other)], "differing": len(differing),
            "first": first, "first_kernels": [name(main, first), name(other, first)],
            "kernels_changed": sorted({k for i in differing for k in (name(main, i), name(other, i)) if k})}


def verdict(name: str, main: str, c: dict) -> str:
    """The line `bench step` prints for arm `name` against `main`: an A' arm (primed) should be identical, any other
    should differ."""
    if not c["launches"][0] and not c["launches"][1]:
        return f"captured graph of {name} against {main}: nothing captured (no CUDA graph, or no Triton kernel)"
    if c["identical"]:
        what = "as an A' arm should" if name.endswith("'") else "WARNING: its substitution changed no kernel"
        return f"captured graph of {name} against {main}: identical, {c['launches'][0]} Triton launches ({what})"
    what = "WARNING: an A' arm should be identical" if name.endswith("'") else "as a substitution should"
    kernels = ", ".join(c["kernels_changed"][:6]) + (", ..." if len(c["kernels_changed"]) > 6 else "")
    return (f"captured graph of {name} against {main}: differs at {c['differing']} of {max(c['launches'])} "
            f"Triton launches ({c['launches'][0]} and {c['launches'][1]}), kernels {kernels} ({what})")
