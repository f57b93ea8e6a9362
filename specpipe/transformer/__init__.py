"""Model shards: one decoder-only transformer, loaded one layer range at a time."""
