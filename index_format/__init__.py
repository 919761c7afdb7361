"""strata.index_format: the shared contract (file specs, GGML type table, geometry). numpy at most."""
