"""Model families over diffusers: loading, sampling and decoding under a MemoryStrategy."""
