"""Linear and threshold queries: the sparse vector technique, the matrix mechanism, workloads."""
