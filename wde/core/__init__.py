"""The engine core in its own process, and the API servers that feed it over ZeroMQ (`wde serve --api-servers N`).

`wire` is the message format, `engine_core` the core's loop, `frontend` what an API server runs before a request
reaches the core (validation, prompts, tokenization) and `client` the API server's handle on the core;
`wde.server.processes` starts the processes, restarts an API server that dies and stops them all,
`wde.server.api_server` is an API server's process and `wde.server.listeners` its sockets.
"""
