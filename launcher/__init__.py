"""Local serving: model assets, the Triton binary from nvidia-pytriton, the launcher."""
