"""The low layer: what every other part of Cryosleep builds on, importing nothing above it.

The process tree (``proctree``), the job directory and its records (``job``), the binding of the
interceptor's control block (``interceptor``); with the top-level ``errors``, ``paths`` and ``timing``.
"""
