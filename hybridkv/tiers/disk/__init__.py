"""The disk tier: objects in preallocated segment files on a local file system."""
