"""`python -m featcal.run_ta8 ...`: alias of `featcal run ...` for users of the reference scripts."""

import sys

from featcal.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["run", *sys.argv[1:]]))
