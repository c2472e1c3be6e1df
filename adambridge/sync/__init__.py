"""The synchronous step(): the cached step plan, pinned staging, GradScaler and clipping."""
