"""Tools beside the library: locally built models, real models' KV cache groups (presets),
KV caches allocated like an engine's, a local shared pool, and the simulated engine
(``sim``: the real connector driven as vLLM drives it).

Used by the command line, the tests and the benchmarks; nothing in the core
packages imports them.
"""
