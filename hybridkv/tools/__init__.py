"""Tools beside the library: locally built models, real models' KV cache groups (presets),
KV caches allocated like an engine's, and a local shared pool.

Used by the command line, the tests and the benchmarks; nothing in the core
packages imports them.
"""
