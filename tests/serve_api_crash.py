"""`wde` CLI whose API-server processes die as they start (exit 7), for the launcher's start-up failure limit.

`wde serve --api-servers N` spawns its processes with multiprocessing, which names a child (`wde-api-server-0`,
...) and then re-imports this file as that child's main module: an API server exits here, before it serves,
every time it is started; the launcher and the engine core run normally. Run as
`python tests/serve_api_crash.py serve ...`.
"""

import multiprocessing
import os

if multiprocessing.current_process().name.startswith("wde-api-server-"):
    os._exit(7)

if __name__ == "__main__":
    from wde.cli import main

    main()
