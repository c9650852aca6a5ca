"""The service's edges: each translates one transport into calls on the core and refusals into statuses.

``routes.py`` the aiohttp routes, ``lane.py`` the hot routes' own HTTP/1.1, ``fastpath.py`` (and its parser
``fastparse.py``) the ZMQ fast path, ``proxy.py`` ``POST /v1/completions``, ``metrics.py`` ``/metrics``;
``gate.py`` admission, the token, statuses and counters, and ``answers.py`` the answers' JSON shapes, which
they all share; ``host.py`` what they need of the process they run in. Edges import the core, never the
process layer.
"""
