"""A live web dashboard of the swarm (``sangama-peer dashboard``) and its Prometheus metrics.

``view`` (pure: a survey -> the page's JSON), ``live`` (the refresh task), ``metrics`` (swarm gauges), ``server``
(starlette + hypercorn, server-sent events). It imports the network layer, never torch; the CLI starts it.
"""
