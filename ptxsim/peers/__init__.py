"""Peer kernels (FA4, quack) built on the CPU for real tensors: ``(compiled_fn, call_args)`` plus float64
references, for ptxsim to run. Not imported by ptxsim itself (they need torch, cutlass and the peers installed)."""
