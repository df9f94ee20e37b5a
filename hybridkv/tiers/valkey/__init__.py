"""The Valkey tier: a shared pool on a Valkey or Redis server."""
