"""MLA (multi-head latent attention) decode kernels: all query heads share one latent KV head."""
