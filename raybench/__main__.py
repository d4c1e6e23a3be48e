"""`python -m raybench …`: the CLI without an installed console script (a checkout on PYTHONPATH)."""

import sys

from raybench.cli.main import main

sys.exit(main())
