"""Print the README's quick-start commands, one per line: the first command line of each fenced `bash` block under
"## Quick start" (.ci/run runs exactly these)."""

import re
import sys
from pathlib import Path

text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
section = re.search(r"^## Quick start.*?(?=^## )", text, re.S | re.M)
if section is None:
    sys.exit("README.md has no '## Quick start' section")
for block in re.findall(r"```bash\n(.*?)```", section.group(0), re.S):
    print(block.strip().splitlines()[0])
