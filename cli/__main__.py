"""`python -m vidmem.cli ...`: the `vidmem` command without its console script."""

from . import main

if __name__ == "__main__":  # not when a tool imports every module
    raise SystemExit(main())
