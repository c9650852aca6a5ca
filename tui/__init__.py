"""``kvrouter top``: the live dashboard (Textual).

A top-level package beside ``kvrouter/``, as the design lays it out: the router never imports it, and it
reads the router only through a feed (``model.py``): the local shared-memory one (no request to the
router), or HTTP for a remote one.
"""
