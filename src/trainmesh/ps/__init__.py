"""Parameter server: parameters sharded over server processes, workers pull and push over
ZeroMQ. See docs/parameter_server.md for the design."""
