"""KV tiers below the engine's paged cache: host memory and local disk, behind one interface
(engine/tiers/tier.py), fed by the blocks the prefix cache evicts (engine/tiers/kv.py)."""
