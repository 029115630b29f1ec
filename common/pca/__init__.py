"""DP-PCA (DPdisPCA): the unit-ball feature map, each site's release, the coordinator's combine."""
