"""The update's arithmetic: one AdamW step over ranges of host state, native or torch."""
