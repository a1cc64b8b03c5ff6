"""`wde` CLI with the fault components of `tests/faults.py` registered, in this process and in every process it
spawns (`wde serve --api-servers N` re-imports this file as each child's main module, so `register()` runs there
too). Run as `python tests/serve_with_faults.py serve ...` with the repository root on PYTHONPATH."""

from tests import faults

faults.register()

if __name__ == "__main__":
    from wde.cli import main

    main()
