"""`evalkit bench` under its old name, for `make bench`: the arguments are `evalkit bench`'s.

    .venv/bin/python scripts/bench_loop.py [--lengths 1k,2k] [--policies h2o_head,snapkv] ...

The loop-versus-HF-generate measurement this script used to make is now the `HF generate` and
`full` rows of every length in `evalkit bench`, measured in the same run as the policies.
"""

import sys

from evalkit.cli import main

if __name__ == "__main__":
    sys.argv = ["evalkit", "bench", *sys.argv[1:]]
    main()
