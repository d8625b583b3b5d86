"""CPU-side bookkeeping: block pool, KV cache manager, scheduler. No torch here."""
