"""Testing aids that ship with the package: the independent float64 NumPy reference
of every op (`reference`) and the cases of `python -m xla_attn check` (`checks`)."""
