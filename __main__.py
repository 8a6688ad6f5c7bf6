"""`python -m iquest`: the `iquest` command line."""

import sys

from .cli.main import main

sys.exit(main())
