"""Adapters that plug the engine-neutral connector into serving engines."""
