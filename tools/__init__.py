"""What users run against a server: the client, the benchmarks and the soak."""
