"""`iquest serve`: an OpenAI-compatible HTTP server over one engine.

One request decodes at a time on a single worker thread (`worker.py`); the others wait in a bounded
queue. `app.py` holds the routes, `protocol.py` the request models and OpenAI-style errors, `text.py`
incremental detokenization with stop strings, `metrics.py` the Prometheus counters, `server.py`
uvicorn startup (and a server-in-a-thread for embedding and tests).
"""
