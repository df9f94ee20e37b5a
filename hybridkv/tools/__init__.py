"""Tools beside the library: locally built models and a local shared pool.

Used by the command line, the tests and the benchmarks; nothing in the core
packages imports them.
"""
