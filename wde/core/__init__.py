"""The engine core in its own process, and the API servers that feed it over ZeroMQ (`wde serve --api-servers N`).

`wire` is the message format, `engine_core` the core's loop, `frontend` what an API server runs before a request
reaches the core (validation, prompts, tokenization), `client` the API server's handle on the core, and
`launcher` starts and supervises the processes.
"""
