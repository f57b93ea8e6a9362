"""A job's generation loop over any ring, and the target model as a whole (its tokenizer
and the one-process ring)."""
