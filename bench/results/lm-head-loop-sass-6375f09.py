"""The LM head's K loop, compiled for sm_90a on the CPU (`python bench/results/lm-head-loop-sass-6375f09.py`): each
form's per-thread instructions in the loop body (from nvdisasm's backward branch), at one TP8 rank's head
(20000 x 3072 fp32). Raw output: lm-head-loop-sass-6375f09.txt."""
import collections, os, re, tempfile

from iquest.bench import sass
from iquest.kernels import lm_head as lh


def loop_mix(kernel):
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        open(cubin, "wb").write(kernel.asm["cubin"])
        text = sass._tool("nvdisasm", cubin, "-c")
    ins, labels, pending = [], {}, []
    for line in text.splitlines():
        lm = re.match(r"\s*(\.L_x_\d+):", line)
        if lm:
            pending.append(lm.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9]*)(.*)", line)
        if m:
            a = int(m.group(1), 16)
            labels.update({p: a for p in pending})
            pending = []
            ins.append((a, m.group(2), m.group(3)))
    out = []
    for a, op, rest in ins:
        t = re.search(r"(\.L_x_\d+)", rest) if op == "BRA" else None
        if t and labels.get(t.group(1), a) < a:
            mix = collections.Counter(o for b, o, _ in ins if labels[t.group(1)] <= b <= a)
            out.append({"n": sum(mix.values()), **{k: mix.get(k, 0) for k in ("LDG", "LDS", "FFMA", "SHFL", "BAR")}})
    return out


specs = sass.published_specs()
for name in ("lm_head", "lm_head_draft", "lm_head_dot"):
    s = specs[name]
    print(name, s.note, {k: v for k, v in s.constexprs.items() if k in ("ROWS", "BLOCK_V", "BLOCK_K", "BLOCK_R")},
          "warps", s.num_warps, "loop:", loop_mix(sass.compile_spec(s)))
