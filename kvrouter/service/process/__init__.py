"""The service as a running process: ``app.py``'s :class:`~kvrouter.service.process.app.Service` composes the
core and the edges and starts, runs and stops them; ``fronts.py`` the fronts of ``--fronts N`` (and
``fastpath_relay.py`` their one fast-path endpoint); ``health.py`` the health loop and ``/ready``;
``stats.py`` the stats segment's publisher; ``follower.py`` front 0's engine following registered workers.
"""
