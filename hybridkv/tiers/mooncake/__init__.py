"""The Mooncake Store tier: a KV pool shared by many engines and machines."""
