"""Answers "how much of this prompt would each engine load from its tiers" from outside
the engines, for routers: ``lookup`` (one engine, from its card), ``engines`` (the
engines a service answers for) and ``server`` (``hybridkv route serve``'s HTTP API).
Engine-neutral, like the connector whose search it runs.
"""
