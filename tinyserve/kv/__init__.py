"""Page allocator, bf16 and ISO KV backends, GDN state pool, prefix cache."""
