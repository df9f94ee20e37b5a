"""Several tiers behind one store: union lookup, cheapest reads, write-back."""
