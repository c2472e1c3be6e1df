"""torch.distributed: FSDP2 shards, shard_state (ZeRO-2 style) and their async modes."""
