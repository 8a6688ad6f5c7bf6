"""The ops whose launch settings a run may replace (fast/kernel_settings.py's KernelSettings, a field an op), each with
the kernel plan's group that must run the op's kernel for its settings to mean anything. Imports nothing, so the CLI
names the ops in its help without importing the kernels."""

GROUP = {"moe": "moe", "linear": "linear", "o_proj": "linear", "o_proj_router": "linear", "qkv_rope_kv": "linear",
         "lm_head": "lm_head", "attention_full": "attention", "attention_sliding": "attention", "topk": "sampling"}
