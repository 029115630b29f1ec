"""DP synthetic data: mixed-type links, DP marginals and the latent factor model."""
