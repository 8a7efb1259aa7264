"""What the benches share: measuring memory, and the parts of the larger benches. Not benches themselves."""
