#!/usr/bin/env bash
# The server's and the agent benchmark's Python packages that the lent GPU machines' image lacks (fastapi, uvicorn,
# pydantic, the openai client and what they need), as wheels in .whl/ at the repository root, at the versions of the
# environment this runs in (the one CI tested). The device cannot reach a package index; ci/gpu_plan.sh's `agent`
# stage installs them from the copy (carry .whl, or copy it into the snapshot beside ci/).
#   bash ci/device_wheels.sh        (in the project's virtual environment, with network)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
names="fastapi starlette pydantic pydantic_core typing_inspection annotated_types annotated_doc typing_extensions
  opentelemetry_api uvicorn click openai httpx2 httpcore2 truststore jiter sniffio anyio idna h11"
# name==version of each, as installed here ("-" and "_" alike)
pins=$(python3 -m pip list --format=freeze 2>/dev/null | python3 -c '
import sys
want = {n.lower().replace("_", "-") for n in sys.argv[1:]}
got = {}
for line in sys.stdin:
    name, _, version = line.strip().partition("==")
    if name.lower().replace("_", "-") in want:
        got[name.lower().replace("_", "-")] = f"{name}=={version}"
missing = sorted(want - set(got))
if missing:
    sys.exit("not installed here: " + ", ".join(missing))
print(" ".join(got[n] for n in sorted(got)))' $names)
rm -rf "$root/.whl"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$root/.whl" $pins
echo "$(ls "$root/.whl" | wc -l) wheels in .whl ($(du -sh "$root/.whl" | cut -f1))"
